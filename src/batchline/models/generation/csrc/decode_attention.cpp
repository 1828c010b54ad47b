// batchline's decode attention on CPU: each running row's queries attend over that row's own
// keys and values in the slot store, read where they lie (no padded window, no copy).
//
//   decode_attention(q, keys, values, first, hi, scale, softcap=0) -> out
//     q:      (rows, heads, dim), contiguous, bfloat16 or float32
//     keys:   (slots, kv_heads, capacity, dim), one layer's store buffer, contiguous, q's dtype
//     values: as keys
//     first:  (rows,) int64: row b attends columns [first[b], hi] of its slot b
//     softcap: > 0: each score s becomes softcap * tanh(s / softcap) before the softmax
//              (Gemma 2's), tanh through the exp below; 0: none
//     out:    (rows, heads, dim), q's dtype
//
// Per row and KV head: the scores of its query heads against each column (fp32; on a CPU with
// AVX512-BF16 the bfloat16 products are summed by vdpbf16ps, 16 columns reduced together), a
// softmax, and the weighted sum of the values in fp32 (there, in registers, each value row
// widened once for up to four query heads; on a CPU with AVX2 and no AVX-512, float32 in 8-lane
// vectors, a query head at a time, the next rows asked for ahead). Rows and heads are split over
// ATen's intra-op threads.
// Built by batchline.models.generation.decode_kernel with the machine's C++ compiler.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_steps.h"

// float32's 8-lane loops below: a CPU with AVX2 and FMA but no AVX-512 (which takes the 16-lane
// ones)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define BATCHLINE_F32_AVX2 1
#else
#define BATCHLINE_F32_AVX2 0
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x): 2^n * p(r) with a degree-6 polynomial, branch-free so that a loop over it
// vectorizes; relative error ~2e-7 on [-87, 88], the ends' values beyond (softmax after its
// maximum is subtracted needs x <= 0; silu needs exp(-x) to be ~0 or huge at the ends).
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_approx on 8 lanes, the same steps in AVX2. GCC leaves the scalar one's loops unvectorized
// ("control flow in loop": its clamp, under -ftrapping-math), so a softmax or an activation over
// it ran ~15 cycles a value: silu_mul took 44 us for 8,192 values, 657 us for 16 rows of them
// (a SmolLM2-1.7B-shaped step, float32, the AVX2-only EPYC), 5 % of a 16-row step.
inline __m256 exp_approx8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i two_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline float lanes_total(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// s[w] = exp(s[w] - top) over w < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t w = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 sums = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (; w + 8 <= n; w += 8) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + w), shift));
    _mm256_storeu_ps(s + w, e);
    sums = _mm256_add_ps(sums, e);
  }
  sum = lanes_total(sums);
#endif
  for (; w < n; ++w) {
    s[w] = exp_approx(s[w] - top);
    sum += s[w];
  }
  return sum;
}

constexpr int64_t kMaxGroup = 8;  // query heads per KV head on the AVX-512 paths

// Ask for rows [w, w + count) of `rows` (DIM values each) to be brought into the cache, where
// w < n: the rows the next loop reads, while this one computes (the store is read once a step,
// from memory; the hardware's prefetcher does not foresee the jump to the next row's columns).
template <int64_t DIM, typename T>
inline void prefetch_rows(const T* rows, int64_t w, int64_t count, int64_t n) {
  if (rows == nullptr) return;
  constexpr int64_t bytes = DIM * static_cast<int64_t>(sizeof(T));
  for (int64_t k = w; k < std::min(w + count, n); ++k)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + k * DIM) + b, _MM_HINT_T0);
}

