// batchline's dense bf16 linear, for CPUs with AVX512-BF16 (AMD EPYC from Zen 4, Intel Xeon
// from Sapphire Rapids), where oneDNN's bf16 product streams a decode step's weights at two
// thirds of what the memory gives (a 1.7B-shaped layer at one row, Zen 4: 26 GB/s against a
// 42 GB/s copy).
//
//   bf16_tiles_linear(x, tiles, n, bias=None, amx_rows=2) -> out
//     x:        (rows, K), contiguous bfloat16, K even
//     tiles:    (ceil(n / 16), K / 2, 16) int32, the weight in tiles of 16 output columns:
//               entry [t, p, j] holds column 16t+j's inputs 2p (low half) and 2p+1 (high half)
//               as bf16, the padding columns of the last tile zero (dense_tiles.tile_weight)
//     n:        the output columns
//     bias:     (n,) float32, or None
//     amx_rows: from this many rows on, AMX tiles where the CPU has them (and K is a multiple
//               of 32), else vdpbf16ps
//     out:      (rows, n) bfloat16
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
//
// The same 16 lines of a tile for 32 inputs are an AMX product's B operand (16 input pairs by
// 16 columns), so on a CPU with AMX the tiles are multiplied in place, 32 rows by 2 tiles a
// product (rows_by_share_amx). There oneDNN multiplies on AMX too, and vdpbf16ps alone lost to
// it from 4 rows (x1.7 its time at 8, x8 at 256); through AMX the tiles took x0.82-0.86
// oneDNN's time from 1 to 16 rows, x0.75-0.86 at 32-64 and x0.98-1.17 at 256-512 (the 1.7B
// shape's four linears, 2 threads, 2-core AMX Xeon, 2026-12-06). The two paths' outputs agree
// within bf16's rounding, not bit for bit (AMX's float32 sums of a pair round differently: a
// few outputs in ten thousand one bf16 step apart); each path gives a row the same bits in
// any batch.
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
#include <cstring>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "quant_layout.h"

