// batchline's int4 linear with int8 activations (W4A8), for float32 rows on CPUs with
// AVX512-VNNI (Intel Xeon from Cascade Lake on, AMD from Zen 4 on). It reads the own int4 layout
// quant_gemm_f32.cpp reads (bf16 or float32 scales and zeros), and sums integers where that
// kernel converts each code to fp32 and multiplies: one vpdpbusd multiplies 64 codes by 4 inputs
// of a row and adds them into 16 columns' int32 sums, where the float32 kernel spends a
// conversion, a mask and an FMA on 16 products. On Ice Lake the float32 kernel's one-row
// product ran at the rate of its conversions, not of memory.
//
//   int4_linear_a8(x, packed, n, bias=None) -> out
//     x:      (rows, K), contiguous float32, K a multiple of 32
//     packed: (tiles, K / 32, 320 or 384) uint8 (quant_kernel.pack_int4)
//     bias:   (n,) float32, or None
//     out:    (rows, n) float32
//   int8_activations(x) -> (codes, scales): the quantizing the product applies to x, for tests
//     and for the error it adds: codes (rows, K) int8, scales (rows, K / 32) float32
//
// Each row's group of 32 inputs is quantized on the way in, symmetric, to int8:
//   scale_x = max|x| / 127, code_x = round-half-even(x * (127 / max|x|)) in [-127, 127]
// (a group of zeros: scale 0, codes 0), as llama.cpp quantizes activations for its Q4/Q8 dot
// products. Per group the product is then
//   scale_x * (scale * sum_k code_x * code + (zero - 8 * scale) * sum_k code_x)
// with the integer sums exact: the output is the float32 product of the weight and the
// quantized activations, x rounded to 8 bits per group being the only approximation.
// A chunk of 32 code bytes (see quant_gemm_f32.cpp) read as 16 words, one per column (bits 0-3
// input 4c, 8-11 4c+1, 4-7 4c+2, 12-15 4c+3), becomes the column's 4 code bytes in input order by
// (w | w << 12) & 0x0F0F0F0F, the unsigned operand of vpdpbusd; the row's 4 int8 codes of those
// inputs, broadcast, the signed one. Tiles split over ATen's threads as the other kernels do.
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <tuple>

#include "quant_layout.h"

namespace {

using namespace batchline_quant;

// What the kernel needs of the compiler's target: AVX-512 with VNNI (and BW's byte packing).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BATCHLINE_A8 1
#endif

#if defined(BATCHLINE_A8)
constexpr bool kBuilt = true;

// One row's groups to int8 codes, their scales and their code sums.
void quantize_row(const float* x, int64_t groups, int8_t* codes, float* scales, int32_t* sums) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroup), b = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    scales[g] = amax / 127.f;
    const __m512 by = _mm512_set1_ps(inverse);
    // the MXCSR's rounding: to nearest, ties to even
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, by));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, by));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup + 16),
                     _mm512_cvtsepi32_epi8(qb));
    sums[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
}

inline __m512i broadcast4(const int8_t* p) {  // 4 int8 codes into every 32-bit lane
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return _mm512_set1_epi32(word);
}

// Rows [m0, m0 + R) of one tile; with one or two rows a chunk's products alternate between two
// accumulators (two chains of dependent vpdpbusd instead of one).
template <bool F32Scales, int R>
void tile_rows_a8(const uint8_t* tile, int64_t groups, const int8_t* xq, int64_t k_total,
                  const float* xscale, const int32_t* xsum, int64_t m0, const float* bias,
                  int64_t n0, int64_t cols, int64_t n_total, float* out) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  constexpr int64_t block_bytes = F32Scales ? kBlockF32 : kBlock;
  const __m512i low_nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  const __mmask16 valid = first_columns(cols);
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = start;
  const int8_t* xm = xq + m0 * k_total;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * block_bytes;
    prefetch_ahead(block, block_bytes);
    __m512i acc[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kChains; ++j) acc[r][j] = _mm512_setzero_si512();
    }
    const int8_t* xg = xm + g * kGroup;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c)));
      // (v | v << 12) & 0x0F0F0F0F: the column's codes of inputs 4c..4c+3, a byte each
      const __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), low_nibbles, 0xA8);
      for (int r = 0; r < R; ++r) {
        __m512i& a = acc[r][c % kChains];
        a = _mm512_dpbusd_epi32(a, w, broadcast4(xg + r * k_total + 4 * c));
      }
    }
    const __m512 scale = scales_of<F32Scales>(block, 0);
    const __m512 zero = _mm512_fnmadd_ps(eight, scale, scales_of<F32Scales>(block, 1));
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[r][0];
      for (int j = 1; j < kChains; ++j) sum = _mm512_add_epi32(sum, acc[r][j]);
      const int64_t at = (m0 + r) * groups + g;
      const float dx = xscale[at];
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(dx)),
                                 total[r]);
      total[r] = _mm512_fmadd_ps(_mm512_set1_ps(dx * static_cast<float>(xsum[at])), zero,
                                 total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * n_total + n0, valid, total[r]);
}

