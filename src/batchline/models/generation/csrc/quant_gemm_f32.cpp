// batchline's int4 weight-only linear for float32 activations, on CPUs without AVX512-BF16
// (where a model computes in float32: AVX-512 ones, Intel Xeon from Skylake to Ice Lake, and
// AVX2-only ones, AMD EPYC before Genoa among them). It reads the packed layout quant_gemm.cpp reads (one tile of 16 output
// columns and one group of 32 inputs: 256 bytes of codes, then 16 bf16 scales and 16 bf16
// zeros: 320 bytes), the same with the scales and zeros in float32 (384 bytes), which a GGUF's
// fp16 scales are packed in for a float32 model, exact as float32 promises (bf16 would keep 8
// of their bits), and the compact one int4 quantizing packs in (8-bit steps: 290 bytes,
// quant_layout.h).
//
//   int4_linear_f32(x, packed, n, bias=None, width=512) -> out
//     x:      (rows, K), contiguous float32, K a multiple of 32
//     packed: (tiles, K / 32, 320, 384 or 290) uint8 (quant_kernel.pack_int4)
//     bias:   (n,) float32, or None
//     width:  512: AVX-512 vectors (up to 8 rows a pass); 256: AVX2's (up to 4), the only path
//             in a library built for a CPU without AVX-512
//     out:    (rows, n) float32
//   int4_dequantize_f32(packed, n, into=None) -> (n, K) float32: the weight, for a dense product
//     of many rows (a prefill chunk); written into the first n rows of `into` where given
//
// Per group the product is summed as
//   scale * sum_k x_k * code_k + (zero - 8 * scale) * sum_k x_k
// with the codes (0..15) converted to fp32 exactly and multiplied in fp32 FMAs, so no bf16
// rounding touches the activations: the weight w = (code - 8) * scale + zero is what the bf16
// kernel computes with, and only the order of the sums differs from a float64 reference.
// A chunk of 32 code bytes (inputs 4c..4c+3 of 16 columns; byte 2i+t holds column i's code of
// input 4c+t in its low nibble and of 4c+2+t in its high one) is read as 16 little-endian
// 16-bit words, one per column: bits 0-3 input 4c, 8-11 4c+1, 4-7 4c+2, 12-15 4c+3. Each of the
// four is one shift and mask away from a vector of 16 columns' codes, used for up to 8 rows.
// Tiles are split over ATen's intra-op threads as in quant_gemm.cpp: the same bits at any count.
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_layout.h"

namespace {

using namespace batchline_quant;

#if defined(__AVX512F__)
// Rows [m0, m0 + R) of one tile. With one or two rows the four inputs of a chunk sum into
// accumulators of their own (four or two chains of dependent FMAs per row instead of one).
template <Layout L, int R>
void tile_rows_f32(const uint8_t* tile, int64_t groups, const float* x, int64_t k_total,
                   const float* xsum, int64_t m0, const float* bias, int64_t n0, int64_t cols,
                   int64_t n_total, float* out) {
  constexpr int kChains = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  const __mmask16 valid = first_columns(cols);
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = start;
  const float* xm = x + m0 * k_total;
  constexpr int64_t bytes = block_bytes<L>();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    prefetch_ahead(block, bytes);
    __m512 acc[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kChains; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    const float* xg = xm + g * kGroup;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c)));
      const __m512 w[4] = {
          _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble)),                      // input 4c
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), nibble)),  // 4c + 1
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble)),  // 4c + 2
          _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 12))};                          // 4c + 3
      for (int r = 0; r < R; ++r) {
        const float* xr = xg + r * k_total + 4 * c;
        for (int j = 0; j < 4; ++j) {
          acc[r][j % kChains] = _mm512_fmadd_ps(w[j], _mm512_set1_ps(xr[j]), acc[r][j % kChains]);
        }
      }
    }
    __m512 scale, zero;
    scales_zeros<L>(block, scale, zero);
    zero = _mm512_fnmadd_ps(eight, scale, zero);
    const float* sums = xsum + m0 * groups + g;
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[r][0];
      for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, acc[r][j]);
      total[r] = _mm512_fmadd_ps(sum, scale, total[r]);
      total[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * groups]), zero, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * n_total + n0, valid, total[r]);
}

