// batchline's int4 (and per-channel int8, below) weight-only linears for a decode step's few
// rows (1-16), bf16 activations.
//
//   int4_linear(x, packed, n, bias=None, amx_rows=2) -> out
//     x:        (rows, K), contiguous bfloat16, K a multiple of 32
//     packed:   (tiles, K / 32, 320 or 290) uint8, the layout below (quant_kernel.pack_int4)
//               or with 8-bit steps (quant_kernel.pack_int4_steps)
//     n:        the output columns (<= tiles * 16; the rest of the last tile is padding)
//     bias:     (n,) float32, or None
//     amx_rows: from this many rows on, AMX tiles where the CPU has them (and Linux grants
//               them), else vdpbf16ps
//     out:      (rows, n) bfloat16
//
// The weight is groups of 32 inputs per output column, w = (code - 8) * scale + zero (codes in
// [0, 15], scale and zero in bf16). Per group the product is summed as
//   scale * sum_k x_k * (code_k - 8) + zero * sum_k x_k
// so each code goes to bf16 exactly (-8..7), the bf16 products are exact in fp32, and the scale
// and zero are applied once per group in fp32; out is rounded to bf16 once, bias included.
//
// The packed layout, for 16 output columns (a tile) and one group, 320 bytes: 8 chunks of 32
// bytes, then the 16 scales and the 16 zeros as bf16 (or, 290 bytes, the 16 scales and zeros as
// 8-bit steps of a bf16 unit: quant_layout.h; the kernels below read either, scales_zeros). Chunk c holds inputs 4c..4c+3 of the
// group: byte 2i+t has the code of column i at input 4c+t in its low nibble and at 4c+2+t in its
// high one. Widened to 16 bits, the low nibbles are then vdpbf16ps's operand for the input pair
// (4c, 4c+1) against 16 columns and the high ones for (4c+2, 4c+3): one chunk's codes are
// unpacked once and used for up to 8 rows. The 16 such vectors of a group are also the B tile
// of an AMX product (16 input pairs x 16 columns), so the AMX path widens them into a buffer
// once per group and multiplies them with up to 16 rows at a time. A tile's groups follow each
// other, so a tile is read as one stream. Tiles are split over ATen's intra-op threads, each
// tile's columns summed by one thread in one order, so any thread count gives the same bits.
// (at::parallel_for splits only in a library compiled with OpenMP, as decode_kernel builds it;
// before that it ran every tile on the calling thread, and a second thread gained nothing.)
// Each thread configures its own AMX tiles and releases them when its share is done.
//
// Built for a CPU without AVX512-BF16, the ops raise an error: the Python side calls them only
// where the CPU has it (quant_kernel.own_kernels). float32 activations on AVX-512 CPUs without
// it take the same layout through quant_gemm_f32.cpp; elsewhere torch's kernels.
// Built with decode_attention.cpp by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "quant_layout.h"

namespace {

using namespace batchline_quant;

#if defined(__AVX512BF16__)
inline __m512i pair_of(const uint16_t* p) {  // (p[0], p[1]) in every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm512_set1_epi32(bits);
}

// Rows [m0, m0 + R) of one tile: each chunk's 64 codes are widened once and used for all R
// rows. Per row, the low and high nibbles sum into accumulators of their own, and with one or
// two rows each of those into two, alternating chunks (kSplit): four short chains of dependent
// vdpbf16ps instead of two long ones. The weights ahead are prefetched (prefetch_ahead).
template <Layout L, int R>
void tile_rows(const uint8_t* tile, int64_t groups, const uint16_t* x, int64_t k_total,
               const float* xsum, int64_t m0, const float* bias, int64_t n0, int64_t cols,
               int64_t n_total, uint16_t* out) {
  constexpr int kSplit = R <= 2 ? 2 : 1;
  // bf16 of -8..7, indexed by the code (the upper 16 entries are never indexed)
  alignas(64) static const uint16_t kValues[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m512i table = _mm512_load_si512(kValues);
  const __m512i nibble = _mm512_set1_epi16(15);
  const __mmask16 valid = cols >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  __m512 total[R];
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) total[r] = start;
  const uint16_t* xm = x + m0 * k_total;
  constexpr int64_t bytes = block_bytes<L>();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    prefetch_ahead(block, bytes);
    __m512 low[R][kSplit], high[R][kSplit];
    for (int r = 0; r < R; ++r) {
      for (int s = 0; s < kSplit; ++s) low[r][s] = high[r][s] = _mm512_setzero_ps();
    }
    const uint16_t* xg = xm + g * kGroup;
    for (int c = 0; c < 8; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
      const __m512i wide = _mm512_cvtepu8_epi16(raw);
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(wide, nibble), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
      const int s = c % kSplit;
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = xg + r * k_total + 4 * c;
        low[r][s] = _mm512_dpbf16_ps(low[r][s], (__m512bh)pair_of(xr), w0);
        high[r][s] = _mm512_dpbf16_ps(high[r][s], (__m512bh)pair_of(xr + 2), w1);
      }
    }
    __m512 scale, zero;
    scales_zeros<L>(block, scale, zero);
    const float* sums = xsum + m0 * groups + g;
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_add_ps(low[r][0], high[r][0]);
      if constexpr (kSplit == 2) sum = _mm512_add_ps(sum, _mm512_add_ps(low[r][1], high[r][1]));
      total[r] = _mm512_fmadd_ps(sum, scale, total[r]);
      total[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * groups]), zero, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(total[r]);
    _mm256_mask_storeu_epi16(out + (m0 + r) * n_total + n0, valid, h);
  }
}