#if defined(__AVX512F__)
// The 16 lane sums of v[0..15], in order, as one vector: pairs, then quads, then blocks folded
// together (45 instructions where 16 _mm512_reduce_add_ps take ~130).
inline __m512 lane_sums16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: v[2i]'s partials at 0, 2; v[2i+1]'s at 1, 3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: the partials of v[4i], ..., v[4i+3], in order
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // block k of the result: the totals of v[4k], ..., v[4k+3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[j * n + w] = scale * <query head j, key w>, for the group's query heads, 16 keys at a
// time; float32 products summed by FMA, per 16 values of the head, then across them.
template <int64_t DIM>
void scores_f32(const float* q, const float* keys, int64_t n, int64_t group, float scale,
                float* scores, const float* ahead) {
  constexpr int64_t chunks = DIM / 16;
  const __m512 scaled = _mm512_set1_ps(scale);
  int64_t w = 0;
  for (; w + 16 <= n; w += 16) {
    prefetch_rows<DIM>(ahead, w, 16, n);
    const float* block = keys + w * DIM;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * DIM;
      __m512 sums[16];
      for (int k = 0; k < 16; ++k) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c),
                                _mm512_loadu_ps(block + k * DIM + 16 * c), sum);
        sums[k] = sum;
      }
      _mm512_storeu_ps(scores + j * n + w, _mm512_mul_ps(lane_sums16(sums), scaled));
    }
  }
  prefetch_rows<DIM>(ahead, w, n - w, n);
  for (; w < n; ++w) {
    for (int64_t j = 0; j < group; ++j) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * DIM + 16 * c),
                              _mm512_loadu_ps(keys + w * DIM + 16 * c), sum);
      scores[j * n + w] = _mm512_reduce_add_ps(sum) * scale;
    }
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16: the products summed in fp32 by vdpbf16ps, 32 values at a time.
template <int64_t DIM>
void scores_bf16(const at::BFloat16* q, const at::BFloat16* keys, int64_t n, int64_t group,
                 float scale, float* scores, const at::BFloat16* ahead) {
  constexpr int64_t chunks = DIM / 32;
  __m512bh qv[kMaxGroup][chunks];
  for (int64_t j = 0; j < group; ++j)
    for (int64_t c = 0; c < chunks; ++c)
      qv[j][c] = (__m512bh)_mm512_loadu_si512(q + j * DIM + 32 * c);
  const __m512 scaled = _mm512_set1_ps(scale);
  int64_t w = 0;
  for (; w + 16 <= n; w += 16) {
    prefetch_rows<DIM>(ahead, w, 16, n);
    const at::BFloat16* block = keys + w * DIM;
    for (int64_t j = 0; j < group; ++j) {
      __m512 sums[16];
      for (int k = 0; k < 16; ++k) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          sum = _mm512_dpbf16_ps(sum, qv[j][c],
                                 (__m512bh)_mm512_loadu_si512(block + k * DIM + 32 * c));
        sums[k] = sum;
      }
      _mm512_storeu_ps(scores + j * n + w, _mm512_mul_ps(lane_sums16(sums), scaled));
    }
  }
  prefetch_rows<DIM>(ahead, w, n - w, n);
  for (; w < n; ++w) {
    const at::BFloat16* kr = keys + w * DIM;
    for (int64_t j = 0; j < group; ++j) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        sum = _mm512_dpbf16_ps(sum, qv[j][c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
      scores[j * n + w] = _mm512_reduce_add_ps(sum) * scale;
    }
  }
}

#endif  // __AVX512BF16__

