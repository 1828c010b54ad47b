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
// Built by batchline.models.generation.decode_kernel with the machine's C++ compiler.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

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

struct Layer {
  int64_t index;
  bool gelu;
  at::Tensor input_norm, mlp_norm;
  Product products[kProducts];
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
  }

  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const at::Tensor& first, int64_t hi) const {
    TORCH_CHECK(h.dim() == 2, "DecodeLayers.forward: h must be (rows, hidden)");
    const Ops& ops = Ops::get();
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.index < static_cast<int64_t>(keys.size()) &&
                      layer.index < static_cast<int64_t>(values.size()),
                  "DecodeLayers.forward: no store buffers for layer ", layer.index);
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

 private:
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
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchline, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, double, double, int64_t, int64_t, int64_t,
                       int64_t>())
      .def("forward", &DecodeLayers::forward)
      .def("size", &DecodeLayers::size);
}