namespace {

using namespace batchline_quant;

// Tiles per pass over the rows: 4 tiles of a 2,048-input weight are 256 KiB, in L2 for the
// rows after the first 8.
constexpr int64_t kPassTiles = 4;
// The AMX path's tiles per pass over the rows, in bytes: with a block of 32 rows (up to 512 KiB
// at 8,192 inputs) they stay in a 2 MiB L2.
constexpr int64_t kAmxPassBytes = 1 << 20;

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

#if defined(BATCHLINE_AMX)
// A tile's 16 lines p = 16g .. 16g + 15 (1 KiB) are the B operand of one AMX product for inputs
// 32g .. 32g + 31 (16 input pairs by 16 columns), as they are vdpbf16ps's: the tiles are read in
// place. Registers: 0-3 the sums of two row blocks (0, 1: rows [m0, m0 + 16); 2, 3: the next 16)
// by two column tiles (0, 2: the first; 1, 3: the second); 4, 5 the two row blocks' 32 inputs;
// 6, 7 the two column tiles' lines. `first` and `second` are the row blocks' row counts
// (second 0: one block).
void configure_dense(int64_t first, int64_t second) {
  alignas(64) TileConfig config;
  config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(first);
  config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(second);
  config.rows[6] = config.rows[7] = 16;
  for (int t = 0; t < 8; ++t) config.colsb[t] = (t == 2 || t == 3 || t == 5) && !second ? 0 : 64;
  _tile_loadconfig(&config);
}

// One row block's sums (rows x 16 float32 at `sums`) with the bias, rounded to bf16 once.
void store_block(const float* sums, int64_t rows, const float* bias, int64_t n0, int64_t n,
                 uint16_t* out) {
  const __mmask16 valid = first_columns(n - n0);
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + 16 * r), start);
    _mm256_mask_storeu_epi16(out + r * n + n0, valid, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [m0, m0 + first + second) against tile t0 (and t0 + 1 where Two), the tiles configured
// for (first, second); each register's sums over all K inputs, then stored once.
template <bool Two, bool Pair>
void rows_by_tiles_amx(const uint16_t* x, int64_t k, const int32_t* tiles, int64_t t0,
                       int64_t m0, int64_t first, int64_t second, const float* bias, int64_t n,
                       uint16_t* out) {
  const int64_t stride = k / 2 * kTile;  // int32 a tile
  const int32_t* w0 = tiles + t0 * stride;
  const int32_t* w1 = w0 + stride;
  const int64_t groups = k / kGroup;
  const uint16_t* xa = x + m0 / 16 * groups * 512;  // x in blocks: see rows_by_share_amx
  const uint16_t* xb = xa + groups * 512;
  _tile_zero(0);
  if (Pair) _tile_zero(1);
  if (Two) _tile_zero(2);
  if (Two && Pair) _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t line = g * 16 * kTile;
    prefetch_ahead(w0 + line, 1024);
    _tile_loadd(4, xa + g * 512, 64);
    _tile_loadd(6, w0 + line, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Two) {
      _tile_loadd(5, xb + g * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (Pair) {
      prefetch_ahead(w1 + line, 1024);
      _tile_loadd(7, w1 + line, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (Two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[16 * 16];
  const int64_t n0 = t0 * kTile;
  _tile_stored(0, sums, 64);
  store_block(sums, first, bias, n0, n, out + m0 * n);
  if (Two) {
    _tile_stored(2, sums, 64);
    store_block(sums, second, bias, n0, n, out + (m0 + 16) * n);
  }
  if (Pair) {
    _tile_stored(1, sums, 64);
    store_block(sums, first, bias, n0 + kTile, n, out + m0 * n);
    if (Two) {
      _tile_stored(3, sums, 64);
      store_block(sums, second, bias, n0 + kTile, n, out + (m0 + 16) * n);
    }
  }
}

// Every row against tiles [begin, end), in passes of kAmxPassBytes of tiles (2 at least): a
// pass's tiles are read from memory for the first 32 rows and from L2 for the rest, and a block
// of 32 rows (x, blocked: see blocked_rows) from L2 for each pair of the pass's tiles, all of
// its inputs at a time.
void rows_by_share_amx(const uint16_t* x, int64_t rows, int64_t k, const int32_t* tiles,
                       int64_t begin, int64_t end, const float* bias, int64_t n, uint16_t* out) {
  const int64_t pass = std::max<int64_t>(1, kAmxPassBytes / (k * 2 * kTile * 2)) * 2;
  int64_t configured_first = -1, configured_second = -1;
  for (int64_t t0 = begin; t0 < end; t0 += pass) {
    const int64_t t1 = std::min(end, t0 + pass);
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
      const int64_t first = std::min<int64_t>(16, rows - m0);
      const int64_t second = std::clamp<int64_t>(rows - m0 - 16, 0, 16);
      if (first != configured_first || second != configured_second) {
        configure_dense(configured_first = first, configured_second = second);
      }
      for (int64_t t = t0; t < t1; t += 2) {
        const bool pair = t + 1 < t1;
        if (second && pair) {
          rows_by_tiles_amx<true, true>(x, k, tiles, t, m0, first, second, bias, n, out);
        } else if (second) {
          rows_by_tiles_amx<true, false>(x, k, tiles, t, m0, first, second, bias, n, out);
        } else if (pair) {
          rows_by_tiles_amx<false, true>(x, k, tiles, t, m0, first, second, bias, n, out);
        } else {
          rows_by_tiles_amx<false, false>(x, k, tiles, t, m0, first, second, bias, n, out);
        }
      }
    }
  }
  _tile_release();
}

// `rows` rows of `k` inputs as rows_by_share_amx reads them (the last block's missing rows
// left unset: the tiles are configured for the rows there are).
std::vector<uint16_t> blocked_rows(const uint16_t* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<uint16_t> blocked((rows + 15) / 16 * groups * 512);
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* into = blocked.data() + m / 16 * groups * 512 + m % 16 * kGroup;
    for (int64_t g = 0; g < groups; ++g) {
      std::memcpy(into + g * 512, x + m * k + g * kGroup, kGroup * sizeof(uint16_t));
    }
  }
  return blocked;
}
#endif  // BATCHLINE_AMX
#endif

at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n,
                             const std::optional<at::Tensor>& bias, int64_t amx_rows) {
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
#if defined(BATCHLINE_AMX)
  if (rows >= amx_rows && (2 * half_k) % kGroup == 0 && amx_permitted()) {
    const std::vector<uint16_t> blocked =
        blocked_rows(reinterpret_cast<const uint16_t*>(xp), rows, 2 * half_k);
    // shares of whole pairs of tiles, so that a thread's pairs are the same at any count
    at::parallel_for(0, (count + 1) / 2, std::max<int64_t>(1, grain / 2),
                     [&](int64_t begin, int64_t end) {
                       rows_by_share_amx(blocked.data(), rows, 2 * half_k, tp, 2 * begin,
                                         std::min(count, 2 * end), bias_ptr, n, op);
                     });
    return out;
  }
#endif
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
  m.def(
      "bf16_tiles_linear(Tensor x, Tensor tiles, int n, Tensor? bias=None, int amx_rows=2) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) { m.impl("bf16_tiles_linear", &bf16_tiles_linear); }