// 16 values of a value row, as float32
inline __m512 widened(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widened(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc[j] += sum over w of p[j * n + w] * values[w], for GROUP query heads at once: their sums
// stay in registers while each value row is read and widened once.
template <int64_t DIM, int64_t GROUP, typename T>
void weighted_group(const float* p, int64_t n, const T* values, float* acc, const T* ahead,
                    int64_t ahead_n) {
  constexpr int64_t parts = DIM / 16;
  __m512 sum[GROUP][parts];
  for (int64_t j = 0; j < GROUP; ++j)
    for (int64_t v = 0; v < parts; ++v) sum[j][v] = _mm512_setzero_ps();
  for (int64_t w = 0; w < n; ++w) {
    if ((w & 3) == 0) prefetch_rows<DIM>(ahead, w, 4, ahead_n);
    __m512 row[parts];
    for (int64_t v = 0; v < parts; ++v) row[v] = widened(values + w * DIM + 16 * v);
    for (int64_t j = 0; j < GROUP; ++j) {
      const __m512 weight = _mm512_set1_ps(p[j * n + w]);
      for (int64_t v = 0; v < parts; ++v) sum[j][v] = _mm512_fmadd_ps(weight, row[v], sum[j][v]);
    }
  }
  if (ahead_n > n) prefetch_rows<DIM>(ahead, n, ahead_n - n, ahead_n);
  for (int64_t j = 0; j < GROUP; ++j)
    for (int64_t v = 0; v < parts; ++v) _mm512_storeu_ps(acc + j * DIM + 16 * v, sum[j][v]);
}

// acc[j] = sum over w of p[j * n + w] * values[w], four query heads at a time (the first pass
// brings the next task's ahead_n keys in).
template <int64_t DIM, typename T>
void weighted_sum(const float* p, int64_t n, int64_t group, const T* values, float* acc,
                  const T* ahead, int64_t ahead_n) {
  for (int64_t j = 0; j < group; j += 4) {
    const T* next = j == 0 ? ahead : nullptr;
    switch (std::min<int64_t>(group - j, 4)) {
      case 1: weighted_group<DIM, 1>(p + j * n, n, values, acc + j * DIM, next, ahead_n); break;
      case 2: weighted_group<DIM, 2>(p + j * n, n, values, acc + j * DIM, next, ahead_n); break;
      case 3: weighted_group<DIM, 3>(p + j * n, n, values, acc + j * DIM, next, ahead_n); break;
      default: weighted_group<DIM, 4>(p + j * n, n, values, acc + j * DIM, next, ahead_n); break;
    }
  }
}
#endif

#if BATCHLINE_F32_AVX2
// float32 on a CPU with AVX2 and no AVX-512: the same two passes, 8 values a vector.

// The 8 lane totals of v[0..7], in order, as one vector (hadd pairs, then quads, then the two
// 128-bit halves added).
inline __m256 lane_sums8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// scores[j * n + w] = scale * <query head j, key w>, 8 keys at a time; `ahead` (the task's
// values) asked for meanwhile.
template <int64_t DIM>
void scores_f32_avx2(const float* q, const float* keys, int64_t n, int64_t group, float scale,
                     float* scores, const float* ahead) {
  constexpr int64_t chunks = DIM / 8;
  const __m256 scaled = _mm256_set1_ps(scale);
  int64_t w = 0;
  for (; w + 8 <= n; w += 8) {
    prefetch_rows<DIM>(ahead, w, 8, n);
    const float* block = keys + w * DIM;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * DIM;
      __m256 sums[8];
      for (int k = 0; k < 8; ++k) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          sum = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * c),
                                _mm256_loadu_ps(block + k * DIM + 8 * c), sum);
        sums[k] = sum;
      }
      _mm256_storeu_ps(scores + j * n + w, _mm256_mul_ps(lane_sums8(sums), scaled));
    }
  }
  prefetch_rows<DIM>(ahead, w, n - w, n);
  for (; w < n; ++w) {
    for (int64_t j = 0; j < group; ++j) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * DIM + 8 * c),
                              _mm256_loadu_ps(keys + w * DIM + 8 * c), sum);
      scores[j * n + w] = lanes_total(sum) * scale;
    }
  }
}

// acc[j] = sum over w of p[j * n + w] * values[w], a query head at a time, its sum in registers
// (16 ymm hold no more than one head of 64 or 128); the first head's pass reads the values from
// memory and asks for the next task's keys, the others find them in L1/L2.
template <int64_t DIM>
void weighted_sum_avx2(const float* p, int64_t n, int64_t group, const float* values, float* acc,
                       const float* ahead, int64_t ahead_n) {
  constexpr int64_t parts = DIM / 8;
  for (int64_t j = 0; j < group; ++j) {
    const float* pj = p + j * n;
    const float* next = j == 0 ? ahead : nullptr;
    __m256 sum[parts];
    for (int64_t v = 0; v < parts; ++v) sum[v] = _mm256_setzero_ps();
    for (int64_t w = 0; w < n; ++w) {
      if ((w & 3) == 0) prefetch_rows<DIM>(next, w, 4, ahead_n);
      const __m256 weight = _mm256_set1_ps(pj[w]);
      for (int64_t v = 0; v < parts; ++v)
        sum[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values + w * DIM + 8 * v), sum[v]);
    }
    if (ahead_n > n) prefetch_rows<DIM>(next, n, ahead_n - n, ahead_n);
    for (int64_t v = 0; v < parts; ++v) _mm256_storeu_ps(acc + j * DIM + 8 * v, sum[v]);
  }
}
#endif

