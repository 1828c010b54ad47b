// A decode-only step's layers in one call, for a model whose every layer the lean forward
// (lean_llama.LeanForward) would run as: RMSNorm, the fused q/k/v product, decode_step, the o
// product, the residual, RMSNorm, the fused gate/up product, act(gate) * up, the down product,
// the residual, each product one of this library's linears. Each of those is one of this
// library's ops, called here through the dispatcher in the order and with the arguments the
// Python loop gives them: the same bits, without the ~25 us a layer of Python and of
// converting arguments that ten calls from Python cost (a third of what a SmolLM2-360M int4
// layer spent beside its weights, on Zen 4).
//
//   DecodeLayers(norms, packed, biases, spec, eps, scale, heads, wide_rows, a8_width,
//                a8_bf16_rows)
//     norms:  two per layer, the attention's input norm and the MLP's
//     packed: four per layer, the q/k/v, o, gate/up and down products' weights as their ops
//             take them
//     biases: four per layer, each an empty tensor where that product has none
//     spec:   per layer, its store index, its activation (0 SiLU, 1 GeLU with tanh), then per
//             product: its op (decode_kernel.StepProduct's layouts: 0 int4_linear_a8, 1
//             int8g_linear_a8, 2 bf16_tiles_linear, 3 int4_linear_f32, 4 int4_linear, 5
//             int4_linear with fewer than a8_bf16_rows rows through int4_linear_a8), its
//             outputs, and the op's last argument (0-1 and 5: the tiles one row reads at
//             once; 3: the width; 2 and 4: amx_rows)
//     wide_rows: the fewest rows the int8 layout's product takes through its 512-bit path (one
//             row too where it reads more than one tile at once)
//     a8_width: the int8-rows products' wide path (quant_kernel.A8_WIDTH; the narrow one is 256)
//     a8_bf16_rows: below it, layout 5 sums bf16 rows as int8 (quant_kernel.A8_BF16_ROWS); from
//             it on through int4_linear, on AMX tiles (its amx_rows)
//   .forward(h, cos, sin, keys, values, first, hi) -> h after every layer
//     h: (rows, hidden) in the dtype the products take; keys, values: the store's buffers of
//     every layer; cos, sin, first, hi: as decode_step takes them
//   .one_row() -> whether one float32 row takes one parallel region (below)
//   .use_one_row(on) -> one_row() after turning that path on (where it can be) or off (one
//     row then goes op by op as more do: the same bits; benchmarks compare the two)
//
// One float32 row (a batch-1 step) whose products are all int8-rows ones (layouts 0 and 1),
// on a build with the VNNI path, takes every layer in one parallel region of torch's threads.
// Each thread norms and quantizes the row itself (a few us, no wait); the products' tiles split
// among the threads as their ops split them, each thread adding the residual to its own
// columns; the attention's KV heads split evenly (the threads are awake: the op's ~512 columns
// a share, which spares a wake-up, do not apply); a barrier where a step needs every value of
// the one before. Each part is the ops' code on the same numbers (row_steps.h), so the same
// bits, without ten op calls, their tensors and their regions a layer. Where the attention's
// arguments are not ones decode_step takes, the row goes op by op, whose checks say why. On
// Zen 4 a SmolLM2-360M int4 step spent ~30 % of its time outside its products, the other
// thread waiting; in one region x0.87 the time (docs/generation.md).
// Built by batchline.models.generation.decode_kernel with the machine's C++ compiler.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "quant_layout.h"
#include "row_steps.h"

namespace {

constexpr int64_t kSpecHead = 2;       // store index, activation
constexpr int64_t kSpecProduct = 3;    // op, outputs, its last argument
constexpr int64_t kProducts = 4;       // q/k/v, o, gate/up, down
constexpr int64_t kSpecLayer = kSpecHead + kProducts * kSpecProduct;
enum Layout : int64_t {
  kInt4A8 = 0,
  kInt8gA8 = 1,
  kTiles = 2,
  kInt4F32 = 3,
  kInt4Bf16 = 4,
  kInt4Bf16A8 = 5
};

using Optional = std::optional<at::Tensor>;

// The library's ops as registered, looked up once.
struct Ops {
  using Streamed = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Optional&,
                              int64_t, int64_t);
  c10::TypedOperatorHandle<Streamed> int4, int8g;
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Optional&,
                            int64_t);
  c10::TypedOperatorHandle<Linear> int4_f32, int4_bf16, tiles;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul, gelu_tanh_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      at::Tensor, at::Tensor, const at::Tensor&, int64_t, double,
                                      int64_t)>
      step;

  static const Ops& get() {
    static const Ops ops{};
    return ops;
  }

 private:
  Ops()
      : int4(handle("int4_linear_a8").typed<Streamed>()),
        int8g(handle("int8g_linear_a8").typed<Streamed>()),
        int4_f32(handle("int4_linear_f32").typed<Linear>()),
        int4_bf16(handle("int4_linear").typed<Linear>()),
        tiles(handle("bf16_tiles_linear").typed<Linear>()),
        norm(handle("rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>()),
        silu_mul(handle("silu_mul").typed<at::Tensor(const at::Tensor&)>()),
        gelu_tanh_mul(handle("gelu_tanh_mul").typed<at::Tensor(const at::Tensor&)>()),
        step(handle("decode_step")
                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   at::Tensor, at::Tensor, const at::Tensor&, int64_t, double,
                                   int64_t)>()) {}

  static c10::OperatorHandle handle(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(
        (std::string("batchline::") + name).c_str(), "");
  }
};