// One tile's weights into its rows of the (n, K) output: per group and chunk the four inputs'
// 16 columns are computed as fp32 vectors, transposed in registers into 16 runs of 4 inputs and
// put into a 16 x 32 buffer in L1, whose 128-byte rows are then copied to the output's rows
// (the last tile's padding rows left out), as quant_gemm.cpp's bf16 dequantizing does. Each
// weight is (code - 8) * scale + zero rounded once: float64's value rounded to float32.
template <Layout L>
void dequantize_tile_f32(const uint8_t* tile, int64_t groups, int64_t cols, int64_t k_total,
                         float* rows) {
  constexpr int64_t bytes = block_bytes<L>();
  const __m512i nibble = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  alignas(64) float buffer[kTile * kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    __m512 scale, zero;
    scales_zeros<L>(block, scale, zero);
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c)));
      auto weight = [&](__m512i codes) {  // code - 8 is exact: one rounding, in the fma
        return _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), eight), scale, zero);
      };
      const __m512 w0 = weight(_mm512_and_si512(v, nibble));
      const __m512 w1 = weight(_mm512_and_si512(_mm512_srli_epi32(v, 8), nibble));
      const __m512 w2 = weight(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble));
      const __m512 w3 = weight(_mm512_srli_epi32(v, 12));
      // per 128-bit lane L (columns 4L..4L+3): q-th vector = column 4L+q's inputs 4c..4c+3
      const __m512 lo01 = _mm512_unpacklo_ps(w0, w1), hi01 = _mm512_unpackhi_ps(w0, w1);
      const __m512 lo23 = _mm512_unpacklo_ps(w2, w3), hi23 = _mm512_unpackhi_ps(w2, w3);
      const __m512 q[4] = {_mm512_shuffle_ps(lo01, lo23, 0x44), _mm512_shuffle_ps(lo01, lo23, 0xEE),
                           _mm512_shuffle_ps(hi01, hi23, 0x44), _mm512_shuffle_ps(hi01, hi23, 0xEE)};
      float* at = buffer + 4 * c;
      for (int i = 0; i < 4; ++i) {
        _mm_store_ps(at + (0 + i) * kGroup, _mm512_castps512_ps128(q[i]));
        _mm_store_ps(at + (4 + i) * kGroup, _mm512_extractf32x4_ps(q[i], 1));
        _mm_store_ps(at + (8 + i) * kGroup, _mm512_extractf32x4_ps(q[i], 2));
        _mm_store_ps(at + (12 + i) * kGroup, _mm512_extractf32x4_ps(q[i], 3));
      }
    }
    for (int64_t i = 0; i < cols; ++i) {
      float* row = rows + i * k_total + g * kGroup;
      _mm512_storeu_ps(row, _mm512_load_ps(buffer + i * kGroup));
      _mm512_storeu_ps(row + 16, _mm512_load_ps(buffer + i * kGroup + 16));
    }
  }
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// The same sums in 256-bit vectors, for AVX2-only CPUs (and, by `width`, measured against the
// 512-bit path on AVX-512 ones): a tile's 16 columns are two halves of 8, each chunk's 16 words
// two loads of 8. AVX2 has 16 vector registers: up to 4 rows a pass, their totals in memory.
constexpr int64_t kMaxRows256 = 4;

template <Layout L, int R>
void tile_rows_256(const uint8_t* tile, int64_t groups, const float* x, int64_t k_total,
                   const float* xsum, int64_t m0, const float* bias, int64_t n0, int64_t cols,
                   int64_t n_total, float* out) {
  constexpr int kChains = R == 1 ? 2 : 1;
  constexpr int64_t bytes = block_bytes<L>();
  const __m256i nibble = _mm256_set1_epi32(15);
  const __m256 eight = _mm256_set1_ps(8.f);
  alignas(32) float total[R][kTile];
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < kTile; ++i) total[r][i] = bias && i < cols ? bias[n0 + i] : 0.f;
  }
  const float* xm = x + m0 * k_total;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    prefetch_ahead(block, bytes);
    __m256 acc[R][2][kChains];
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < kChains; ++j) acc[r][h][j] = _mm256_setzero_ps();
      }
    }
    const float* xg = xm + g * kGroup;
    for (int c = 0; c < 8; ++c) {
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7: their words, as in the 512-bit path
        const __m256i v = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * c + 16 * h)));
        const __m256 w[4] = {
            _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12))};
        for (int r = 0; r < R; ++r) {
          const float* xr = xg + r * k_total + 4 * c;
          for (int j = 0; j < 4; ++j) {
            __m256& a = acc[r][h][j % kChains];
            a = _mm256_fmadd_ps(w[j], _mm256_broadcast_ss(xr + j), a);
          }
        }
      }
    }
    const float* sums = xsum + m0 * groups + g;
    for (int h = 0; h < 2; ++h) {
      __m256 scale, zero;
      half_scales_zeros<L>(block, h, scale, zero);
      zero = _mm256_fnmadd_ps(eight, scale, zero);
      for (int r = 0; r < R; ++r) {
        __m256 sum = acc[r][h][0];
        for (int j = 1; j < kChains; ++j) sum = _mm256_add_ps(sum, acc[r][h][j]);
        __m256 t = _mm256_load_ps(total[r] + 8 * h);
        t = _mm256_fmadd_ps(sum, scale, t);
        t = _mm256_fmadd_ps(_mm256_set1_ps(sums[r * groups]), zero, t);
        _mm256_store_ps(total[r] + 8 * h, t);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(out + (m0 + r) * n_total + n0, total[r], cols * sizeof(float));
  }
}