// DIM: the head dim when known at compile time (unrolled loops), 0 for any other. CAPPED: the
// scores soft-capped; a template argument, so that the uncapped loops compile as they did (a
// run-time branch there cost the bfloat16 step 8 %, 25.8 -> 27.9 ms).
// One thread's buffers for its tasks (a row's KV head each): group query heads of dim values.
struct AttendScratch {
  AttendScratch(int64_t group, int64_t dim)
      : qf(group * dim), acc(group * dim), row(dim), total(group) {}
  std::vector<float> qf, acc, row, total, scores;
};

// One task: the `group` query heads at qb (out at ob) against the n columns of one KV head
// from kb and vb; `next`, next_n: the next task's first key and columns (nullptr: none), which
// the vector loops bring in while this one's values are summed. Neither inlined nor cloned:
// attend and decode_layers.cpp's one-row path (attend_row_heads) run the one copy.
template <typename T, int64_t DIM, bool CAPPED>
__attribute__((noinline, noclone)) void attend_task(const T* qb, const T* kb, const T* vb,
                                                    int64_t n, int64_t group, int64_t dim,
                                                    float scale, float softcap, const T* next,
                                                    int64_t next_n, AttendScratch& s, T* ob) {
  std::vector<float>& qf = s.qf;
  std::vector<float>& acc = s.acc;
  std::vector<float>& row = s.row;
  std::vector<float>& total = s.total;
  std::vector<float>& scores = s.scores;
  scores.resize(group * n);
  bool fast = false;  // the AVX-512 loops, for heads of 64 or 128
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && DIM > 0 && DIM % 32 == 0) {
    fast = group <= kMaxGroup;
    if (fast) scores_f32<DIM>(qb, kb, n, group, scale, scores.data(), vb);
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && DIM > 0 && DIM % 32 == 0) {
    fast = group <= kMaxGroup;
    if (fast) scores_bf16<DIM>(qb, kb, n, group, scale, scores.data(), vb);
  }
#endif
#if BATCHLINE_F32_AVX2
  if constexpr (std::is_same_v<T, float> && DIM > 0 && DIM % 32 == 0) {
    fast = true;
    scores_f32_avx2<DIM>(qb, kb, n, group, scale, scores.data(), vb);
  }
#endif
  if (!fast) {
    for (int64_t j = 0; j < group; ++j)
      for (int64_t d = 0; d < dim; ++d) qf[j * dim + d] = load(qb + j * dim, d);
    for (int64_t w = 0; w < n; ++w) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] = load(kb + w * dim, d);
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = qf.data() + j * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qj[d] * row[d];
        scores[j * n + w] = dot * scale;
      }
    }
  }
  if constexpr (CAPPED) {  // Gemma 2's: cap * tanh(score / cap), tanh(y) = 1 - 2 / (e^2y + 1)
    const float twice = 2.0f / softcap;
#pragma omp simd
    for (int64_t i = 0; i < group * n; ++i)
      scores[i] = softcap * (1.0f - 2.0f / (exp_approx(twice * scores[i]) + 1.0f));
  }
  for (int64_t j = 0; j < group; ++j) {
    float* sj = scores.data() + j * n;
    total[j] = exp_shifted(sj, n, *std::max_element(sj, sj + n));
  }
  const T* ahead = fast ? next : nullptr;
  const int64_t ahead_n = ahead ? next_n : 0;
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 32 == 0) {
    if (fast) weighted_sum<DIM>(scores.data(), n, group, vb, acc.data(), ahead, ahead_n);
  }