template <Layout L, int R>
void tile_rows_upto(int64_t rows, const uint8_t* tile, int64_t groups, const uint16_t* x,
                    int64_t k_total, const float* xsum, int64_t m0, const float* bias, int64_t n0,
                    int64_t cols, int64_t n_total, uint16_t* out) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows_upto<L, R - 1>(rows, tile, groups, x, k_total, xsum, m0, bias, n0, cols, n_total,
                            out);
      return;
    }
  }
  tile_rows<L, R>(tile, groups, x, k_total, xsum, m0, bias, n0, cols, n_total, out);
}

#if defined(BATCHLINE_AMX)
// Tile 0: rows x 32 bf16 of x; tiles 1 and 4: the 16 input pairs x 16 columns of one group's
// codes (the layout vdpbf16ps reads, which is AMX's too); tiles 2 and 3: rows x 16 fp32 sums.
// Two of each so that consecutive groups do not wait on each other's tile.
void configure_tiles(int64_t rows) {
  alignas(64) TileConfig config;
  config.rows[0] = config.rows[2] = config.rows[3] = static_cast<uint8_t>(rows);
  config.rows[1] = config.rows[4] = 16;
  for (int t = 0; t < 5; ++t) config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// One group's codes widened to bf16 into a 1 KiB buffer, in the tiles' layout.
inline void widen_codes(const uint8_t* block, __m512i table, uint16_t* weights) {
  const __m512i nibble = _mm512_set1_epi16(15);
  for (int c = 0; c < 8; ++c) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
    const __m512i wide = _mm512_cvtepu8_epi16(raw);
    _mm512_store_si512(weights + 64 * c,
                       _mm512_permutexvar_epi16(_mm512_and_si512(wide, nibble), table));
    _mm512_store_si512(weights + 64 * c + 32,
                       _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table));
  }
}