#endif  // __AVX2__ && __FMA__

// The weight of one tile in plain C++ (for CPUs without AVX-512; the compiler vectorizes it
// for the one it builds for): each (code - 8) * scale + zero rounded once, as the vector path.
template <Layout L>
void dequantize_tile_plain(const uint8_t* tile, int64_t groups, int64_t cols, int64_t k_total,
                           float* rows) {
  constexpr int64_t bytes = block_bytes<L>();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    for (int64_t i = 0; i < cols; ++i) {
      float scale, zero;
      column_scale_zero<L>(block, i, scale, zero);
      float* row = rows + i * k_total + g * kGroup;
      for (int c = 0; c < 8; ++c) {
        for (int t = 0; t < 2; ++t) {
          const uint8_t byte = block[32 * c + 2 * i + t];
          row[4 * c + t] = std::fma(static_cast<float>(byte & 15) - 8.f, scale, zero);
          row[4 * c + 2 + t] = std::fma(static_cast<float>(byte >> 4) - 8.f, scale, zero);
        }
      }
    }
  }
}

at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias, int64_t width) {
#if !defined(__AVX2__) || !defined(__FMA__)
  TORCH_CHECK(false, "int4_linear_f32: built for a CPU without AVX2 and FMA, which it needs");
#endif
  TORCH_CHECK(width == 256 || width == 512, "int4_linear_f32: width must be 256 or 512, not ",
              width);
#if !defined(__AVX512F__)
  width = 256;  // the only path built
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_linear_f32: x must be a contiguous (rows, K) float32 tensor");
  const Layout layout = check_packed(packed, n, "int4_linear_f32");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  const int64_t groups = packed.size(1);
  TORCH_CHECK(k_total == groups * kGroup, "int4_linear_f32: x has ", k_total,
              " inputs, the weight ", groups * kGroup);
  const float* bias_ptr = bias_pointer(bias, n, "int4_linear_f32");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(rows * groups);  // each row's sum per group, for the zeros
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xp + m * k_total + g * kGroup;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < kGroup; ++k) s += xg[k];
      xsum[m * groups + g] = s;
    }
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const float* sp = xsum.data();
  const int64_t tile_bytes = groups * packed.size(2);
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      with_layout(layout, [&](auto kind) {
        constexpr Layout kL = decltype(kind)::value;
#if defined(__AVX512F__)
        if (width == 512) {
          for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
            with_rows<kMaxRows>(std::min(kMaxRows, rows - m0), [&](auto r) {
              tile_rows_f32<kL, decltype(r)::value>(tile, groups, xp, k_total, sp, m0, bias_ptr,
                                                      n0, cols, n, op);
            });
          }
          return;
        }
#endif
        for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows256) {
          with_rows<kMaxRows256>(std::min(kMaxRows256, rows - m0), [&](auto r) {
            tile_rows_256<kL, decltype(r)::value>(tile, groups, xp, k_total, sp, m0, bias_ptr,
                                                    n0, cols, n, op);
          });
        }
      });
    }
  });
#endif
  return out;
}

at::Tensor int4_dequantize_f32(const at::Tensor& packed, int64_t n,
                               const std::optional<at::Tensor>& into) {
  const Layout layout = check_packed(packed, n, "int4_dequantize_f32");
  const int64_t tiles = packed.size(0), groups = packed.size(1), k_total = groups * kGroup;
  at::Tensor out;
  if (into.has_value()) {  // a buffer of the caller's, reused: no fresh pages to fault in
    TORCH_CHECK(into->scalar_type() == at::kFloat && into->is_contiguous() && into->dim() == 2 &&
                    into->size(0) >= n && into->size(1) == k_total,
                "int4_dequantize_f32: into must be a contiguous float32 tensor of at least (",
                n, ", ", k_total, ")");
    out = into->narrow(0, 0, n);
  } else {
    out = at::empty({n, k_total}, packed.options().dtype(at::kFloat));
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = groups * packed.size(2);
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kTile, n - t * kTile);
      const uint8_t* tile = wp + t * tile_bytes;
      float* rows = op + t * kTile * k_total;
      with_layout(layout, [&](auto kind) {
        constexpr Layout kL = decltype(kind)::value;
#if defined(__AVX512F__)
        dequantize_tile_f32<kL>(tile, groups, cols, k_total, rows);
#else
        dequantize_tile_plain<kL>(tile, groups, cols, k_total, rows);
#endif
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def(
      "int4_linear_f32(Tensor x, Tensor packed, int n, Tensor? bias=None, int width=512)"
      " -> Tensor");
  m.def("int4_dequantize_f32(Tensor packed, int n, Tensor? into=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) {
  m.impl("int4_linear_f32", &int4_linear_f32);
  m.impl("int4_dequantize_f32", &int4_dequantize_f32);
}