#endif
#if BATCHLINE_F32_AVX2
  if constexpr (std::is_same_v<T, float> && DIM > 0 && DIM % 32 == 0) {
    weighted_sum_avx2<DIM>(scores.data(), n, group, vb, acc.data(), ahead, ahead_n);
  }
#endif
  if (!fast) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t w = 0; w < n; ++w) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] = load(vb + w * dim, d);
      for (int64_t j = 0; j < group; ++j) {
        const float pj = scores[j * n + w];
        float* aj = acc.data() + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) aj[d] += pj * row[d];
      }
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    T* orow = ob + j * dim;
    const float inv = 1.0f / total[j];
    for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[j * dim + d] * inv);
  }
}

template <typename T, int64_t DIM, bool CAPPED>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& first, int64_t hi, float scale, float softcap, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t dim = DIM ? DIM : q.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t* fp = first.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // Pieces of ~512 key columns at least: one row of 3 KV heads over 65 columns took 5.5 us on
  // one thread and no less on two (a second thread's wake-up costs what it saves), over 513
  // columns 22.5 us on one and 16.8 on two (bfloat16, the AMX Xeon, loaded).
  const int64_t grain = std::max<int64_t>(1, 512 / (hi + 1));
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    AttendScratch scratch(group, dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t start = fp[b], n = hi - start + 1;
      const int64_t base = (b * kv_heads + h) * capacity;  // slot b, head h, column 0
      const T* next = nullptr;
      int64_t next_n = 0;
      if (task + 1 < end) {
        const int64_t b2 = (task + 1) / kv_heads, h2 = (task + 1) % kv_heads;
        next = kp + ((b2 * kv_heads + h2) * capacity + fp[b2]) * dim;
        next_n = hi - fp[b2] + 1;
      }
      attend_task<T, DIM, CAPPED>(qp + (b * heads + h * group) * dim, kp + (base + start) * dim,
                                  vp + (base + start) * dim, n, group, dim, scale, softcap, next,
                                  next_n, scratch, op + (b * heads + h * group) * dim);
    }
  });
}

// f(T{}) for x's dtype, bfloat16 or float32 (the dtypes a step computes in on the CPU).
template <typename F>
void on_dtype(const at::Tensor& x, const char* op, F&& f) {
  if (x.scalar_type() == at::kBFloat16) return f(at::BFloat16{});
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": bfloat16 or float32");
  f(float{});
}

// the head dims unrolled at compile time, each with and without the cap
template <typename T, bool CAPPED>
void by_dim(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& first, int64_t hi, float scale, float softcap, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend<T, 64, CAPPED>(q, keys, values, first, hi, scale, softcap, out);
    case 128: return attend<T, 128, CAPPED>(q, keys, values, first, hi, scale, softcap, out);
    default: return attend<T, 0, CAPPED>(q, keys, values, first, hi, scale, softcap, out);
  }
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& first, int64_t hi, float scale, float softcap, at::Tensor& out) {
  if (softcap > 0.0f) return by_dim<T, true>(q, keys, values, first, hi, scale, softcap, out);
  by_dim<T, false>(q, keys, values, first, hi, scale, softcap, out);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& first, int64_t hi, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q (rows, heads, dim), keys and values (slots, kv_heads, "
              "capacity, dim)");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "decode_attention: q, keys and values must be contiguous");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "decode_attention: q, keys and values must have one dtype");
  TORCH_CHECK(q.size(2) == keys.size(3) && q.size(1) % keys.size(1) == 0,
              "decode_attention: head dims differ, or heads is not a multiple of kv_heads");
  TORCH_CHECK(q.size(0) <= keys.size(0), "decode_attention: more rows than slots");
  TORCH_CHECK(first.scalar_type() == at::kLong && first.dim() == 1 && first.size(0) == q.size(0),
              "decode_attention: first must be int64 (rows,)");
  TORCH_CHECK(hi >= 0 && hi < keys.size(2), "decode_attention: hi outside the buffers");
  const auto f = first.contiguous();
  if (q.size(0)) {
    const int64_t* fp = f.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(fp[b] >= 0 && fp[b] <= hi, "decode_attention: first[b] must be in [0, hi]");
  }
  auto out = at::empty_like(q);
  TORCH_CHECK(softcap >= 0.0, "decode_attention: softcap must be >= 0 (0: none)");
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  on_dtype(q, "decode_attention", [&](auto tag) {
    dispatch<decltype(tag)>(q, keys, values, f, hi, s, cap, out);
  });
  return out;
}

