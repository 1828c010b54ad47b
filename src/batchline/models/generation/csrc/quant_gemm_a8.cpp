// batchline's int4 linear with int8 activations (W4A8), for float32 rows on CPUs without native
// bf16, and for a bf16 model's one-row products on AMX hosts, where summing integers beats
// vdpbf16ps (quant_linear.QuantLinear.int8_rows). It reads the own int4 layouts
// quant_gemm_f32.cpp reads (bf16, float32 or 8-bit-step scales and zeros), and sums integers
// where that kernel converts each code to fp32 and multiplies: on Ice Lake the float32
// kernel's one-row product ran at the rate of its conversions, not of memory, and on an
// AVX2-only EPYC (Zen 2) its 256-bit path reached 2.07x a 1.7B step's floor.
// Two paths, the same sums: with AVX512-VNNI (Intel Xeon from Cascade Lake on, AMD from Zen 4
// on) one vpdpbusd multiplies 64 codes by 4 inputs of a row and adds them into 16 columns' int32
// sums; with AVX2 alone (`width` 256, the only path of a library built without VNNI) a
// vpmaddubsw multiplies 32 codes by 4 inputs into 16-bit pair sums, added up over the group's
// 8 chunks in 16 bits (at most 8 * 2 * 15 * 127 = 30,480: no saturation) and widened to int32
// once per group by a vpmaddwd.
//
//   int4_linear_a8(x, packed, n, bias=None, width=512, streams=1) -> out
//     x:       (rows, K), contiguous float32 or bfloat16, K a multiple of 32
//     packed:  (tiles, K / 32, 320, 384 or 290) uint8 (quant_kernel.pack_int4)
//     bias:    (n,) float32, or None
//     width:   512: the VNNI path (up to 8 rows a pass); 256: the AVX2 one (up to 4)
//     streams: 1, 2, 4 or 8: the tiles one row reads at once on the VNNI path (the same bits;
//              quant_kernel.a8_streams says where more than one pays)
//     out:     (rows, n) in x's dtype (summed in float32, bf16 rounded once at the end)
//   int8g_linear_a8(x, packed, n, bias=None, width=512, streams=1) -> out: the same product of
//     int8 weights in groups of 32 (a GGUF's Q8_0 form), packed (tiles, K / 32, 544) uint8
//     (quant_kernel.pack_int8g); width 512: vpdpbusd on each 64-byte chunk as it lies (the
//     codes read as w + 128, 128 times the row's code sum taken off), 256: the AVX2 path below,
//     the same bits; streams as int4_linear_a8's
//   int8_activations(x) -> (codes, scales): the quantizing the product applies to x, for tests
//     and for the error it adds: codes (rows, K) int8, scales (rows, K / 32) float32
//   int8_weight_groups(w, steps) -> (codes, scales): a weight (N, K) float32 to int8 in groups
//     of 32 at load, for the int8 layout (quant_codes.quantize_int8_groups says why): per
//     group, of the scales bf16(max|w| / 127) and the `steps` bf16 values above it, the first
//     of least squared error sum((clamp(round(w * (1 / scale)), -127, 127) * scale - w)^2);
//     codes (N, K) int8, scales (N, K / 32) float32 (each a bf16 value); a group of zeros,
//     scale 1 and codes 0
//
// Each row's group of 32 inputs is quantized on the way in, symmetric, to int8:
//   scale_x = max|x| / 127, code_x = round-half-even(x * (127 / max|x|)) in [-127, 127]
// (a group of zeros: scale 0, codes 0), as llama.cpp quantizes activations for its Q4/Q8 dot
// products. Per group the product is then
//   scale_x * (scale * sum_k code_x * code + (zero - 8 * scale) * sum_k code_x)
// with the integer sums exact: the output is the float32 product of the weight and the
// quantized activations, x rounded to 8 bits per group being the only approximation; both paths
// apply the same float32 operations per column, so they give the same bits.
// A chunk of 32 code bytes (see quant_gemm_f32.cpp) read as 16 words, one per column (bits 0-3
// input 4c, 8-11 4c+1, 4-7 4c+2, 12-15 4c+3), becomes on the AVX2 path the column's 4 code bytes
// in input order by (w | w << 12) & 0x0F0F0F0F, the unsigned operand; the row's 4 int8 codes of
// those inputs, broadcast, the signed one. The VNNI path takes two chunks at once (Int4Tiles):
// one vpermw puts column j's two words side by side in a dword, whose low nibbles (a mask) and
// high ones (a shift and a mask, or one vgf2p8affineqb) are two operands of 4 codes each, in
// the order 0, 1, 4, 5 and 2, 3, 6, 7 of the pair's 8 inputs, the order that path stores the
// row's codes in. Three operations per 64 bytes instead of six (widen, shift, merge per 32):
// Zen 4's 512-bit vpdpbusd and these share its two vector pipes. Tiles split over ATen's
// threads as the other kernels do.
//
// The int8 layout holds a group of 16 columns' 32 inputs in 544 bytes, 8.5 bits a weight (as
// many as Q8_0's 34-byte blocks; the two int4 planes that held it before read 10): 8 chunks of
// 64 bytes, chunk c the codes of inputs 4c..4c+3, column j's four at 64c + 4j in input order,
// then the 16 columns' scales in bf16. Both operands being signed, a chunk's half (8 columns)
// goes to vpmaddubsw as |w| (unsigned; -128 reads as 128) against the row's codes with w's
// sign applied (vpsignb, which also zeroes them where w is 0): the same products. A pair sum
// can reach 2 * 128 * 127 = 32,512, so each chunk's pairs are widened to int32 (vpmaddwd by
// ones) before they are added up; per group the product is scale_x * scale * sum, the sum exact.
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "quant_layout.h"
#include "row_steps.h"