// Rows [m0, m0 + rows) of one tile, rows <= 16 (the tiles configured for that many): per
// group the codes are widened once, one tile product sums them against every row, and the
// group's scale and zero are applied to its rows x 16 sums two groups later, and the next
// group's codes are widened before this one's product (so that neither waits on a store).
template <Layout L>
void tile_rows_amx(const uint8_t* tile, int64_t groups, const uint16_t* x, int64_t k_total,
                   const float* xsum, int64_t m0, int64_t rows, const float* bias, int64_t n0,
                   int64_t cols, int64_t n_total, uint16_t* out) {
  alignas(64) static const uint16_t kValues[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m512i table = _mm512_load_si512(kValues);
  const __mmask16 valid = cols >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  alignas(64) uint16_t weights[2][16 * 32];
  alignas(64) float sums[3][16 * 16];
  __m512 total[16];
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) total[r] = start;
  const uint16_t* xm = x + m0 * k_total;
  constexpr int64_t bytes = block_bytes<L>();
  auto apply = [&](int64_t g) {  // group g's sums, scale and zero, into the totals
    __m512 scale, zero;
    scales_zeros<L>(tile + g * bytes, scale, zero);
    const float* xs = xsum + m0 * groups + g;
    const float* s = sums[g % 3];
    for (int64_t r = 0; r < rows; ++r) {
      total[r] = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * r), scale, total[r]);
      total[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * groups]), zero, total[r]);
    }
  };
  widen_codes(tile, table, weights[0]);
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(tile + g * bytes, bytes);
    if (g + 1 < groups) widen_codes(tile + (g + 1) * bytes, table, weights[(g + 1) & 1]);
    _tile_loadd(0, xm + g * kGroup, k_total * 2);
    if (g & 1) {
      _tile_zero(3);
      _tile_loadd(4, weights[1], 64);
      _tile_dpbf16ps(3, 0, 4);
      _tile_stored(3, sums[g % 3], 64);
    } else {
      _tile_zero(2);
      _tile_loadd(1, weights[0], 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_stored(2, sums[g % 3], 64);
    }
    if (g >= 2) apply(g - 2);
  }
  for (int64_t g = std::max<int64_t>(0, groups - 2); g < groups; ++g) apply(g);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(total[r]);
    _mm256_mask_storeu_epi16(out + (m0 + r) * n_total + n0, valid, h);
  }
}
#endif  // AMX
#endif  // __AVX512BF16__

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias, int64_t amx_rows) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "int4_linear: built for a CPU without AVX512-BF16, which it needs");
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_linear: x must be a contiguous (rows, K) bfloat16 tensor");
  const Layout layout = check_packed(packed, n, "int4_linear");
  TORCH_CHECK(layout != Layout::kF32,
              "int4_linear: bf16 rows take bf16 or 8-bit-step scales (a block of 320 or 290 "
              "bytes), not float32 ones");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  const int64_t groups = packed.size(1);
  TORCH_CHECK(k_total == groups * kGroup, "int4_linear: x has ", k_total, " inputs, the weight ",
              groups * kGroup);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int4_linear: bias must be a contiguous (n,) float32 tensor");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // each row's sum per group, for the zeros, before the threads split the tiles: vectorized
  // (16 rows of 8,960 inputs, alone: 40 us as a chain of dependent adds, 24 us so)
  std::vector<float> xsum(rows * groups);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = xp + m * k_total + g * kGroup;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < kGroup; ++k) s += bf16_to_float(xg[k]);
      xsum[m * groups + g] = s;
    }
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* sp = xsum.data();
  const int64_t tile_bytes = groups * packed.size(2);
  const int64_t grain = tiles_per_share(tile_bytes);
#if defined(BATCHLINE_AMX)
  if (rows >= amx_rows && amx_permitted()) {
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      int64_t configured = 0;
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = wp + t * tile_bytes;
        const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
          const int64_t count = std::min<int64_t>(16, rows - m0);
          if (count != configured) configure_tiles(configured = count);
          with_layout(layout, [&](auto kind) {
            tile_rows_amx<decltype(kind)::value>(tile, groups, xp, k_total, sp, m0, count,
                                                 bias_ptr, n0, cols, n, op);
          });
        }
      }
      _tile_release();
    });
    return out;
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int64_t count = std::min(kMaxRows, rows - m0);
#if defined(__AVX512BF16__)
        with_layout(layout, [&](auto kind) {
          tile_rows_upto<decltype(kind)::value, kMaxRows>(count, tile, groups, xp, k_total, sp,
                                                          m0, bias_ptr, n0, cols, n, op);
        });
#endif
      }
    }
  });
  return out;
}

// ---- int4_dequantize(packed, n) -> (n, K) bf16: the weight the layout holds ----
//
// For a product of many rows (a prefill chunk), where a dense bf16 product of the weight
// beats the kernel's passes over it. Each weight is (code - 8) * scale + zero in fp32 (one
// fma), rounded to bf16 once. Per tile and group: each chunk's codes are widened to fp32 lanes
// (column i, input pair t) and put as bf16 pairs into a 16 x 32 buffer (a scatter of 32-bit
// words within L1), whose rows, 64 bytes each, are then stored to the 16 rows of the output
// (the last tile's padding rows left out). Scattering straight into the output's rows took
// twice as long.
#if defined(__AVX512BF16__)
template <Layout L>
void dequantize_tile(const uint8_t* tile, int64_t groups, int64_t cols, int64_t k_total,
                     uint16_t* rows) {
  // lane d of a 16-dword vector is column d: its 32-bit word's offset in the buffer, in bf16s
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(kGroup)));
  // fp32 lane l of a half holds column l / 2 (first half) or 8 + l / 2 (second half)
  const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 eight = _mm512_set1_ps(8.f);
  alignas(64) uint16_t buffer[kTile * kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * block_bytes<L>();
    __m512 scale, zero;
    scales_zeros<L>(block, scale, zero);
    const __m512 s0 = _mm512_permutexvar_ps(first, scale);
    const __m512 s1 = _mm512_permutexvar_ps(second, scale);
    const __m512 z0 = _mm512_permutexvar_ps(first, zero);
    const __m512 z1 = _mm512_permutexvar_ps(second, zero);
    for (int c = 0; c < 8; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
      const __m512i wide = _mm512_cvtepu8_epi16(raw);
      const __m512i nibbles[2] = {_mm512_and_si512(wide, _mm512_set1_epi16(15)),
                                  _mm512_srli_epi16(wide, 4)};
      for (int h = 0; h < 2; ++h) {  // inputs 4c, 4c + 1 (low nibbles), 4c + 2, 4c + 3 (high)
        const __m512 a =
            _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(nibbles[h])));
        const __m512 b = _mm512_cvtepi32_ps(
            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(nibbles[h], 1)));
        const __m512 wa = _mm512_fmadd_ps(_mm512_sub_ps(a, eight), s0, z0);
        const __m512 wb = _mm512_fmadd_ps(_mm512_sub_ps(b, eight), s1, z1);
        const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(wb, wa);  // dword d: column d's pair
        _mm512_i32scatter_epi32(buffer + 4 * c + 2 * h, offsets, pairs, 2);
      }
    }
    for (int64_t i = 0; i < cols; ++i) {
      _mm512_storeu_si512(rows + i * k_total + g * kGroup, _mm512_load_si512(buffer + i * kGroup));
    }
  }
}
#endif