// -- a step's elementwise work, one call each instead of torch's chain of small ops -------------
// Each rounds to T where torch's chain (lean_llama.py) rounds: the same values, except the sum
// of squares in rms_norm (another summation order) and the activations' exp (exp_approx).

// v's bfloat16 bits, rounded to nearest even as at::BFloat16(v) rounds (a NaN stays one),
// without its branch: a loop over it vectorizes.
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t even = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((v != v ? 0x7FC00000u : even) >> 16);
}

inline float rounded(float v, const at::BFloat16*) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(v)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float rounded(float v, const float*) { return v; }
inline void store(at::BFloat16* p, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v);
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }

// Per row of n values, h = float(x) and inv = rsqrt(mean(h^2) + eps): with a weight of x's
// dtype W = T, out = weight * T(h * inv) (Llama's order: rounded, then weighed); with a float
// weight beside a bfloat16 x, out = T(h * inv * weight) (Gemma's: weighed in float32 by its
// 1 + weight, then rounded once). In float32 the two are one.
// Neither inlined nor cloned for a constant argument: the op and decode_layers.cpp's one-row
// path (rms_norm_row) run the one copy, whose summation order the compiler chose once. A clone
// for rows = 1 summed the squares in another order (1 ulp of the norm).
template <typename T, typename W>
__attribute__((noinline, noclone)) void rms_rows(const T* x, const W* weight, T* out,
                                                 int64_t rows, int64_t n, float eps) {
  constexpr bool weighed_first = !std::is_same_v<T, W>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* orow = out + r * n;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < n; ++d) squares += load(xr, d) * load(xr, d);
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    if constexpr (weighed_first) {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) store(orow, d, load(xr, d) * inv * load(weight, d));
    } else {
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) store(orow, d, load(weight, d) * rounded(load(xr, d) * inv, xr));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool float_weight = weight.scalar_type() == at::kFloat;
  TORCH_CHECK((x.scalar_type() == weight.scalar_type() || float_weight) && weight.dim() == 1 &&
                  x.size(-1) == weight.size(0),
              "rms_norm: x (..., n) and weight (n,) of x's dtype or float32");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = weight.size(0), rows = n ? xc.numel() / n : 0;
  on_dtype(xc, "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    if (float_weight) {
      rms_rows<scalar_t, float>(xc.data_ptr<scalar_t>(), wc.data_ptr<float>(),
                                out.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
    } else {
      rms_rows<scalar_t, scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                                   out.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
    }
  });
  return out;
}

// T(T(act(gate)) * up) from one (rows, 2 * n) gate/up product, gate first. act is SiLU,
// x / (1 + exp(-x)), or GeLU with tanh, 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi),
// which is x / (1 + exp(-2 k (x + 0.044715 x^3))): one form, another argument. One copy, as
// rms_rows.
template <typename T, bool Gelu>
__attribute__((noinline, noclone)) void act_mul_rows(const T* gate_up, T* out, int64_t rows,
                                                     int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* orow = out + r * n;
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float>) {  // 8 at a time (exp_approx8)
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; d + 8 <= n; d += 8) {
        const __m256 x = _mm256_loadu_ps(g + d);
        __m256 z = x;
        if constexpr (Gelu) {
          const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
          z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                            _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
        }
        const __m256 e = exp_approx8(_mm256_xor_ps(z, sign));  // exp(-z)
        const __m256 act = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(orow + d, _mm256_mul_ps(act, _mm256_loadu_ps(u + d)));
      }
    }
#endif
    for (; d < n; ++d) {
      const float x = load(g, d);
      const float z = Gelu ? 1.5957691216057308f * (x + 0.044715f * x * x * x) : x;
      store(orow, d, rounded(x / (1.0f + exp_approx(-z)), g) * load(u, d));
    }
  }
}