namespace {

using namespace batchline_quant;

// What the kernel needs of the compiler's target: AVX2 and FMA (the 256-bit path, and the
// quantizing), and AVX-512 with VNNI and BW for the 512-bit path.
#if defined(__AVX2__) && defined(__FMA__)
#define BATCHLINE_A8 1
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BATCHLINE_A8_VNNI 1
#endif
#endif

#if defined(BATCHLINE_A8)
constexpr bool kBuilt = true;

// A group of 32 inputs (float32, or bf16 widened exactly): loaded into four float vectors, and
// the largest of their magnitudes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32: the bits moved up 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
inline float load_group(const T* p, __m256 (&v)[4]) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) v[i] = load8(p + 8 * i);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// A group's 32 int32 codes (each within int8) stored as 32 bytes in input order, or with each
// 8 inputs in the order 0, 1, 4, 5, 2, 3, 6, 7 (`paired`: the order the VNNI path's int4
// operands take them in, Int4Tiles).
inline void store_group(const __m256i (&q)[4], int8_t* out, bool paired = false) {
  // packing 4 x 8 int32 to 32 bytes leaves them in the order of these dwords
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      paired ? _mm256_shuffle_epi8(bytes, pairs) : bytes);
}

// Where one row's quantized groups go (RowLayout): group g's 32 codes at codes + g * stride *
// 32, its scale, code sum and their float product at [g * stride] of the three arrays.
struct RowOut {
  int8_t* codes;
  float* scales;
  int32_t* sums;
  float* scaled_sums;
  int64_t stride;
  bool paired;  // codes in store_group's paired order
};

// One row's groups to int8 codes, their scales, their code sums and each scale times its code
// sum in float32 (the product the epilogue of the int4 layouts takes) (AVX2: for both paths).
// One copy, neither inlined nor cloned: the ops and decode_layers.cpp's one-row path run the
// same code (decode_attention.cpp's rms_rows says why).
template <typename T>
__attribute__((noinline, noclone)) void quantize_row(const T* x, int64_t groups,
                                                     const RowOut& out) {
  for (int64_t g = 0; g < groups; ++g) {
    __m256 v[4];
    const float amax = load_group(x + g * kGroup, v);
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    const float scale = amax / 127.f;
    const __m256 by = _mm256_set1_ps(inverse);
    __m256i q[4];  // the MXCSR's rounding: to nearest, ties to even
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], by));
    store_group(q, out.codes + g * out.stride * kGroup, out.paired);
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(t);
    out.scales[g * out.stride] = scale;
    out.sums[g * out.stride] = sum;
    out.scaled_sums[g * out.stride] = scale * static_cast<float>(sum);
  }
}

inline int32_t four_codes(const int8_t* p) {  // 4 int8 codes as one 32-bit lane
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// A 256-bit pass's running totals: each row's 16 columns start at the bias (or 0), and end in
// the output's first `cols` columns of the tile.
template <int R>
inline void start_totals(float (&total)[R][kTile], const float* bias, int64_t n0,
                         int64_t cols) {
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < kTile; ++i) total[r][i] = bias && i < cols ? bias[n0 + i] : 0.f;
  }
}

template <int R>
inline void store_totals(const float (&total)[R][kTile], int64_t m0, int64_t n0, int64_t cols,
                         int64_t n_total, float* out) {
  for (int r = 0; r < R; ++r) {
    std::memcpy(out + (m0 + r) * n_total + n0, total[r], cols * sizeof(float));
  }
}

// One block of the quantized rows as QuantizedRows lays them out (RowLayout): R rows' codes
// group by group (group g's R x 32 codes at codes + g * R * 32), and per group their R scales,
// code sums and scaled sums (group g's at [g * R]).
struct BlockRows {
  const int8_t* codes;
  const float* scales;
  const int32_t* sums;
  const float* scaled_sums;
};

// The 256-bit path: rows [m0, m0 + R) of one tile, its 16 columns two halves of 8. Each
// (row, half) sums its group in one 16-bit accumulator; R up to 4 keeps them and the chunk's
// codes in AVX2's 16 registers, the totals in memory.
constexpr int64_t kMaxRows256 = 4;

