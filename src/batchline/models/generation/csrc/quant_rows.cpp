// Rows of a weight held in the int8 layout (quant_kernel.pack_int8g), read from the blocks of
// those rows alone: an embedding looked up in the lm_head it is tied to (quant_embedding.py),
// each step. quant_kernel.packed_rows computes the same through strided views in ~15 torch ops
// (~0.25 ms a step for one row of SmolLM2-360M's 960 inputs, Zen 4 EPYC, 2026-12-07, 2.5 % of
// its int4 batch-1 step, the other core idle meanwhile); here it is one loop.
//
//   int8g_rows(packed, ids, n, dtype) -> out
//     packed: (tiles, K / 32, 544) uint8, pack_int8g's layout: per tile of 16 columns and group
//             of 32 inputs, 8 chunks of 64 bytes (chunk c holds column j's codes of inputs
//             4c..4c+3 at 64c + 4j, in input order), then the 16 columns' bf16 scales
//     ids:    (m,) int64, each in [0, n)
//     n:      the weight's columns (the rows looked up; the last tile's others are padding)
//     dtype:  the output's: each value code * scale in float32 (exact: an int8 code times a
//             bf16 scale), rounded to dtype once as torch's conversion rounds
//     out:    (m, K) in dtype
// Built with the library's other sources by batchline.models.generation.decode_kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "quant_layout.h"

namespace {

using namespace batchline_quant;

float bf16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return bf16_to_float(h);
}

// Row `column` of `tile` (its groups' blocks `groups` apart) into out, K values.
template <typename T>
void one_row(const uint8_t* tile, int64_t groups, int64_t column, T* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = tile + g * kBlockInt8;
    const float scale = bf16_at(block + kInt8Codes + 2 * column);
    for (int64_t c = 0; c < 8; ++c) {
      const auto* codes = reinterpret_cast<const int8_t*>(block + 64 * c + 4 * column);
      for (int64_t t = 0; t < 4; ++t) {
        out[g * kGroup + 4 * c + t] = static_cast<T>(static_cast<float>(codes[t]) * scale);
      }
    }
  }
}

// Rows id[0..m) of packed into out (m rows of K values), each row by one thread.
template <typename T>
void rows_into(const at::Tensor& packed, const int64_t* id, int64_t m, T* out) {
  const int64_t groups = packed.size(1), k = groups * kGroup, tile_bytes = groups * kBlockInt8;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  // a row is ~K bytes read and written: threads only for many rows
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      one_row(wp + id[i] / kTile * tile_bytes, groups, id[i] % kTile, out + i * k);
    }
  });
}

at::Tensor int8g_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t n,
                      at::ScalarType dtype) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockInt8,
              "int8g_rows: packed must be pack_int8g's (tiles, K / 32, 544) uint8 tensor");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kTile && n > (packed.size(0) - 1) * kTile,
              "int8g_rows: n = ", n, " columns do not fill ", packed.size(0), " tiles of ", kTile);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "int8g_rows: ids must be a (m,) int64 tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t m = idc.size(0), k = packed.size(1) * kGroup;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "int8g_rows: id ", id[i], " is out of [0, ", n, ")");
  }
  const bool direct = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  auto out = at::empty({m, k}, packed.options().dtype(direct ? dtype : at::kFloat));
  switch (out.scalar_type()) {
    case at::kBFloat16:
      rows_into(packed, id, m, out.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      rows_into(packed, id, m, out.data_ptr<c10::Half>());
      break;
    default:
      rows_into(packed, id, m, out.data_ptr<float>());
  }
  return direct ? out : out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.def("int8g_rows(Tensor packed, Tensor ids, int n, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchline, CPU, m) { m.impl("int8g_rows", &int8g_rows); }