template <bool Gelu>
at::Tensor act_mul(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, name, ": gate_up (rows, 2 * n)");
  const auto gu = gate_up.contiguous();
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  auto out = at::empty({rows, n}, gu.options());
  on_dtype(gu, name, [&](auto tag) {
    using scalar_t = decltype(tag);
    act_mul_rows<scalar_t, Gelu>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return act_mul<false>(gate_up, "silu_mul"); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  return act_mul<true>(gate_up, "gelu_tanh_mul");
}

// T(T(x * cos) + T(rotate_half(x) * sin)) over the first r values of one head of dim values
// (sin's first half already negated: rotate_half's sign), the rest of the head kept. Products
// and sum not fused into an FMA: float32 gives torch's values bit for bit. Not inlined, so that
// no caller compiled with contraction on takes the loop in.
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rotate_head(const T* xh, const T* c,
                                                                        const T* sn, int64_t r,
                                                                        int64_t dim, T* oh) {
  const int64_t half = r / 2;
#pragma omp simd
  for (int64_t d = 0; d < r; ++d) {
    const float turned = load(xh, d < half ? d + half : d - half);
    const float a = rounded(load(xh, d) * load(c, d), xh);
    const float b = rounded(turned * load(sn, d), xh);
    store(oh, d, a + b);
  }
  for (int64_t d = r; d < dim; ++d) oh[d] = xh[d];
}

// cos and sin (tokens, 1, r) for x's tokens: r even and at most a head's dim, x's dtype.
void check_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t tokens, int64_t dim,
                  at::ScalarType dtype, const char* op) {
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == tokens &&
                  cos.size(1) == 1 && cos.size(2) % 2 == 0 && cos.size(2) <= dim,
              op, ": cos and sin (tokens, 1, r), r even and at most dim");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, op,
              ": x, cos and sin of one dtype");
}

// x: (tokens, heads, dim), its last axis contiguous; cos and sin: (tokens, 1, r).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x (tokens, heads, dim), dim contiguous");
  check_tables(cos, sin, x.size(0), x.size(2), x.scalar_type(), "rotary");
  const auto c = cos.contiguous(), sn = sin.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), r = c.size(2);
  on_dtype(x, "rotary", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* cp = c.data_ptr<T>();
    const T* sp = sn.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(xp + t * x.stride(0) + h * x.stride(1), cp + t * r, sp + t * r, r, dim,
                    op + (t * heads + h) * dim);
  });
  return out;
}

// One layer's attention in a step where every row decodes, in one call where the lean forward
// made ~35 (lean_llama.LeanForward), most of them views and copies each paying Python's and
// the dispatcher's toll: q rotated out of the fused projection's output, each row's new k
// rotated and v copied straight into column hi of its slot, and decode_attention over them.
// The same loops on the same values as rotary and the store's copies: the same bits as those
// calls (a version that made them as ATen calls, views and copies took 19-25 us a layer at
// SmolLM2-360M's heads on Zen 4, ~8 of them beside the attention's own).
//   decode_step(qkv, cos, sin, keys, values, first, hi, scale, heads) -> out
//     qkv:    (rows, (heads + 2 * kv_heads) * dim), q then k then v, its last axis contiguous
//     cos, sin, first, hi, scale: as rotary and decode_attention take them
//     keys, values: one layer's store buffers, contiguous, written at [:rows, :, hi]
//     out:    (rows, heads * dim)
at::Tensor decode_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor keys, at::Tensor values, const at::Tensor& first, int64_t hi,
                       double scale, int64_t heads) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_step: keys and values (slots, kv_heads, capacity, dim)");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(),
              "decode_step: keys and values must be contiguous");
  const int64_t rows = qkv.size(0), kv_heads = keys.size(1), capacity = keys.size(2);
  const int64_t dim = keys.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "decode_step: qkv must be (rows, (heads + 2 * kv_heads) * dim), its last axis "
              "contiguous");
  TORCH_CHECK(rows <= keys.size(0) && hi >= 0 && hi < capacity,
              "decode_step: more rows than slots, or hi outside the buffers");
  TORCH_CHECK(keys.scalar_type() == qkv.scalar_type() && values.scalar_type() == qkv.scalar_type(),
              "decode_step: qkv, keys and values must have one dtype");
  check_tables(cos, sin, rows, dim, qkv.scalar_type(), "decode_step");
  const auto c = cos.contiguous(), sn = sin.contiguous();
  const int64_t r = c.size(2);
  auto q = at::empty({rows, heads, dim}, qkv.options());
  on_dtype(qkv, "decode_step", [&](auto tag) {
    using T = decltype(tag);
    const T* cp = c.data_ptr<T>();
    const T* sp = sn.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = keys.data_ptr<T>();
    T* vp = values.data_ptr<T>();
    for (int64_t b = 0; b < rows; ++b) {
      const T* row = qkv.data_ptr<T>() + b * qkv.stride(0);
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(row + h * dim, cp + b * r, sp + b * r, r, dim, qp + (b * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t column = ((b * kv_heads + h) * capacity + hi) * dim;
        rotate_head(row + (heads + h) * dim, cp + b * r, sp + b * r, r, dim, kp + column);
        std::memcpy(vp + column, row + (heads + kv_heads + h) * dim, dim * sizeof(T));
      }
    }
  });
  return decode_attention(q, keys, values, first, hi, scale, 0.0).view({rows, heads * dim});
}

}  // namespace