template <Layout L, int R>
void tile_rows_a8_256(const uint8_t* tile, int64_t groups, const BlockRows& xb, int64_t m0,
                      const float* bias, int64_t n0, int64_t cols, int64_t n_total, float* out) {
  constexpr int64_t bytes = block_bytes<L>();
  const __m256i low_nibbles = _mm256_set1_epi32(0x0F0F0F0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 eight = _mm256_set1_ps(8.f);
  alignas(32) float total[R][kTile];
  start_totals<R>(total, bias, n0, cols);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * bytes;
    prefetch_ahead(block, bytes);
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* xg = xb.codes + g * R * kGroup;
    for (int c = 0; c < 8; ++c) {
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7: their words
        const __m256i v = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * c + 16 * h)));
        const __m256i w =
            _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), low_nibbles);
        for (int r = 0; r < R; ++r) {
          const __m256i xr = _mm256_set1_epi32(four_codes(xg + r * kGroup + 4 * c));
          acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(w, xr));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, zero;
      half_scales_zeros<L>(block, h, scale, zero);
      zero = _mm256_fnmadd_ps(eight, scale, zero);
      for (int r = 0; r < R; ++r) {
        const __m256i sum = _mm256_madd_epi16(acc[r][h], ones);
        const int64_t at = g * R + r;
        const float dx = xb.scales[at];
        __m256 t = _mm256_load_ps(total[r] + 8 * h);
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), t);
        t = _mm256_fmadd_ps(_mm256_set1_ps(xb.scaled_sums[at]), zero, t);
        _mm256_store_ps(total[r] + 8 * h, t);
      }
    }
  }
  store_totals<R>(total, m0, n0, cols, n_total, out);
}

// The int8 layout's counterpart of tile_rows_a8_256: rows [m0, m0 + R) of one tile.
template <int R>
void tile_rows_int8_256(const uint8_t* tile, int64_t groups, const BlockRows& xb, int64_t m0,
                        const float* bias, int64_t n0, int64_t cols, int64_t n_total,
                        float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float total[R][kTile];
  start_totals<R>(total, bias, n0, cols);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockInt8;
    prefetch_ahead(block, kBlockInt8);
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t* xg = xb.codes + g * R * kGroup;
    for (int c = 0; c < 8; ++c) {
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7: a dword each
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * c + 32 * h));
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i xr = _mm256_set1_epi32(four_codes(xg + r * kGroup + 4 * c));
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xr, w));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m128i bits =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kInt8Codes + 16 * h));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      for (int r = 0; r < R; ++r) {
        const float dx = xb.scales[g * R + r];
        __m256 t = _mm256_load_ps(total[r] + 8 * h);
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(scale, _mm256_set1_ps(dx)),
                            t);
        _mm256_store_ps(total[r] + 8 * h, t);
      }
    }
  }
  store_totals<R>(total, m0, n0, cols, n_total, out);
}

#else
constexpr bool kBuilt = false;
#endif

#if defined(BATCHLINE_A8_VNNI)
inline __m512i broadcast4(const int8_t* p) {  // 4 int8 codes into every 32-bit lane
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return _mm512_set1_epi32(word);
}

// What the VNNI path reads of each layout: a group's bytes, a chunk's weight operand for
// vpdpbusd (unsigned bytes, column j's four codes at 4j), and how a row's integer sum of the
// group becomes float32 (its Group, made once per group from the group's scales).

// The int4 layouts: chunks 2p and 2p + 1 give two operands (operands, below), against the
// row's codes stored paired (store_group); per row
// scale_x * (scale * sum + (zero - 8 * scale) * sum_x).
template <Layout L>
struct Int4Tiles {
  static constexpr int64_t kBytes = block_bytes<L>();
  const __m512i low_nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512 eight = _mm512_set1_ps(8.f);

  // Chunks 2p and 2p + 1 (64 bytes, 32 words): column j's two words side by side in dword j
  // (one vpermw), whose low nibbles are then its codes of inputs 8p + 0, 1, 4, 5 and whose high
  // ones those of 8p + 2, 3, 6, 7, in byte order. Against one chunk at a time (widen, shift,
  // merge), a 360M int4's one-row products called in turn (Zen 4, 2 threads, 2026-12-07): its
  // first 8 linears (10 MiB, hot in L3) x0.87 the time; all 129 from memory, and batch-1 steps
  // of the 360M and 1.7B shapes, x0.99-1.00 (the host's memory then at ~32 GB/s, where int4's
  // one-row product is not bound by its own work); 2 to 16 rows x0.99-1.00.
  const __m512i interleave = _mm512_setr_epi32(
      0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006,
      0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D,
      0x001E000E, 0x001F000F);