at::Tensor int4_dequantize(const at::Tensor& packed, int64_t n) {
  const Layout layout = check_packed(packed, n, "int4_dequantize");
  TORCH_CHECK(layout != Layout::kF32,
              "int4_dequantize: takes bf16 or 8-bit-step scales (a block of 320 or 290 bytes)");
  const int64_t tiles = packed.size(0), groups = packed.size(1), k_total = groups * kGroup;
  auto out = at::empty({n, k_total}, packed.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t tile_bytes = groups * packed.size(2);
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      with_layout(layout, [&](auto kind) {
        dequantize_tile<decltype(kind)::value>(wp + t * tile_bytes, groups,
                                               std::min(kTile, n - t * kTile), k_total,
                                               op + t * kTile * k_total);
      });
    }
  });
#else
  TORCH_CHECK(false, "int4_dequantize: built for a CPU without AVX512-BF16");
#endif
  return out;
}

// ---- int8, one scale per output column: w = code * scale, codes in [-127, 127] ----
//
//   int8_linear(x, packed, scales, n, bias=None, amx_rows=2) -> out
//     packed: (tiles, K / 2, 32) int8: per 16 output columns and input pair (k, k+1), byte
//             2i+t the code of column i at input k+t (vdpbf16ps's and AMX's operand layout)
//     scales: (tiles * 16,) float32, zero past n
// Each code goes to bf16 exactly, the sums over all K run in fp32 and the scale and bias are
// applied once at the end.

#if defined(__AVX512BF16__)
inline __m512bh widen_int8(const int8_t* p) {  // 32 int8 codes -> 32 bf16
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(high, low);
}

inline void store_scaled(const __m512* sums, int64_t rows, const float* scales,
                         const float* bias, int64_t m0, int64_t n0, int64_t cols,
                         int64_t n_total, uint16_t* out) {
  const __mmask16 valid = cols >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 scale = _mm512_maskz_loadu_ps(valid, scales + n0);
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(sums[r], scale, start));
    _mm256_mask_storeu_epi16(out + (m0 + r) * n_total + n0, valid, h);
  }
}

template <int R>
void tile_rows_int8(const int8_t* tile, const uint16_t* x, int64_t k_total, int64_t m0,
                    const float* scales, const float* bias, int64_t n0, int64_t cols,
                    int64_t n_total, uint16_t* out) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const uint16_t* xm = x + m0 * k_total;
  for (int64_t k = 0; k < k_total; k += 4) {  // two input pairs a step: one line of codes
    prefetch_ahead(tile + 16 * k, 64);
    const __m512bh w0 = widen_int8(tile + 16 * k);
    const __m512bh w1 = widen_int8(tile + 16 * k + 32);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)pair_of(xm + r * k_total + k), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)pair_of(xm + r * k_total + k + 2), w1);
    }
  }
  for (int r = 0; r < R; ++r) even[r] = _mm512_add_ps(even[r], odd[r]);
  store_scaled(even, R, scales, bias, m0, n0, cols, n_total, out);
}