// -- one row's norm, activation and attention for decode_layers.cpp's one region (row_steps.h)
namespace batchline_rows {

void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  rms_rows<float, float>(x, weight, out, 1, n, eps);
}

void act_mul_row(const float* gate_up, int64_t n, bool gelu, float* out) {
  if (gelu) {
    act_mul_rows<float, true>(gate_up, out, 1, n);
  } else {
    act_mul_rows<float, false>(gate_up, out, 1, n);
  }
}

void attend_row_heads(const float* qkv, const float* cos, const float* sin, int64_t r,
                      float* keys, float* values, int64_t kv_heads, int64_t capacity, int64_t dim,
                      int64_t heads, int64_t first, int64_t hi, float scale, int64_t h0,
                      int64_t h1, float* q, float* out) {
  const int64_t group = heads / kv_heads, n = hi - first + 1;
  // decode_step's rotations and copies of these KV heads (its loop does them in another
  // order; each value is computed alone: the same bits)
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t j = h * group; j < (h + 1) * group; ++j)
      rotate_head(qkv + j * dim, cos, sin, r, dim, q + j * dim);
    const int64_t column = (h * capacity + hi) * dim;
    rotate_head(qkv + (heads + h) * dim, cos, sin, r, dim, keys + column);
    std::memcpy(values + column, qkv + (heads + kv_heads + h) * dim, dim * sizeof(float));
  }
  auto tasks = [&](auto dim_tag) {
    constexpr int64_t kDim = decltype(dim_tag)::value;
    AttendScratch scratch(group, dim);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t start = h * capacity + first;  // slot 0, head h, column first
      const float* next = h + 1 < h1 ? keys + (start + capacity) * dim : nullptr;
      attend_task<float, kDim, false>(q + h * group * dim, keys + start * dim,
                                      values + start * dim, n, group, dim, scale, 0.0f, next,
                                      next ? n : 0, scratch, out + h * group * dim);
    }
  };
  switch (dim) {  // by_dim's unrolled head dims
    case 64:
      return tasks(std::integral_constant<int64_t, 64>{});
    case 128:
      return tasks(std::integral_constant<int64_t, 128>{});
    default:
      return tasks(std::integral_constant<int64_t, 0>{});
  }
}

}  // namespace batchline_rows

TORCH_LIBRARY(batchline, m) {
  m.def(
      "decode_attention(Tensor q, Tensor keys, Tensor values, Tensor first, int hi, float scale,"
      " float softcap=0.0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "decode_step(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values,"
      " Tensor first, int hi, float scale, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("rotary", &rotary);
  m.impl("decode_step", &decode_step);
}