  void operands(const uint8_t* block, int p, __m512i& first, __m512i& second) const {
    const __m512i v = _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(block + 64 * p));
    first = _mm512_and_si512(v, low_nibbles);
#if defined(__GFNI__)
    // each byte's bits 4-7 moved to 0-3 (and 0 above) by one affine transform over GF(2)
    second = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    second = _mm512_and_si512(_mm512_srli_epi32(v, 4), low_nibbles);
#endif
  }

  struct Group {
    __m512 scale, zero;  // zero: the layout's zero less 8 * scale
    // sum: a row's integer sum of the group; x, at: its scale and scaled sum
    __m512 add(__m512i sum, const BlockRows& x, int64_t at, __m512 total) const {
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                              _mm512_mul_ps(scale, _mm512_set1_ps(x.scales[at])), total);
      return _mm512_fmadd_ps(_mm512_set1_ps(x.scaled_sums[at]), zero, total);
    }
  };

  Group group(const uint8_t* block) const {
    Group g;
    scales_zeros<L>(block, g.scale, g.zero);
    g.zero = _mm512_fnmadd_ps(eight, g.scale, g.zero);
    return g;
  }
};

// The int8 layout: a chunk's 64 bytes are vpdpbusd's weight operand as they lie (column j's
// codes of inputs 4c..4c+3 at 4j); the codes being signed, they are read as unsigned w + 128
// (the sign bit flipped) and 128 times the row's code sum of the group is taken off after: the
// 256-bit path's integer sums exactly, then its float32 operations per column, so the same bits.
struct Int8Tiles {
  static constexpr int64_t kBytes = kBlockInt8;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));

  void operands(const uint8_t* block, int p, __m512i& first, __m512i& second) const {
    first = _mm512_xor_si512(_mm512_loadu_si512(block + 128 * p), flip);
    second = _mm512_xor_si512(_mm512_loadu_si512(block + 128 * p + 64), flip);
  }

  struct Group {
    __m512 scale;
    // sum: a row's integer sum of the group; x, at: its scale and code sum
    __m512 add(__m512i sum, const BlockRows& x, int64_t at, __m512 total) const {
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x.sums[at]));
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                             _mm512_mul_ps(scale, _mm512_set1_ps(x.scales[at])), total);
    }
  };

  Group group(const uint8_t* block) const { return {widen_bf16(block + kInt8Codes)}; }
};

// Rows [m0, m0 + R) of one tile of either layout (Tiles: Int4Tiles<L> or Int8Tiles), read from
// their block of the quantized rows (xb: RowLayout's blocks of kMaxRows); with one or two rows
// a chunk's products alternate between two accumulators (two chains of dependent vpdpbusd
// instead of one).
template <typename Tiles, int R>
void tile_rows_vnni(const uint8_t* tile, int64_t groups, const BlockRows& xb, int64_t m0,
                    const float* bias, int64_t n0, int64_t cols, int64_t n_total, float* out) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  const Tiles tiles;
  const __mmask16 valid = first_columns(cols);
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = start;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * Tiles::kBytes;
    prefetch_ahead(block, Tiles::kBytes);
    __m512i acc[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kChains; ++j) acc[r][j] = _mm512_setzero_si512();
    }
    const int8_t* xg = xb.codes + g * R * kGroup;  // the block's R rows' codes of group g
    for (int p = 0; p < 4; ++p) {
      __m512i w[2];
      tiles.operands(block, p, w[0], w[1]);
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r) {
          __m512i& a = acc[r][h % kChains];
          a = _mm512_dpbusd_epi32(a, w[h], broadcast4(xg + r * kGroup + 8 * p + 4 * h));
        }
      }
    }
    const auto group = tiles.group(block);
    const int64_t at = g * R;  // the block's numbers of group g
    for (int r = 0; r < R; ++r) {
      __m512i sum = acc[r][0];
      for (int j = 1; j < kChains; ++j) sum = _mm512_add_epi32(sum, acc[r][j]);
      total[r] = group.add(sum, xb, at + r, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * n_total + n0, valid, total[r]);
}