template <int R>
void tile_rows_int8_upto(int64_t rows, const int8_t* tile, const uint16_t* x, int64_t k_total,
                         int64_t m0, const float* scales, const float* bias, int64_t n0,
                         int64_t cols, int64_t n_total, uint16_t* out) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows_int8_upto<R - 1>(rows, tile, x, k_total, m0, scales, bias, n0, cols, n_total,
                                 out);
      return;
    }
  }
  tile_rows_int8<R>(tile, x, k_total, m0, scales, bias, n0, cols, n_total, out);
}

#if defined(BATCHLINE_AMX)
// Rows [m0, m0 + rows) of one tile through AMX: per 32 inputs the codes are widened into a
// buffer (the next group's before this one's product) and one tile product adds them into the
// same sums, stored once at the end.
void tile_rows_int8_amx(const int8_t* tile, const uint16_t* x, int64_t k_total, int64_t m0,
                        int64_t rows, const float* scales, const float* bias, int64_t n0,
                        int64_t cols, int64_t n_total, uint16_t* out) {
  alignas(64) uint16_t weights[2][16 * 32];
  alignas(64) float sums[16 * 16];
  const int64_t groups = k_total / kGroup;
  auto widen = [&](int64_t g, uint16_t* into) {
    for (int p = 0; p < 16; ++p) {
      _mm512_store_si512(into + 32 * p, (__m512i)widen_int8(tile + (g * 16 + p) * 32));
    }
  };
  const uint16_t* xm = x + m0 * k_total;
  _tile_zero(2);
  widen(0, weights[0]);
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead(tile + g * 16 * 32, 16 * 32);
    if (g + 1 < groups) widen(g + 1, weights[(g + 1) & 1]);
    _tile_loadd(0, xm + g * kGroup, k_total * 2);
    if (g & 1) {
      _tile_loadd(4, weights[1], 64);
      _tile_dpbf16ps(2, 0, 4);
    } else {
      _tile_loadd(1, weights[0], 64);
      _tile_dpbf16ps(2, 0, 1);
    }
  }
  _tile_stored(2, sums, 64);
  __m512 rows_sums[16];
  for (int64_t r = 0; r < rows; ++r) rows_sums[r] = _mm512_load_ps(sums + 16 * r);
  store_scaled(rows_sums, rows, scales, bias, m0, n0, cols, n_total, out);
}
#endif  // BATCHLINE_AMX
#endif  // __AVX512BF16__

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t n, const std::optional<at::Tensor>& bias, int64_t amx_rows) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "int8_linear: built for a CPU without AVX512-BF16, which it needs");
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int8_linear: x must be a contiguous (rows, K) bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 2 * kTile,
              "int8_linear: packed must be int8_pack's (tiles, K / 2, 32) int8 tensor");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(k_total == 2 * packed.size(1) && k_total % kGroup == 0, "int8_linear: x has ",
              k_total, " inputs, the weight ", 2 * packed.size(1), " (a multiple of 32)");
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, "int8_linear: n = ", n,
              " does not fit ", tiles, " tiles of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == tiles * kTile,
              "int8_linear: scales must be a contiguous (tiles * 16,) float32 tensor");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int8_linear: bias must be a contiguous (n,) float32 tensor");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t tile_bytes = k_total * kTile;
  const int64_t grain = tiles_per_share(tile_bytes);
#if defined(BATCHLINE_AMX)
  if (rows >= amx_rows && amx_permitted()) {
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      int64_t configured = 0;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
          const int64_t count = std::min<int64_t>(16, rows - m0);
          if (count != configured) configure_tiles(configured = count);
          tile_rows_int8_amx(wp + t * tile_bytes, xp, k_total, m0, count, sp, bias_ptr, n0, cols,
                             n, op);
        }
      }
      _tile_release();
    });
    return out;
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int64_t count = std::min(kMaxRows, rows - m0);
#if defined(__AVX512BF16__)
        tile_rows_int8_upto<kMaxRows>(count, tile, xp, k_total, m0, sp, bias_ptr, n0, cols, n,
                                      op);
#endif
      }
    }
  });
  return out;
}

// How many pieces at::parallel_for cut `items` into here: torch's intra-op thread count (up to
// `items`) when the library was compiled with OpenMP, 1 when the header's serial fallback ran.
int64_t parallel_chunks(int64_t items) {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { chunks.fetch_add(1); });
  return chunks.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def("parallel_chunks(int items) -> int", &parallel_chunks);  // no tensors: a catch-all
  m.def(
      "int4_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, int amx_rows=2)"
      " -> Tensor");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias=None,"
      " int amx_rows=2) -> Tensor");
  m.def("int4_dequantize(Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_dequantize", &int4_dequantize);
}
