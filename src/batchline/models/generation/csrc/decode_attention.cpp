// batchline's decode attention on CPU: each running row's queries attend over that row's own
// keys and values in the slot store, read where they lie (no padded window, no copy).
//
//   decode_attention(q, keys, values, first, hi, scale) -> out
//     q:      (rows, heads, dim), contiguous, bfloat16 or float32
//     keys:   (slots, kv_heads, capacity, dim), one layer's store buffer, contiguous, q's dtype
//     values: as keys
//     first:  (rows,) int64: row b attends columns [first[b], hi] of its slot b
//     out:    (rows, heads, dim), q's dtype
//
// Per row and KV head: the scores of its query heads against each column (fp32; on a CPU with
// AVX512-BF16 the bfloat16 products are summed by vdpbf16ps), a softmax, and the weighted sum
// of the values in fp32. Rows and heads are split over ATen's intra-op threads.
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

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (softmax after its maximum is subtracted): 2^n * p(r) with a degree-6
// polynomial, branch-free so that the loop over it vectorizes; relative error ~2e-7 on
// [-87, 0], exp(-87) below.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
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

constexpr int64_t kMaxGroup = 8;  // query heads per KV head on the vdpbf16ps path

// DIM: the head dim when known at compile time (unrolled loops), 0 for any other.
template <typename T, int64_t DIM>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& first, int64_t hi, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t dim = DIM ? DIM : q.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t* fp = first.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), total(group), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t start = fp[b], n = hi - start + 1;
      const int64_t base = (b * kv_heads + h) * capacity;  // slot b, head h, column 0
      const T* qb = qp + (b * heads + h * group) * dim;    // its first query head
      scores.resize(group * n);
      bool done = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16> && DIM > 0 && DIM % 32 == 0) {
        if (group <= kMaxGroup) {
          constexpr int64_t chunks = DIM / 32;
          __m512bh qv[kMaxGroup][chunks];
          for (int64_t j = 0; j < group; ++j)
            for (int64_t c = 0; c < chunks; ++c)
              qv[j][c] = (__m512bh)_mm512_loadu_si512(qb + j * DIM + 32 * c);
          for (int64_t w = 0; w < n; ++w) {
            const T* kr = kp + (base + start + w) * DIM;
            __m512bh kv[chunks];
            for (int64_t c = 0; c < chunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
            for (int64_t j = 0; j < group; ++j) {
              __m512 sum = _mm512_setzero_ps();
              for (int64_t c = 0; c < chunks; ++c) sum = _mm512_dpbf16_ps(sum, qv[j][c], kv[c]);
              scores[j * n + w] = _mm512_reduce_add_ps(sum) * scale;
            }
          }
          done = true;
        }
      }
#endif
      if (!done) {
        for (int64_t j = 0; j < group; ++j)
          for (int64_t d = 0; d < dim; ++d) qf[j * dim + d] = load(qb + j * dim, d);
        for (int64_t w = 0; w < n; ++w) {
          const T* kr = kp + (base + start + w) * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) row[d] = load(kr, d);
          for (int64_t j = 0; j < group; ++j) {
            const float* qj = qf.data() + j * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qj[d] * row[d];
            scores[j * n + w] = dot * scale;
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * n;
        const float top = *std::max_element(sj, sj + n);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t w = 0; w < n; ++w) {
          sj[w] = exp_nonpositive(sj[w] - top);
          sum += sj[w];
        }
        total[j] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t w = 0; w < n; ++w) {
        const T* vr = vp + (base + start + w) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] = load(vr, d);
        for (int64_t j = 0; j < group; ++j) {
          const float pj = scores[j * n + w];
          float* aj = acc.data() + j * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) aj[d] += pj * row[d];
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        T* orow = op + (b * heads + h * group + j) * dim;
        const float inv = 1.0f / total[j];
        for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[j * dim + d] * inv);
      }
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& first, int64_t hi, float scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return attend<T, 64>(q, keys, values, first, hi, scale, out);
    case 128: return attend<T, 128>(q, keys, values, first, hi, scale, out);
    default: return attend<T, 0>(q, keys, values, first, hi, scale, out);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& first, int64_t hi, double scale) {
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
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) {
    dispatch<at::BFloat16>(q, keys, values, f, hi, s, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: bfloat16 or float32");
    dispatch<float>(q, keys, values, f, hi, s, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(batchline, m) {
  m.def(
      "decode_attention(Tensor q, Tensor keys, Tensor values, Tensor first, int hi, float scale)"
      " -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) { m.impl("decode_attention", &decode_attention); }