struct Product {
  int64_t layout;
  at::Tensor packed;
  int64_t n;
  Optional bias;
  int64_t extra;  // the op's last argument
};

// A product's one-row form (a layout-0 or -1 op on one float32 row): its weight's geometry,
// the path its op takes for one row, and how the row is quantized for it.
struct RowProduct {
  const uint8_t* packed = nullptr;
  const float* bias = nullptr;
  int64_t block_bytes = 0, groups = 0, tiles = 0, n = 0, width = 0, streams = 1;
  bool paired = false;  // the int4 layouts' 512-bit operand order

  int64_t inputs() const { return groups * batchline_quant::kGroup; }

  // Thread tid's tiles of `threads`, as at::parallel_for splits them for the op
  std::pair<int64_t, int64_t> share(int64_t tid, int64_t threads) const {
    const int64_t grain = batchline_quant::tiles_per_share(groups * block_bytes);
    const int64_t used = std::min(threads, (tiles + grain - 1) / grain);
    if (tid >= used) return {tiles, tiles};
    const int64_t chunk = (tiles + used - 1) / used;
    const int64_t t0 = std::min(tiles, tid * chunk);
    return {t0, std::min(tiles, t0 + chunk)};
  }

  // Thread tid's columns of the product of the row quantized into x, into out
  std::pair<int64_t, int64_t> run(const batchline_rows::RowCodes& x, int64_t tid,
                                  int64_t threads, float* out) const {
    const auto [t0, t1] = share(tid, threads);
    if (t0 < t1) {
      batchline_rows::one_row_tiles(packed, block_bytes, groups, x, bias, n, width, streams, t0,
                                    t1, out);
    }
    return {t0 * batchline_quant::kTile, std::min(n, t1 * batchline_quant::kTile)};
  }
};

struct Layer {
  int64_t index;
  bool gelu;
  at::Tensor input_norm, mlp_norm;
  Product products[kProducts];
  RowProduct rows[kProducts];  // where one row takes one region
};

// One thread's buffers for a one-row step: the row it norms or activates, and its int8 form.
struct RowScratch {
  RowScratch(int64_t threads, int64_t widest)
      : widest_(widest),
        values_(threads * widest),
        codes_(threads * widest),
        floats_(threads * 2 * (widest / batchline_quant::kGroup)),
        sums_(threads * (widest / batchline_quant::kGroup)) {}

  float* values(int64_t tid) { return values_.data() + tid * widest_; }
  batchline_rows::RowCodes codes(int64_t tid) {
    const int64_t groups = widest_ / batchline_quant::kGroup;
    float* floats = floats_.data() + tid * 2 * groups;
    return {codes_.data() + tid * widest_, floats, sums_.data() + tid * groups, floats + groups};
  }

 private:
  int64_t widest_;
  std::vector<float> values_;
  std::vector<int8_t> codes_;
  std::vector<float> floats_;
  std::vector<int32_t> sums_;
};

