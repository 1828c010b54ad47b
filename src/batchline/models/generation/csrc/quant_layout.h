// The own int4 layout's sizes and the streaming helpers its kernels share: quant_gemm.cpp (bf16
// activations), quant_gemm_f32.cpp (float32 activations) and quant_gemm_a8.cpp (float32 rows as
// int8); and the checks and the layout dispatch, which read each of a block's three ways of
// keeping its scales and zeros (Layout). The layout itself is described in quant_gemm.cpp's
// header and packed by quant_kernel.pack_int4.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace batchline_quant {

constexpr int64_t kGroup = 32;   // inputs per group
constexpr int64_t kTile = 16;    // output columns per tile
constexpr int64_t kBlock = 320;  // bytes per tile and group: 256 of codes, 64 of scales/zeros
constexpr int64_t kBlockF32 = 384;  // the same with float32 scales and zeros (a float32 model's)
// The same with 8-bit steps (quant_kernel.pack_int4_compact): 256 bytes of codes, 16 steps
// (uint8), 16 zero offsets (uint8), one bf16 unit; column i's scale is unit * step[i] and its
// zero scale * (8 - offset[i] / 16). Both are exact in fp32 (8 bits times 8, then times 8
// more), so every kernel and the Python side compute the same weights. 4.53 bits a weight.
constexpr int64_t kBlockCompact = 290;

// How a block keeps its 16 scales and zeros: bf16 (kBlock bytes), float32 (kBlockF32), or as
// 8-bit steps of a bf16 unit (kBlockCompact).
enum class Layout { kBf16, kF32, kCompact };

template <Layout L>
constexpr int64_t block_bytes() {
  return L == Layout::kF32 ? kBlockF32 : L == Layout::kCompact ? kBlockCompact : kBlock;
}
// The int8 layout's block (quant_gemm_a8.cpp): 512 bytes of int8 codes, then 16 bf16 scales
constexpr int64_t kInt8Codes = kGroup * kTile;  // where a block's scales start
constexpr int64_t kBlockInt8 = kInt8Codes + 2 * kTile;  // 544
constexpr int64_t kMaxRows = 8;  // rows summed together over one pass of a tile's weights
// The fewest weight bytes a thread's share is given: a smaller product (SmolLM2-135M's k/v
// projection, 576 -> 192: 69 KB in int4, ~6 us) gains nothing from a second thread's wake-up.
constexpr int64_t kMinShareBytes = 64 * 1024;

inline int64_t tiles_per_share(int64_t tile_bytes) {
  return std::max<int64_t>(1, kMinShareBytes / tile_bytes);
}

// A decode step streams its weights from memory once, each thread through its tiles in order.
// The hardware's own prefetch kept the int4 kernel at half the bandwidth a dense bf16 product
// reaches (a SmolLM2-1.7B-shaped step, batch 1, 2 threads: 1,152 MiB in 102 ms against bf16's
// 3,264 in 143); asking for the lines kAhead bytes ahead of each block took it to 69 ms (1,024
// bytes ahead: 73, 4,096: 81; the split accumulators alone: 104). The lines are asked into L2
// (T1), not L1: 2,048 bytes are 32 lines in flight a core, more than L1's fill buffers hold,
// fewer than L2's queue. A 1.7B-shaped int4 batch-1 step, T0 and T1 alternated three times on
// an AMX host: 64.2 / 68.9 / 72.4 ms against 62.5 / 65.4 / 65.3 (3B: 102 / 107 against
// 101 / 102; 360M and 16-row steps unchanged; 4,096 or 8,192 bytes ahead in L2: no better).
// AMD's Zen cores (which -march=native names __znverN__) differ: their L3 takes every line L2
// evicts, so a stream asked into L2 is written into L3 too. Asked non-temporal (NTA) and nearer,
// a one-row product streams at a plain read's rate: on an AVX2-only EPYC (Zen 2, two threads,
// 2,048 -> 16,384 and 8,192 -> 2,048 from memory) the int8 layout went from 20-22 GB/s (T1,
// 2,048 bytes ahead) to 27-31 (NTA, 512 to 1,024 ahead; torch's sum of a 1 GiB tensor: 30.0),
// int4 from 19-22 to 25-30, one thread 12.3 -> 16.5 against the sum's 16.9; 4 to 128 rows the
// same within 5 %. Zen 3 to 5 keep that L3 design and take it too. On Zen 5 (2 threads,
// 2026-12-06) the choice barely matters: batch-1 steps of the 360M and 1.7B shapes, int4 and
// int8 layouts, took each of NTA 768 (this), none, T1 2,048 or 4,096, NTA 1,536 or 3,072 and
// T0 1,024 in turn, step by step in one process: none was more than 4 % faster than NTA 768,
// and T1 2,048 was 5 % slower at 1.7B int4 (in a scratch loop over one 1 GiB weight, none and
// T1 4,096 were 14 % faster: not so in a step, whose weights are 97 products of 0.5-18 MiB).
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || \
    defined(__znver5__)
