// batchline's dense bf16 linear, for CPUs with AVX512-BF16 and no AMX (AMD EPYC from Zen 4),
// where oneDNN's bf16 product streams a decode step's weights at two thirds of what the memory
// gives (a 1.7B-shaped layer at one row: 26 GB/s against a 42 GB/s copy).
//
//   bf16_tiles_linear(x, tiles, n, bias=None) -> out
//     x:     (rows, K), contiguous bfloat16, K even
//     tiles: (ceil(n / 16), K / 2, 16) int32, the weight in tiles of 16 output columns: entry
//            [t, p, j] holds column 16t+j's inputs 2p (low half) and 2p+1 (high half) as bf16,
//            the padding columns of the last tile zero (dense_tiles.tile_weight)
//     n:     the output columns
//     bias:  (n,) float32, or None
//     out:   (rows, n) bfloat16
//
// A tile's 64-byte line p is vdpbf16ps's operand for the input pair (2p, 2p+1) against 16
// columns: one broadcast of a row's pair and one instruction sum it into 16 columns' float32
// accumulators, so no sum crosses lanes and each output is rounded to bf16 once, bias included.
// A tile is one stream of K * 32 bytes; a pass takes 4 tiles at a time against up to 8 rows
// (the accumulators, rows x tiles, fill at most 16 of the 32 vector registers), then the next
// rows against the same tiles, read from L2 again, not from memory. Measured against oneDNN's
// packed weights (torch.ops.mkldnn._linear_pointwise) on a 1.7B-shaped layer, 2 threads, Zen 4
// EPYC, 2026-12-04: x0.71 the time at one row (35 GB/s read), x0.80 at 4, x0.77 at 8, x0.90-0.92
// at 16, x0.94-0.99 from 32 to 256 rows (a prefill chunk): the same layout serves every step.
// Tiles are split over ATen's intra-op threads, each output summed by one thread in one order,
// so any thread count gives the same bits. Built for a CPU without AVX512-BF16 the op raises:
// the Python side lays weights out so only where the CPU has it (dense_tiles.py).
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "quant_layout.h"

namespace {

using namespace batchline_quant;

// Tiles per pass over the rows: 4 tiles of a 2,048-input weight are 256 KiB, in L2 for the
// rows after the first 8.
constexpr int64_t kPassTiles = 4;

#if defined(__AVX512BF16__)
// Rows [0, R) of `x` against tiles [t0, t0 + C): `x` holds the rows' input pairs (K/2 int32
// each), `out` the rows' outputs (n each).
template <int R, int C>
void rows_by_tiles(const int32_t* x, int64_t half_k, const int32_t* tiles, int64_t t0,
                   const float* bias, int64_t n, uint16_t* out) {
  const int64_t stride = half_k * kTile;
  __m512 acc[R][C];
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (t0 + c) * kTile;
    const __m512 start =
        bias ? _mm512_maskz_loadu_ps(first_columns(n - n0), bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][c] = start;
  }
  const int32_t* tp = tiles + t0 * stride;
  for (int64_t p = 0; p < half_k; ++p) {
    __m512bh w[C];
    for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(tp + c * stride + p * kTile);
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[r * half_k + p]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, w[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (t0 + c) * kTile;
    const __mmask16 valid = first_columns(n - n0);
    for (int r = 0; r < R; ++r) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[r][c]);
      _mm256_mask_storeu_epi16(out + r * n + n0, valid, h);
    }
  }
}

// Rows [0, R) against tiles [begin, end), C at a time, the last ones one by one.
template <int R, int C>
void rows_by_share(const int32_t* x, int64_t half_k, const int32_t* tiles, int64_t begin,
                   int64_t end, const float* bias, int64_t n, uint16_t* out) {
  int64_t t = begin;
  for (; t + C <= end; t += C) rows_by_tiles<R, C>(x, half_k, tiles, t, bias, n, out);
  for (; t < end; ++t) rows_by_tiles<R, 1>(x, half_k, tiles, t, bias, n, out);
}
#endif

at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n,
                             const std::optional<at::Tensor>& bias) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "bf16_tiles_linear: built for a CPU without AVX512-BF16, which it needs");
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_tiles_linear: x must be a contiguous (rows, K) bfloat16 tensor");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kInt && tiles.is_contiguous() &&
                  tiles.size(2) == kTile,
              "bf16_tiles_linear: tiles must be a contiguous (tiles, K / 2, 16) int32 tensor");
  const int64_t rows = x.size(0), half_k = tiles.size(1), count = tiles.size(0);
  TORCH_CHECK(x.size(1) == 2 * half_k, "bf16_tiles_linear: x has ", x.size(1),
              " inputs, the weight ", 2 * half_k);
  TORCH_CHECK(n > (count - 1) * kTile && n <= count * kTile, "bf16_tiles_linear: ", count,
              " tiles do not hold ", n, " output columns");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bf16_tiles_linear: bias must be a contiguous (n,) float32 tensor");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  if (rows == 0) return out;
  const auto* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int32_t* tp = tiles.data_ptr<int32_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t grain = tiles_per_share(half_k * kTile * 4);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += kPassTiles) {
      const int64_t t1 = std::min(end, t0 + kPassTiles);
      for (int64_t m = 0; m < rows;) {
        const int32_t* xm = xp + m * half_k;
        uint16_t* om = op + m * n;
        const int64_t left = rows - m;
        if (left >= 8) {
          rows_by_share<8, 2>(xm, half_k, tp, t0, t1, bias_ptr, n, om);
          m += 8;
        } else if (left >= 4) {
          rows_by_share<4, 4>(xm, half_k, tp, t0, t1, bias_ptr, n, om);
          m += 4;
        } else if (left == 3) {
          rows_by_share<3, 4>(xm, half_k, tp, t0, t1, bias_ptr, n, om);
          m += 3;
        } else if (left == 2) {
          rows_by_share<2, 4>(xm, half_k, tp, t0, t1, bias_ptr, n, om);
          m += 2;
        } else {
          rows_by_share<1, 4>(xm, half_k, tp, t0, t1, bias_ptr, n, om);
          m += 1;
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def("bf16_tiles_linear(Tensor x, Tensor tiles, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) { m.impl("bf16_tiles_linear", &bf16_tiles_linear); }