struct DecodeLayers : torch::CustomClassHolder {
  DecodeLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> packed,
               std::vector<at::Tensor> biases, std::vector<int64_t> spec, double eps,
               double scale, int64_t heads, int64_t wide_rows, int64_t a8_width,
               int64_t a8_bf16_rows)
      : eps_(eps),
        scale_(scale),
        heads_(heads),
        wide_rows_(wide_rows),
        a8_width_(a8_width),
        a8_bf16_rows_(a8_bf16_rows) {
    const int64_t count = static_cast<int64_t>(spec.size()) / kSpecLayer;
    TORCH_CHECK(count * kSpecLayer == static_cast<int64_t>(spec.size()) &&
                    static_cast<int64_t>(norms.size()) == 2 * count &&
                    static_cast<int64_t>(packed.size()) == kProducts * count &&
                    biases.size() == packed.size(),
                "DecodeLayers: per layer two norms, four products, four biases and ", kSpecLayer,
                " spec values");
    for (int64_t l = 0; l < count; ++l) {
      const int64_t* s = spec.data() + l * kSpecLayer;
      TORCH_CHECK(s[1] == 0 || s[1] == 1, "DecodeLayers: activation 0 (SiLU) or 1 (GeLU tanh)");
      Layer layer{s[0], s[1] == 1, norms[2 * l], norms[2 * l + 1], {}};
      for (int64_t p = 0; p < kProducts; ++p) {
        const int64_t* q = s + kSpecHead + p * kSpecProduct;
        TORCH_CHECK(q[0] >= kInt4A8 && q[0] <= kInt4Bf16A8, "DecodeLayers: op ", q[0],
                    " is none of 0-5 (decode_kernel.StepProduct's layouts)");
        const at::Tensor& bias = biases[kProducts * l + p];
        layer.products[p] = Product{q[0], packed[kProducts * l + p], q[1],
                                    bias.numel() ? Optional(bias) : std::nullopt, q[2]};
      }
      layers_.push_back(std::move(layer));
    }
    one_row_ = takes_one_row();
  }

  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const at::Tensor& first, int64_t hi) const {
    TORCH_CHECK(h.dim() == 2, "DecodeLayers.forward: h must be (rows, hidden)");
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.index < static_cast<int64_t>(keys.size()) &&
                      layer.index < static_cast<int64_t>(values.size()),
                  "DecodeLayers.forward: no store buffers for layer ", layer.index);
    }
    if (one_row() && h.size(0) == 1 && h.size(1) == hidden_ && h.scalar_type() == at::kFloat &&
        !at::in_parallel_region() && attention_fits(cos, sin, keys, values, first, hi)) {
      return forward_one_row(h, cos, sin, keys, values, first, hi);
    }
    const Ops& ops = Ops::get();
    for (const Layer& layer : layers_) {
      at::Tensor x = ops.norm.call(h, layer.input_norm, eps_);
      const at::Tensor qkv = product(ops, layer.products[0], x);
      const at::Tensor attended = ops.step.call(qkv, cos, sin, keys[layer.index],
                                                values[layer.index], first, hi, scale_, heads_);
      h = product(ops, layer.products[1], attended).add_(h);  // h + out, the same sums
      x = ops.norm.call(h, layer.mlp_norm, eps_);
      const at::Tensor gate_up = product(ops, layer.products[2], x);
      const at::Tensor act =
          layer.gelu ? ops.gelu_tanh_mul.call(gate_up) : ops.silu_mul.call(gate_up);
      h = product(ops, layer.products[3], act).add_(h);
    }
    return h;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  bool one_row() const { return one_row_ && use_one_row_; }
  bool use_one_row(bool on) {
    use_one_row_ = on;
    return one_row();
  }

 private:
  // Whether one float32 row can take one region: a build with the VNNI path, every
  // product an int8-rows one of a shape that chains (hidden -> q/k/v, attention -> hidden,
  // hidden -> 2 x intermediate -> hidden), float32 norms. Fills each layer's RowProducts.
  bool takes_one_row() {
    if (!batchline_rows::one_row_built() || a8_width_ != 512 || layers_.empty()) return false;
    hidden_ = layers_[0].input_norm.numel();
    widest_ = 0;
    for (Layer& layer : layers_) {
      for (const at::Tensor* norm : {&layer.input_norm, &layer.mlp_norm}) {
        if (norm->scalar_type() != at::kFloat || norm->dim() != 1 || !norm->is_contiguous() ||
            norm->numel() != hidden_) {
          return false;
        }
      }
      for (int64_t p = 0; p < kProducts; ++p) {
        const Product& product = layer.products[p];
        const at::Tensor& w = product.packed;
        const bool int8g = product.layout == kInt8gA8;
        if ((product.layout != kInt4A8 && !int8g) || w.dim() != 3 ||
            w.scalar_type() != at::kByte || !w.is_contiguous()) {
          return false;
        }
        const int64_t block = w.size(2);
        if (int8g ? block != batchline_quant::kBlockInt8 : !batchline_quant::int4_block(block)) {
          return false;
        }
        if (product.n <= (w.size(0) - 1) * batchline_quant::kTile ||
            product.n > w.size(0) * batchline_quant::kTile) {
          return false;
        }
        if (product.bias.has_value() &&
            (product.bias->scalar_type() != at::kFloat || !product.bias->is_contiguous() ||
             product.bias->numel() != product.n)) {
          return false;
        }
        RowProduct& row = layer.rows[p];
        row.packed = w.data_ptr<uint8_t>();
        row.bias = product.bias.has_value() ? product.bias->data_ptr<float>() : nullptr;
        row.block_bytes = block;
        row.groups = w.size(1);
        row.tiles = w.size(0);
        row.n = product.n;
        row.streams = product.extra;
        row.width = int8g ? int8g_width(1, product.extra) : a8_width_;
        row.paired = !int8g;
        if (row.streams != 1 && row.streams != 2 && row.streams != 4 && row.streams != 8) {
          return false;
        }
        widest_ = std::max(widest_, row.inputs());
      }
      const RowProduct* r = layer.rows;
      if (r[0].inputs() != hidden_ || r[1].n != hidden_ || r[2].inputs() != hidden_ ||
          r[2].n != 2 * r[3].inputs() || r[3].n != hidden_) {
        return false;
      }
      qkv_widest_ = std::max(qkv_widest_, r[0].n);
      attention_widest_ = std::max(attention_widest_, r[1].inputs());
      gate_up_widest_ = std::max(gate_up_widest_, r[2].n);
    }
    return true;
  }

  // Whether the attention's arguments are ones decode_step takes for one float32 row (the
  // one-row path runs its code on them unchecked); else that row goes op by op, whose checks
  // say what is wrong.
  bool attention_fits(const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const at::Tensor& first, int64_t hi) const {
    const bool tables = cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == 1 &&
                        cos.size(1) == 1 && cos.size(2) % 2 == 0 &&
                        cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat;
    if (!tables || first.scalar_type() != at::kLong || first.dim() != 1 || first.size(0) != 1) {
      return false;
    }
    const int64_t start = *first.data_ptr<int64_t>();
    if (hi < 0 || start < 0 || start > hi) return false;
    for (const Layer& layer : layers_) {
      const at::Tensor& k = keys[layer.index];
      const at::Tensor& v = values[layer.index];
      if (k.dim() != 4 || v.sizes() != k.sizes() || !k.is_contiguous() || !v.is_contiguous() ||
          k.scalar_type() != at::kFloat || v.scalar_type() != at::kFloat || k.size(0) < 1 ||
          hi >= k.size(2) || cos.size(2) > k.size(3)) {
        return false;
      }
      const int64_t kv_heads = k.size(1), dim = k.size(3);
      if (kv_heads < 1 || heads_ % kv_heads != 0 ||
          layer.rows[0].n != (heads_ + 2 * kv_heads) * dim ||
          layer.rows[1].inputs() != heads_ * dim) {
        return false;
      }
    }
    return true;
  }

  // forward for one float32 row in one parallel region (the header says how)
  at::Tensor forward_one_row(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin,
                             const std::vector<at::Tensor>& keys,
                             const std::vector<at::Tensor>& values, const at::Tensor& first,
                             int64_t hi) const {
    at::Tensor h = h_in.clone(at::MemoryFormat::Contiguous);
    float* hp = h.data_ptr<float>();
    const int64_t threads = std::max(1, at::get_num_threads());
    RowScratch scratch(threads, widest_);
    // the row's products: o and down, gate/up, q/k/v; the rotated queries; the attention
    std::vector<float> buffers(hidden_ + gate_up_widest_ + qkv_widest_ + 2 * attention_widest_);
    float* out = buffers.data();
    float* gate_up = out + hidden_;
    float* qkv = gate_up + gate_up_widest_;
    float* queries = qkv + qkv_widest_;
    float* attended = queries + attention_widest_;
    const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
    const float* cp = c.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    const int64_t r = c.size(2), start = *first.data_ptr<int64_t>();
    std::vector<float*> key_store, value_store;
    for (const Layer& layer : layers_) {
      key_store.push_back(keys[layer.index].data_ptr<float>());
      value_store.push_back(values[layer.index].data_ptr<float>());
    }
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);

    // the residual onto this thread's columns of a product: out + h, as add_ sums them
    auto add_columns = [&](std::pair<int64_t, int64_t> cols) {
      for (int64_t c = cols.first; c < cols.second; ++c) hp[c] = out[c] + hp[c];
    };
    // a layer's front: its input norm, and its q/k/v product's share
    auto front = [&](const Layer& layer, int64_t tid, int64_t team) {
      float* x = scratch.values(tid);
      const batchline_rows::RowCodes codes = scratch.codes(tid);
      batchline_rows::rms_norm_row(hp, layer.input_norm.data_ptr<float>(), hidden_, eps, x);
      batchline_rows::quantize_one_row(x, hidden_, layer.rows[0].paired, codes);
      layer.rows[0].run(codes, tid, team, qkv);
    };