constexpr int64_t kAhead = 768;
#define BATCHLINE_AHEAD_HINT _MM_HINT_NTA
#else
constexpr int64_t kAhead = 2048;
#define BATCHLINE_AHEAD_HINT _MM_HINT_T1
#endif

inline void prefetch_ahead(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block) + kAhead;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, BATCHLINE_AHEAD_HINT);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A finite float's bits rounded to bf16, to nearest with ties to even (as torch rounds).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__)
inline __m512 widen_bf16(const void* p) {  // 16 bf16 -> 16 fp32
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// A block's 16 scales (which 0) or zeros (which 1), as float32, from the bf16 or float32 layout.
template <bool F32Scales>
inline __m512 scales_of(const uint8_t* block, int which) {
  if constexpr (F32Scales) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(block + 256) + 16 * which);
  } else {
    return widen_bf16(block + 256 + 32 * which);
  }
}

inline __m512 widen_u8(const uint8_t* p) {  // 16 uint8 -> 16 fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
}

// A block's 16 scales and 16 zeros as float32, from any layout.
template <Layout L>
inline void scales_zeros(const uint8_t* block, __m512& scale, __m512& zero) {
  if constexpr (L == Layout::kCompact) {
    uint16_t unit;
    std::memcpy(&unit, block + 288, sizeof unit);
    scale = _mm512_mul_ps(widen_u8(block + 256), _mm512_set1_ps(bf16_to_float(unit)));
    const __m512 steps = _mm512_fnmadd_ps(widen_u8(block + 272), _mm512_set1_ps(1.f / 16),
                                          _mm512_set1_ps(8.f));
    zero = _mm512_mul_ps(scale, steps);
  } else {
    scale = scales_of<L == Layout::kF32>(block, 0);
    zero = scales_of<L == Layout::kF32>(block, 1);
  }
}

inline __mmask16 first_columns(int64_t cols) {  // the lanes of a tile's real columns
  return cols >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
}
#endif

#if defined(__AVX2__)
inline __m256 widen_u8_half(const uint8_t* p) {  // 8 uint8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p))));
}

// Half a block's scales and zeros: columns 8 * half .. 8 * half + 7, as float32, from any
// layout (the 256-bit paths' counterpart of scales_zeros).
template <Layout L>
inline void half_scales_zeros(const uint8_t* block, int half, __m256& scale, __m256& zero) {
  if constexpr (L == Layout::kCompact) {
    uint16_t unit;
    std::memcpy(&unit, block + 288, sizeof unit);
    scale = _mm256_mul_ps(widen_u8_half(block + 256 + 8 * half),
                          _mm256_set1_ps(bf16_to_float(unit)));
    const __m256 steps = _mm256_fnmadd_ps(widen_u8_half(block + 272 + 8 * half),
                                          _mm256_set1_ps(1.f / 16), _mm256_set1_ps(8.f));
    zero = _mm256_mul_ps(scale, steps);
  } else if constexpr (L == Layout::kF32) {
    const float* p = reinterpret_cast<const float*>(block + 256) + 8 * half;
    scale = _mm256_loadu_ps(p);
    zero = _mm256_loadu_ps(p + 16);
  } else {
    auto widen = [](const uint8_t* p) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    };
    scale = widen(block + 256 + 16 * half);
    zero = widen(block + 288 + 16 * half);
  }
}
#endif