// One row against C tiles at a time: C streams from memory with no prefetch asked (the
// hardware's prefetchers follow them). One tile of a long weight read ahead in software took
// x1.12-1.25 the time of 8 at once: Zen 4 EPYC, 2 threads, 2026-12-05, each weight in 11 copies
// called in turn (8,192 -> 2,048 and -> 3,072: x0.79-0.83 with 8; 3,072 -> 5,120 and -> 16,384:
// x0.86-0.89); at 2,048 inputs it was even (x0.96-1.02) and at a 360M's 960 and 2,560 one
// stream was faster (8: x1.08-1.14). Per tile the same operations in the same order as
// tile_rows_vnni<Tiles, 1>: the same bits. Tiles: Int4Tiles<L> or Int8Tiles; x: the row (a
// block of one).
template <typename Tiles, int C>
void row_by_tiles_a8(const uint8_t* tile, int64_t tile_bytes, int64_t groups, const BlockRows& x,
                     const float* bias, int64_t n0, int64_t n_total, float* out) {
  const Tiles tiles;
  __mmask16 valid[C];
  __m512 total[C];
  for (int c = 0; c < C; ++c) {
    const int64_t start = n0 + c * kTile;
    valid[c] = first_columns(n_total - start);
    total[c] = bias ? _mm512_maskz_loadu_ps(valid[c], bias + start) : _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[C][2];
    for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm512_setzero_si512();
    const int8_t* xg = x.codes + g * kGroup;
    for (int p = 0; p < 4; ++p) {
      const __m512i x0 = broadcast4(xg + 8 * p), x1 = broadcast4(xg + 8 * p + 4);
      for (int c = 0; c < C; ++c) {
        __m512i w0, w1;
        tiles.operands(tile + c * tile_bytes + g * Tiles::kBytes, p, w0, w1);
        acc[c][0] = _mm512_dpbusd_epi32(acc[c][0], w0, x0);
        acc[c][1] = _mm512_dpbusd_epi32(acc[c][1], w1, x1);
      }
    }
    for (int c = 0; c < C; ++c) {
      const auto group = tiles.group(tile + c * tile_bytes + g * Tiles::kBytes);
      const __m512i sum = _mm512_add_epi32(acc[c][0], acc[c][1]);
      total[c] = group.add(sum, x, g, total[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + n0 + c * kTile, valid[c], total[c]);
}

#endif  // BATCHLINE_A8_VNNI

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(kBuilt, op, ": built for a CPU without AVX2 and FMA, which it needs");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a contiguous (rows, K) float32 or bfloat16 tensor");
  TORCH_CHECK(x.size(1) % kGroup == 0, op, ": K = ", x.size(1), " is not a multiple of ", kGroup);
}

// The product's totals are float32; bf16 rows get them rounded to bf16 once, at the end.
at::Tensor in_dtype_of(const at::Tensor& out, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// How the quantized rows lie: in blocks of `block` rows, a pass's (kMaxRows on the VNNI path,
// kMaxRows256 on the AVX2 one; the last block holds the rest), each block's groups one after
// another, within a group its rows' 32 codes one after another (and its rows' scales, code
// sums and scaled sums likewise). A pass over one block then reads each from one pointer at
// fixed offsets. With the rows K bytes apart, GCC kept a register per row and took the
// numbers' addresses from the stack, and the scaled sum was a conversion and a multiply per
// row and group: an 8-row VNNI pass over a tile in L1 ran 107 cycles a group against 95 so (a
// standalone loop of the same operations; its 64 vpdpbusd alone take 65: Zen 4 issues one
// 512-bit vpdpbusd, FMA, multiply or ternary logic a cycle, all on the same two pipes).
// benchmarks/bench_a8_kernel.py (Zen 4, 2 threads, 2026-12-06, the two builds in turn): 8 to
// 256 rows x0.78-0.89 the time; the AVX2 path on the same host, 4 to 64 rows, x0.92-0.97 (not
// measured on an AVX2-only CPU). Blocks of one row are the plain layout, row m's group g at
// m * K + 32 g (int8_activations'); a single row lies the same in any.
struct RowLayout {
  int64_t rows, groups, block;
  bool paired = false;  // each group's codes in store_group's paired order

  // Where row m's groups go in the arrays at codes, scales, sums and scaled_sums.
  RowOut row(int64_t m, int8_t* codes, float* scales, int32_t* sums, float* scaled_sums) const {
    const int64_t m0 = m - m % block, in_block = std::min(block, rows - m0);
    const int64_t first = m0 * groups + (m - m0);  // the row's numbers of group 0
    return {codes + first * kGroup, scales + first, sums + first, scaled_sums + first, in_block,
            paired};
  }
};

// Rows [0, rows) of x (K inputs each) to int8 codes, scales, code sums and scaled sums per
// group, into the given buffers as `layout` places them, rows split over the threads.
void quantize_rows(const at::Tensor& x, const RowLayout& layout, int8_t* codes, float* scales,
                   int32_t* sums, float* scaled_sums) {
#if defined(BATCHLINE_A8)
  const int64_t rows = x.size(0), k_total = x.size(1), groups = k_total / kGroup;
  const int64_t rows_per_share = std::max<int64_t>(1, 16384 / k_total);
  auto each_row = [&](const auto* xp) {
    at::parallel_for(0, rows, rows_per_share, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        quantize_row(xp + m * k_total, groups, layout.row(m, codes, scales, sums, scaled_sums));
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    each_row(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()));
  } else {
    each_row(x.data_ptr<float>());
  }
#endif
}

// Inputs up to which a product's quantized rows go into buffers its calling thread keeps
// (a decode step's linears would otherwise allocate their arrays each call, ~1 us of a
// 12-30 us call at 360M); larger ones (a prefill chunk's) into tensors of their own.
constexpr int64_t kScratchInputs = 1 << 16;

// x quantized per row and group, in blocks of `block` rows (RowLayout), in the calling
// thread's buffers where it is small.
class QuantizedRows {
 public:
  QuantizedRows(const at::Tensor& x, int64_t block, bool paired = false)
      : layout_{x.size(0), x.size(1) / kGroup, block, paired} {
    const int64_t numbers = layout_.rows * layout_.groups;
    if (x.numel() > kScratchInputs) {
      owned_codes_ = at::empty({x.numel()}, x.options().dtype(at::kChar));
      owned_floats_ = at::empty({2 * numbers}, x.options().dtype(at::kFloat));
      owned_sums_ = at::empty({numbers}, x.options().dtype(at::kInt));
      codes_ = owned_codes_.data_ptr<int8_t>();
      scales_ = owned_floats_.data_ptr<float>();
      sums_ = owned_sums_.data_ptr<int32_t>();
    } else {
      thread_local std::vector<int8_t> codes(kScratchInputs);
      thread_local std::vector<float> floats(2 * kScratchInputs / kGroup);
      thread_local std::vector<int32_t> sums(kScratchInputs / kGroup);
      codes_ = codes.data(), scales_ = floats.data(), sums_ = sums.data();
    }
    scaled_sums_ = scales_ + numbers;
    quantize_rows(x, layout_, codes_, scales_, sums_, scaled_sums_);
  }
  // The block of rows [m0, m0 + block), m0 a multiple of the block
  BlockRows block(int64_t m0) const {
    const int64_t first = m0 * layout_.groups;
    return {codes_ + first * kGroup, scales_ + first, sums_ + first, scaled_sums_ + first};
  }

 private:
  RowLayout layout_;
  at::Tensor owned_codes_, owned_floats_, owned_sums_;
  int8_t* codes_;
  float* scales_;
  int32_t* sums_;
  float* scaled_sums_;
};

// Runs f(std::integral_constant<int, C>{}) for streams C of 1, 2, 4 or 8 (checked before).
template <typename F>
inline void with_streams(int64_t streams, F&& f) {
  switch (streams) {
    case 8:
      f(std::integral_constant<int, 8>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
  }
}

#if defined(BATCHLINE_A8_VNNI)
// Tiles [begin, end) of a one-row product of either layout (Tiles: Int4Tiles<L> or Int8Tiles),
// `streams` tiles at a time (row_by_tiles_a8), the rest one at a time.
template <typename Tiles>
void row_share_by_streams(const uint8_t* wp, int64_t begin, int64_t end, int64_t tile_bytes,
                          int64_t groups, const BlockRows& x, const float* bias, int64_t n,
                          int64_t streams, float* out) {
  with_streams(streams, [&](auto c) {
    constexpr int kC = decltype(c)::value;
    int64_t t = begin;
    for (; t + kC <= end; t += kC) {
      row_by_tiles_a8<Tiles, kC>(wp + t * tile_bytes, tile_bytes, groups, x, bias, t * kTile, n,
                                 out);
    }
    for (; t < end; ++t) {
      row_by_tiles_a8<Tiles, 1>(wp + t * tile_bytes, tile_bytes, groups, x, bias, t * kTile, n,
                                out);
    }
  });
}

// Tiles [t0, t1) of a one-row product: row_steps.h's one_row_tiles, which the ops' own one-row
// paths call too (x: the row's block of QuantizedRows; width 512 for the int4 layouts).
void one_row_share(const uint8_t* packed, int64_t block_bytes, int64_t groups, const BlockRows& x,
                   const float* bias, int64_t n, int64_t width, int64_t streams, int64_t t0,
                   int64_t t1, float* out) {
  const int64_t tile_bytes = groups * block_bytes;
  if (block_bytes == kBlockInt8) {  // int8g_linear_a8's paths for one row
    if (width == 512 && streams > 1) {
      row_share_by_streams<Int8Tiles>(packed, t0, t1, tile_bytes, groups, x, bias, n, streams,
                                      out);
      return;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      if (width == 512) {
        tile_rows_vnni<Int8Tiles, 1>(packed + t * tile_bytes, groups, x, 0, bias, n0, cols, n, out);
      } else {
        tile_rows_int8_256<1>(packed + t * tile_bytes, groups, x, 0, bias, n0, cols, n, out);
      }
    }
    return;
  }
  with_layout(layout_of(block_bytes), [&](auto kind) {  // int4_linear_a8's 512-bit paths
    constexpr Layout kL = decltype(kind)::value;
    if (streams > 1) {
      row_share_by_streams<Int4Tiles<kL>>(packed, t0, t1, tile_bytes, groups, x, bias, n, streams,
                                          out);
      return;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      tile_rows_vnni<Int4Tiles<kL>, 1>(packed + t * tile_bytes, groups, x, 0, bias, n0, cols, n,
                                       out);
    }
  });
}

// A one-row product, its tiles shared among the threads as at::parallel_for shares them.
void one_row_product(const uint8_t* packed, int64_t block_bytes, int64_t tiles, int64_t groups,
                     const QuantizedRows& xq, const float* bias, int64_t n, int64_t width,
                     int64_t streams, float* out) {
  const BlockRows x = xq.block(0);
  at::parallel_for(0, tiles, tiles_per_share(groups * block_bytes), [&](int64_t t0, int64_t t1) {
    one_row_share(packed, block_bytes, groups, x, bias, n, width, streams, t0, t1, out);
  });
}
#endif

at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const std::optional<at::Tensor>& bias, int64_t width, int64_t streams) {
  check_x(x, "int4_linear_a8");
  TORCH_CHECK(width == 256 || width == 512, "int4_linear_a8: width must be 256 or 512, not ",
              width);
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4 || streams == 8,
              "int4_linear_a8: streams must be 1, 2, 4 or 8, not ", streams);
#if !defined(BATCHLINE_A8_VNNI)
  width = 256;  // the only path built
#endif
  const Layout layout = check_packed(packed, n, "int4_linear_a8");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  const int64_t groups = packed.size(1);
  TORCH_CHECK(k_total == groups * kGroup, "int4_linear_a8: x has ", k_total, " inputs, the weight ",
              groups * kGroup);
  const float* bias_ptr = bias_pointer(bias, n, "int4_linear_a8");
  auto out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows == 0) return in_dtype_of(out, x);
#if defined(BATCHLINE_A8)
  // a pass's rows a block; the VNNI path's int4 operands take each row's codes paired
  const QuantizedRows xq(x, width == 512 ? kMaxRows : kMaxRows256, width == 512);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = groups * packed.size(2);
#if defined(BATCHLINE_A8_VNNI)
  if (width == 512 && rows == 1) {  // a batch-1 step, `streams` tiles at a time
    one_row_product(wp, packed.size(2), tiles, groups, xq, bias_ptr, n, width, streams, op);
    return in_dtype_of(out, x);
  }
#endif
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
      with_layout(layout, [&](auto kind) {
        constexpr Layout kL = decltype(kind)::value;
#if defined(BATCHLINE_A8_VNNI)
        if (width == 512) {
          for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
            with_rows<kMaxRows>(std::min(kMaxRows, rows - m0), [&](auto r) {
              tile_rows_vnni<Int4Tiles<kL>, decltype(r)::value>(tile, groups, xq.block(m0), m0,
                                                                bias_ptr, n0, cols, n, op);
            });
          }
          return;
        }
#endif
        for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows256) {
          with_rows<kMaxRows256>(std::min(kMaxRows256, rows - m0), [&](auto r) {
            tile_rows_a8_256<kL, decltype(r)::value>(tile, groups, xq.block(m0), m0, bias_ptr, n0,
                                                       cols, n, op);
          });
        }
      });
    }
  });