template <bool F32Scales, int R>
void tile_rows_a8_upto(int64_t rows, const uint8_t* tile, int64_t groups, const int8_t* xq,
                       int64_t k_total, const float* xscale, const int32_t* xsum, int64_t m0,
                       const float* bias, int64_t n0, int64_t cols, int64_t n_total, float* out) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows_a8_upto<F32Scales, R - 1>(rows, tile, groups, xq, k_total, xscale, xsum, m0, bias,
                                          n0, cols, n_total, out);
      return;
    }
  }
  tile_rows_a8<F32Scales, R>(tile, groups, xq, k_total, xscale, xsum, m0, bias, n0, cols,
                             n_total, out);
}
#else
constexpr bool kBuilt = false;
#endif

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(kBuilt, op, ": built for a CPU without AVX512-VNNI, which it needs");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous (rows, K) float32 tensor");
  TORCH_CHECK(x.size(1) % kGroup == 0, op, ": K = ", x.size(1), " is not a multiple of ", kGroup);
}

// x's int8 codes, scales and code sums per row and group, rows split over the threads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantized(const at::Tensor& x) {
  const int64_t rows = x.size(0), k_total = x.size(1), groups = k_total / kGroup;
  auto codes = at::empty({rows, k_total}, x.options().dtype(at::kChar));
  auto scales = at::empty({rows, groups}, x.options());
  auto sums = at::empty({rows, groups}, x.options().dtype(at::kInt));
#if defined(BATCHLINE_A8)
  const float* xp = x.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  int32_t* up = sums.data_ptr<int32_t>();
  const int64_t rows_per_share = std::max<int64_t>(1, 16384 / k_total);
  at::parallel_for(0, rows, rows_per_share, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xp + m * k_total, groups, cp + m * k_total, sp + m * groups, up + m * groups);
    }
  });
#endif
  return {codes, scales, sums};
}

at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const std::optional<at::Tensor>& bias) {
  check_x(x, "int4_linear_a8");
  const bool f32_scales = check_packed(packed, n, "int4_linear_a8");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  const int64_t groups = packed.size(1);
  TORCH_CHECK(k_total == groups * kGroup, "int4_linear_a8: x has ", k_total, " inputs, the weight ",
              groups * kGroup);
  const float* bias_ptr = bias_pointer(bias, n, "int4_linear_a8");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#if defined(BATCHLINE_A8)
  const auto [codes, scales, sums] = quantized(x);
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int32_t* up = sums.data_ptr<int32_t>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = groups * packed.size(2);
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      with_layout(f32_scales, [&](auto layout) {
        constexpr bool kF32 = decltype(layout)::value;
        for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
          tile_rows_a8_upto<kF32, kMaxRows>(std::min(kMaxRows, rows - m0), tile, groups, cp,
                                            k_total, sp, up, m0, bias_ptr, n0, cols, n, op);
        }
      });
    }
  });
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8_activations(const at::Tensor& x) {
  check_x(x, "int8_activations");
  auto [codes, scales, sums] = quantized(x);
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def("int4_linear_a8(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("int8_activations(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) {
  m.impl("int4_linear_a8", &int4_linear_a8);
  m.impl("int8_activations", &int8_activations);
}