#pragma omp parallel num_threads(threads)
    {
      // the work split among the threads the region has (as many as asked, unless the OpenMP
      // runtime gives fewer)
      const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
      float* x = scratch.values(tid);
      const batchline_rows::RowCodes codes = scratch.codes(tid);
      front(layers_[0], tid, team);
      for (size_t l = 0; l < layers_.size(); ++l) {
        const Layer& layer = layers_[l];
        const RowProduct* rows = layer.rows;
        const at::Tensor& store = keys[layer.index];
        const int64_t kv_heads = store.size(1), capacity = store.size(2), dim = store.size(3);
        // the KV heads split evenly: the threads are awake, none to wake for a short context
        const int64_t each = (kv_heads + team - 1) / team;
        const int64_t h0 = std::min(kv_heads, tid * each), h1 = std::min(kv_heads, h0 + each);
#pragma omp barrier
        batchline_rows::attend_row_heads(qkv, cp, sp, r, key_store[l], value_store[l], kv_heads,
                                         capacity, dim, heads_, start, hi, scale, h0, h1,
                                         queries, attended);
#pragma omp barrier
        batchline_rows::quantize_one_row(attended, rows[1].inputs(), rows[1].paired, codes);
        add_columns(rows[1].run(codes, tid, team, out));
#pragma omp barrier
        batchline_rows::rms_norm_row(hp, layer.mlp_norm.data_ptr<float>(), hidden_, eps, x);
        batchline_rows::quantize_one_row(x, hidden_, rows[2].paired, codes);
        rows[2].run(codes, tid, team, gate_up);
#pragma omp barrier
        batchline_rows::act_mul_row(gate_up, rows[3].inputs(), layer.gelu, x);
        batchline_rows::quantize_one_row(x, rows[3].inputs(), rows[3].paired, codes);
        add_columns(rows[3].run(codes, tid, team, out));
        if (l + 1 < layers_.size()) {
#pragma omp barrier
          front(layers_[l + 1], tid, team);
        }
      }
    }
    return h;
  }

  at::Tensor product(const Ops& ops, const Product& p, const at::Tensor& x) const {
    switch (p.layout) {
      case kInt4A8:
        return ops.int4.call(x, p.packed, p.n, p.bias, a8_width_, p.extra);
      case kInt8gA8:
        return ops.int8g.call(x, p.packed, p.n, p.bias, int8g_width(x.size(0), p.extra), p.extra);
      case kTiles:
        return ops.tiles.call(x, p.packed, p.n, p.bias, p.extra);
      case kInt4F32:
        return ops.int4_f32.call(x, p.packed, p.n, p.bias, p.extra);
      case kInt4Bf16A8:  // a few bf16 rows summed as int8, more on AMX tiles
        if (x.size(0) < a8_bf16_rows_) {
          return ops.int4.call(x, p.packed, p.n, p.bias, a8_width_, p.extra);
        }
        return ops.int4_bf16.call(x, p.packed, p.n, p.bias, a8_bf16_rows_);
      default:
        return ops.int4_bf16.call(x, p.packed, p.n, p.bias, p.extra);
    }
  }

  double eps_, scale_;
  // quant_kernel.int8g_width's choice: the wide path from wide_rows_ rows, and for one row read
  // several tiles at a time (the narrow path reads one)
  int64_t int8g_width(int64_t rows, int64_t streams) const {
    return rows >= wide_rows_ || (rows == 1 && streams > 1) ? a8_width_ : 256;
  }

  int64_t heads_, wide_rows_, a8_width_, a8_bf16_rows_;
  std::vector<Layer> layers_;
  bool one_row_ = false, use_one_row_ = true;
  // the one-row path's widths: the row's, the widest product input, q/k/v and gate/up outputs,
  // o inputs (the attention's)
  int64_t hidden_ = 0, widest_ = 0, qkv_widest_ = 0, gate_up_widest_ = 0, attention_widest_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, double, double, int64_t, int64_t, int64_t,
                       int64_t>())
      .def("forward", &DecodeLayers::forward)
      .def("size", &DecodeLayers::size)
      .def("one_row", &DecodeLayers::one_row)
      .def("use_one_row", &DecodeLayers::use_one_row);
}