#endif
  return in_dtype_of(out, x);
}

at::Tensor int8g_linear_a8(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias, int64_t width, int64_t streams) {
  check_x(x, "int8g_linear_a8");
  TORCH_CHECK(width == 256 || width == 512, "int8g_linear_a8: width must be 256 or 512, not ",
              width);
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4 || streams == 8,
              "int8g_linear_a8: streams must be 1, 2, 4 or 8, not ", streams);
#if !defined(BATCHLINE_A8_VNNI)
  width = 256;  // the only path built
#endif
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockInt8,
              "int8g_linear_a8: packed must be pack_int8g's (tiles, K / 32, 544) uint8 tensor");
  check_tiles(packed, n, "int8g_linear_a8");
  const int64_t rows = x.size(0), k_total = x.size(1), tiles = packed.size(0);
  const int64_t groups = packed.size(1);
  TORCH_CHECK(k_total == groups * kGroup, "int8g_linear_a8: x has ", k_total,
              " inputs, the weight ", groups * kGroup);
  const float* bias_ptr = bias_pointer(bias, n, "int8g_linear_a8");
  auto out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows == 0) return in_dtype_of(out, x);
#if defined(BATCHLINE_A8)
  const QuantizedRows xq(x, width == 512 ? kMaxRows : kMaxRows256);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = groups * kBlockInt8;
