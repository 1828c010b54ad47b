// int4 with 8-bit steps, quantized at load (quant_codes.quantize_int4_steps; the layout that
// quant_kernel.pack_int4_steps packs and every int4 kernel reads: quant_layout.h).
//
//   int4_weight_steps(w, refits) -> (codes, steps, offsets, units)
//     w:       (N, K) contiguous float32, K a multiple of 32
//     refits:  how many times each group's scale and zero are refitted to its codes (0 to 8)
//     codes:   (N, K) uint8 in [0, 15]
//     steps, offsets: (N, K / 32) uint8
//     units:   (ceil(N / 16), K / 32) bf16
//   A row's group has scale = unit * step and zero = scale * (8 - offset / 16) (its tile's unit):
//   w ~ (code - 8) * scale + zero.
//
// Per group of 32 the range is [min(low, 0), max(high, 0)] and the scale it needs range / 15.
// Per 16 rows (a tile of the layout) and group the unit is the least bf16 value at least the
// largest of their finite needs over 255 (an inf or NaN row does not coarsen the others); a
// row's step the least integer whose unit * step covers its range (0 for a group of zeros: its
// weights stay 0), its offset the shift, in 16ths of a step, that centers the range on the
// codes 0..15, and its codes round(w / scale + offset / 16) clamped to [0, 15]. Then, `refits`
// times, the scale and zero that fit the codes by least squares are rounded to the grid (a
// whole step, a 16th of the scale: their codes taken again) and kept where the group's squared
// error fell. Plain C++ over the 32 values of a group (the
// compiler vectorizes it); tiles split over ATen's intra-op threads, the same bits at any count.
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "quant_layout.h"

namespace {

using namespace batchline_quant;

// The least bf16 value at least f (f finite and > 0), as its bits.
uint16_t bf16_at_least(float f) {
  uint16_t bits = float_to_bf16_bits(f);
  if (bf16_to_float(bits) < f) ++bits;
  return bits;
}

// The codes of a group's 32 values on a grid, and the group's squared error on it.
float on_grid(const float* v, float scale, float offset, uint8_t* codes) {
  if (!(scale > 0.f)) {
    float error = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      codes[i] = 8;
      error += v[i] * v[i];
    }
    return error;
  }
  const float inverse = 1.f / scale, shift = offset / 16.f, zero = scale * (8.f - shift);
  float error = 0.f;
#pragma omp simd reduction(+ : error)
  for (int i = 0; i < kGroup; ++i) {
    const float c = std::min(15.f, std::max(0.f, std::nearbyint(v[i] * inverse + shift)));
    codes[i] = static_cast<uint8_t>(c);
    const float e = (c - 8.f) * scale + zero - v[i];
    error += e * e;
  }
  return error;
}

// One group of one row: its step and offset on `unit`, codes and refits.
void quantize_group(const float* v, float unit, int64_t refits, uint8_t* codes, uint8_t& step,
                    uint8_t& offset) {
  float low = 0.f, high = 0.f;
  for (int i = 0; i < kGroup; ++i) low = std::min(low, v[i]), high = std::max(high, v[i]);
  const float need = (high - low) / 15.f;
  float s = std::min(255.f, std::ceil(need / unit));
  float o = 128.f;
  if (s > 0.f) {
    const float middle = 8.f * (15.f - (high + low) / (unit * s));  // in 16ths of a step
    o = std::min(255.f, std::max(0.f, std::nearbyint(middle)));
  }
  float error = on_grid(v, unit * s, o, codes);
  uint8_t trial[kGroup];
  for (int64_t r = 0; r < refits && s > 0.f; ++r) {
    float sx = 0.f, sxx = 0.f, sw = 0.f, sxw = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      const float x = static_cast<float>(codes[i]) - 8.f;
      sx += x, sxx += x * x, sw += v[i], sxw += x * v[i];
    }
    const float det = kGroup * sxx - sx * sx;
    if (!(det > 0.f)) break;
    const float fit = (kGroup * sxw - sx * sw) / det;
    if (!(fit > 0.f)) break;
    const float zero = (sw - fit * sx) / kGroup;
    const float s2 = std::min(255.f, std::max(1.f, std::nearbyint(fit / unit)));
    const float o2 =
        std::min(255.f, std::max(0.f, std::nearbyint(16.f * (8.f - zero / (unit * s2)))));
    const float error2 = on_grid(v, unit * s2, o2, trial);
    if (!(error2 < error)) break;  // the grid it came from was as good: no further refit moves
    s = s2, o = o2, error = error2;
    std::memcpy(codes, trial, kGroup);
  }
  step = static_cast<uint8_t>(s);
  offset = static_cast<uint8_t>(o);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int4_weight_steps(const at::Tensor& w,
                                                                             int64_t refits) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.size(1) % kGroup == 0,
              "int4_weight_steps: w must be a contiguous (N, K) float32 tensor, K a multiple "
              "of 32");
  TORCH_CHECK(refits >= 0 && refits <= 8, "int4_weight_steps: refits must be in [0, 8], got ",
              refits);
  const int64_t n = w.size(0), k_total = w.size(1), groups = k_total / kGroup;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const auto bytes = w.options().dtype(at::kByte);
  auto codes = at::empty({n, k_total}, bytes);
  auto steps = at::empty({n, groups}, bytes);
  auto offsets = at::empty({n, groups}, bytes);
  auto units = at::empty({tiles, groups}, w.options().dtype(at::kBFloat16));
  const float* wp = w.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = steps.data_ptr<uint8_t>();
  uint8_t* op = offsets.data_ptr<uint8_t>();
  auto* up = reinterpret_cast<uint16_t*>(units.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, 4096 / k_total);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(n, r0 + kTile);
      for (int64_t g = 0; g < groups; ++g) {
        float top = 0.f;
        for (int64_t r = r0; r < r1; ++r) {
          const float* v = wp + r * k_total + g * kGroup;
          float low = 0.f, high = 0.f;
          for (int i = 0; i < kGroup; ++i) low = std::min(low, v[i]), high = std::max(high, v[i]);
          const float need = (high - low) / 15.f;
          if (std::isfinite(need)) top = std::max(top, need);  // an inf or NaN row alone pays
        }
        top /= 255.f;
        const uint16_t unit_bits = top > 0.f && std::isfinite(top) ? bf16_at_least(top) : 0x3F80;
        up[t * groups + g] = unit_bits;
        const float unit = bf16_to_float(unit_bits);
        for (int64_t r = r0; r < r1; ++r) {
          quantize_group(wp + r * k_total + g * kGroup, unit, refits, cp + r * k_total + g * kGroup,
                         sp[r * groups + g], op[r * groups + g]);
        }
      }
    }
  });
  return {codes, steps, offsets, units};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def("int4_weight_steps(Tensor w, int refits) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) { m.impl("int4_weight_steps", &int4_weight_steps); }
