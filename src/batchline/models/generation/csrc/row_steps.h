// The parts of a one-row decode step that decode_layers.cpp runs inside one parallel region,
// each the code the library's own op runs for one float32 row, so the same bits: quantizing a
// row to int8 and the int4 and int8 layouts' products over a range of tiles (quant_gemm_a8.cpp's
// int4_linear_a8 and int8g_linear_a8), the RMS norm and the activation (decode_attention.cpp's
// rms_norm, silu_mul and gelu_tanh_mul), and the attention over some of the KV heads
// (decode_step's). None takes a thread of its own or allocates: the caller splits the work and
// owns the buffers.

#pragma once

#include <cstdint>

namespace batchline_rows {

// One row quantized per group of 32 inputs: the codes (32 a group), and per group its scale, its
// code sum and their product (quant_gemm_a8.cpp's quantize_row, one row).
struct RowCodes {
  int8_t* codes;
  float* scales;
  int32_t* sums;
  float* scaled_sums;
};

// Whether this build has the one-row products below (AVX-512 with VNNI and BW): without it
// they compute nothing, and decode_layers.cpp keeps to the ops.
bool one_row_built();

// The k inputs of x (a multiple of 32) quantized into `out`, the codes in the order the int4
// layouts' 512-bit product reads them (`paired`) or in input order (the int8 layout's).
void quantize_one_row(const float* x, int64_t k, bool paired, const RowCodes& out);

// Columns [16 * t0, min(n, 16 * t1)) of one row's product with a packed weight of `groups`
// groups a tile, as int4_linear_a8(x, packed, n, bias, 512, streams) computes them (a block of
// 320, 384 or 290 bytes; x quantized `paired`) or int8g_linear_a8(x, packed, n, bias, width,
// streams) does (544; x in input order). out: the row's n outputs.
void one_row_tiles(const uint8_t* packed, int64_t block_bytes, int64_t groups, const RowCodes& x,
                   const float* bias, int64_t n, int64_t width, int64_t streams, int64_t t0,
                   int64_t t1, float* out);

// rms_norm(x, weight, eps) of one float32 row of n values with a float32 weight
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out);

// silu_mul (or gelu_tanh_mul) of one float32 row: n outputs from the 2 * n of gate_up
void act_mul_row(const float* gate_up, int64_t n, bool gelu, float* out);

// decode_step(qkv, cos, sin, keys, values, first, hi, scale, heads) of one float32 row (cos,
// sin: its r values) for KV heads [h0, h1): their query heads rotated into q, their key
// rotated into column hi of slot 0 (keys, values: a layer's (slots, kv_heads, capacity, dim)
// buffers) and their value copied there, and their query heads' attention over columns
// [first, hi] into out (q, out: heads * dim values)
void attend_row_heads(const float* qkv, const float* cos, const float* sin, int64_t r,
                      float* keys, float* values, int64_t kv_heads, int64_t capacity, int64_t dim,
                      int64_t heads, int64_t first, int64_t hi, float scale, int64_t h0,
                      int64_t h1, float* q, float* out);

}  // namespace batchline_rows