#if defined(BATCHLINE_A8_VNNI)
  if (rows == 1) {  // a batch-1 step: its 256-bit path, or `streams` tiles at a time
    one_row_product(wp, kBlockInt8, tiles, groups, xq, bias_ptr, n, width, streams, op);
    return in_dtype_of(out, x);
  }
#endif
  at::parallel_for(0, tiles, tiles_per_share(tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, cols = std::min(kTile, n - n0);
#if defined(BATCHLINE_A8_VNNI)
      if (width == 512) {
        for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
          with_rows<kMaxRows>(std::min(kMaxRows, rows - m0), [&](auto r) {
            tile_rows_vnni<Int8Tiles, decltype(r)::value>(wp + t * tile_bytes, groups,
                                                          xq.block(m0), m0, bias_ptr, n0, cols,
                                                          n, op);
          });
        }
        continue;
      }
#endif
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows256) {
        with_rows<kMaxRows256>(std::min(kMaxRows256, rows - m0), [&](auto r) {
          tile_rows_int8_256<decltype(r)::value>(wp + t * tile_bytes, groups, xq.block(m0), m0,
                                                 bias_ptr, n0, cols, n, op);
        });
      }
    }
  });
#endif
  return in_dtype_of(out, x);
}

std::tuple<at::Tensor, at::Tensor> int8_activations(const at::Tensor& x) {
  check_x(x, "int8_activations");
  const int64_t rows = x.size(0), k_total = x.size(1), groups = k_total / kGroup;
  auto codes = at::empty({rows, k_total}, x.options().dtype(at::kChar));
  auto scales = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  auto sums = at::empty({rows, groups}, x.options().dtype(at::kInt));
  auto scaled_sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  quantize_rows(x, RowLayout{rows, groups, 1}, codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                sums.data_ptr<int32_t>(), scaled_sums.data_ptr<float>());
  return {codes, scales};
}