// Column i's scale and zero of a block, in plain C++, from any layout.
template <Layout L>
inline void column_scale_zero(const uint8_t* block, int64_t i, float& scale, float& zero) {
  if constexpr (L == Layout::kCompact) {
    uint16_t unit;
    std::memcpy(&unit, block + 288, sizeof unit);
    scale = bf16_to_float(unit) * static_cast<float>(block[256 + i]);
    zero = scale * (8.f - static_cast<float>(block[272 + i]) / 16.f);
  } else if constexpr (L == Layout::kF32) {
    std::memcpy(&scale, block + 256 + 4 * i, 4);
    std::memcpy(&zero, block + 320 + 4 * i, 4);
  } else {
    uint16_t s, z;
    std::memcpy(&s, block + 256 + 2 * i, 2);
    std::memcpy(&z, block + 288 + 2 * i, 2);
    scale = bf16_to_float(s);
    zero = bf16_to_float(z);
  }
}

// Calls f(std::integral_constant<int, N>{}) with N = min(rows, R): the row count a kernel's
// register tile is compiled for, the one place a runtime count picks it (rows >= 1).
template <int R, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) {
      with_rows<R - 1>(rows, std::forward<F>(f));
      return;
    }
  }
  f(std::integral_constant<int, R>{});
}
// Calls f(std::integral_constant<Layout, L>{}) for the layout: the one place a runtime layout
// picks its compiled path.
template <typename F>
inline void with_layout(Layout layout, F&& f) {
  switch (layout) {
    case Layout::kF32:
      f(std::integral_constant<Layout, Layout::kF32>{});
      break;
    case Layout::kCompact:
      f(std::integral_constant<Layout, Layout::kCompact>{});
      break;
    default:
      f(std::integral_constant<Layout, Layout::kBf16>{});
  }
}

// That n output columns fill the packed weight's tiles, the last one at least in part.
inline void check_tiles(const at::Tensor& packed, int64_t n, const char* op) {
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, op, ": n = ", n, " does not fit ",
              tiles, " tiles of 16");
}

// Whether a block of `bytes` is one of the int4 layouts' (320, 384 or 290)
inline bool int4_block(int64_t bytes) {
  return bytes == kBlock || bytes == kBlockF32 || bytes == kBlockCompact;
}

// The int4 layout whose blocks take `bytes` (one int4_block accepts)
inline Layout layout_of(int64_t bytes) {
  return bytes == kBlockF32       ? Layout::kF32
         : bytes == kBlockCompact ? Layout::kCompact
                                  : Layout::kBf16;
}

// The layout of a packed weight (from its block's bytes: 320, 384 or 290), checked.
inline Layout check_packed(const at::Tensor& packed, int64_t n, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && int4_block(packed.size(2)) &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              op, ": packed must be int4_pack's (tiles, K / 32, 320, 384 or 290) uint8 tensor");
  check_tiles(packed, n, op);
  return layout_of(packed.size(2));
}

// The bias's data (a contiguous (n,) float32 tensor, checked), or nullptr where there is none.
inline const float* bias_pointer(const std::optional<at::Tensor>& bias, int64_t n,
                                 const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be a contiguous (n,) float32 tensor");
  return bias->data_ptr<float>();
}

}  // namespace batchline_quant