#if defined(BATCHLINE_A8)
// One row of weights to int8 in groups of 32 (int8_weight_groups): each group's scale the
// first of least squared error among the bf16 ladder from bf16(max|w| / 127) up.
void quantize_weight_row(const float* w, int64_t groups, int64_t steps, int8_t* codes,
                         float* scales) {
  const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  auto codes_of = [&](const __m256& v, const __m256& by) {
    return _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(v, by), kRound), bottom), top);
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m256 v[4];
    const float amax = load_group(w + g * kGroup, v);
    if (!(amax > 0.f) || !std::isfinite(amax)) {  // zeros (or a NaN/inf): scale 1, codes 0
      scales[g] = 1.f;
      std::memset(codes + g * kGroup, 0, kGroup);
      continue;
    }
    const uint32_t base = float_to_bf16_bits(amax / 127.f);
    float best_scale = 0.f, best = 0.f;
    for (int64_t i = 0; i <= steps; ++i) {
      const float scale = bf16_to_float(static_cast<uint16_t>(base + i));
      const __m256 s = _mm256_set1_ps(scale), by = _mm256_set1_ps(1.f / scale);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m256 e = _mm256_fmsub_ps(codes_of(v[j], by), s, v[j]);
        sum = _mm256_fmadd_ps(e, e, sum);
      }
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      t = _mm_add_ss(t, _mm_movehdup_ps(t));
      const float error = _mm_cvtss_f32(t);
      if (i == 0 || error < best) best = error, best_scale = scale;
    }
    scales[g] = best_scale;
    const __m256 by = _mm256_set1_ps(1.f / best_scale);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(codes_of(v[j], by));
    store_group(q, codes + g * kGroup);
  }
}
#endif

std::tuple<at::Tensor, at::Tensor> int8_weight_groups(const at::Tensor& w, int64_t steps) {
  check_x(w, "int8_weight_groups");
  TORCH_CHECK(steps >= 0 && steps < 128, "int8_weight_groups: steps must be in [0, 127], got ",
              steps);
  const int64_t rows = w.size(0), k_total = w.size(1), groups = k_total / kGroup;
  auto codes = at::empty({rows, k_total}, w.options().dtype(at::kChar));
  auto scales = at::empty({rows, groups}, w.options());
#if defined(BATCHLINE_A8)
  const float* wp = w.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t rows_per_share = std::max<int64_t>(1, 16384 / k_total);
  at::parallel_for(0, rows, rows_per_share, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      quantize_weight_row(wp + r * k_total, groups, steps, cp + r * k_total, sp + r * groups);
    }
  });
#endif
  return {codes, scales};
}

}  // namespace

// -- one row's steps for decode_layers.cpp's one region (row_steps.h) ------------------------
// The ops' code on one row: a row lies the same in every RowLayout (its groups one after
// another), and the tiles are computed one by one as the ops' shares compute them.
namespace batchline_rows {

bool one_row_built() {
#if defined(BATCHLINE_A8_VNNI)
  return true;
#else
  return false;
#endif
}

void quantize_one_row(const float* x, int64_t k, bool paired, const RowCodes& out) {
#if defined(BATCHLINE_A8_VNNI)
  quantize_row(x, k / kGroup, RowOut{out.codes, out.scales, out.sums, out.scaled_sums, 1, paired});
#endif
}

void one_row_tiles(const uint8_t* packed, int64_t block_bytes, int64_t groups, const RowCodes& x,
                   const float* bias, int64_t n, int64_t width, int64_t streams, int64_t t0,
                   int64_t t1, float* out) {
#if defined(BATCHLINE_A8_VNNI)
  one_row_share(packed, block_bytes, groups, BlockRows{x.codes, x.scales, x.sums, x.scaled_sums},
                bias, n, width, streams, t0, t1, out);
#endif
}

}  // namespace batchline_rows

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def(
      "int4_linear_a8(Tensor x, Tensor packed, int n, Tensor? bias=None, int width=512,"
      " int streams=1) -> Tensor");
  m.def(
      "int8g_linear_a8(Tensor x, Tensor packed, int n, Tensor? bias=None, int width=512,"
      " int streams=1) -> Tensor");
  m.def("int8_activations(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_weight_groups(Tensor w, int steps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) {
  m.impl("int4_linear_a8", &int4_linear_a8);
  m.impl("int8g_linear_a8", &int8g_linear_a8);
  m.impl("int8_activations", &int8_activations);
  m.impl("int8_weight_groups", &int8_weight_groups);
}
