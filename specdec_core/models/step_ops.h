// The static step's work between and around its linear layers, fused (static_runner.decoder_pass, step_ops.py),
// for every ISA family's kernel: quant_kernel.h includes this file, so the ops are in the family's extension
// and a layer's halves below call its quantized product directly.
//
// At one token a layer's norms, rotary embedding and cache writes are about twenty ATen ops of a few
// microseconds each, on a few thousand numbers: 28 layers of them were a tenth of the 1.5B's step
// (docs/benchmarks/qwen2.5-coder-1.5b-int4-step-profile). Each op here does one of those chains in one
// call, and computes exactly what transformers' modules compute, bit for bit: every product and sum
// is rounded to the activation dtype where torch's would be, and the one reduction (the norm's mean)
// is ATen's own, whose order of additions the modules' numbers depend on. So the static step stays the
// eager step's numbers, and a row's result stays independent of the pass. The families are compiled with
// -ffp-contract=off, so that no product and sum here is fused into one rounding that torch does in two.
//
// `KernelLayer` goes further: a decoder layer on our kernel in two calls, around its attention (which stays
// the caller's: the row-invariant kernel or SDPA). Each half is the modules' ops in their order, on the same
// kernels (the quantized product, ATen's bias add, SiLU and product), so its numbers are the modules' too;
// what it saves is Python: a one-token step crossed it about fifteen times per layer.
#pragma once
#include <torch/extension.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
float wide(T value) { return static_cast<float>(value); }

// T(a op b) as torch rounds a binary op of two T tensors: computed in float, rounded once.
template <typename T>
T product(T a, T b) { return static_cast<T>(wide(a) * wide(b)); }
template <typename T>
T sum(T a, T b) { return static_cast<T>(wide(a) + wide(b)); }

// Rows per thread's share: a decode pass's few rows stay on the calling thread, a prefill's spread.
int64_t grain(int64_t numbers_per_row) { return std::max<int64_t>(1, 32768 / numbers_per_row); }

// x rounded to T and back to float, in registers' worth: through T's own store, as torch rounds each op's output.
template <typename T>
typename Simd::F rounded(typename Simd::F x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T lanes[Simd::kLanes];
    Simd::store(lanes, x);
    return Simd::load(lanes);
  }
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& hidden, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       torch::Tensor& out_hidden, torch::Tensor& normed) {
  const int64_t size = weight.numel(), rows = hidden.numel() / size, vectors = size / Simd::kLanes * Simd::kLanes;
  const T* h = hidden.data_ptr<T>();
  const T* d = delta.defined() ? delta.data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* x = out_hidden.data_ptr<T>();
  torch::Tensor squares = torch::empty(hidden.sizes(), hidden.options().dtype(torch::kFloat));
  float* sq = squares.data_ptr<float>();
  // Each row in registers (the kernel family's Simd: the same float ops and roundings), then the scalar tail.
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t at = row * size;
      for (int64_t i = at; i < at + vectors; i += Simd::kLanes) {
        typename Simd::F value = Simd::load(h + i);
        if (d) value = rounded<T>(Simd::add(value, Simd::load(d + i)));  // the residual add, hidden + delta
        Simd::store(x + i, value);
        Simd::store(sq + i, Simd::mul(value, value));  // pow(2) of the float32 copy
      }
      for (int64_t i = at + vectors; i < at + size; ++i) {
        if (d) x[i] = sum(h[i], d[i]);
        sq[i] = wide(x[i]) * wide(x[i]);
      }
    }
  });
  const torch::Tensor variance = squares.mean(-1, true);  // ATen's reduction, as the module's
  const float* var = variance.data_ptr<float>();
  T* out = normed.data_ptr<T>();
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float inverse = 1.f / std::sqrt(var[row] + static_cast<float>(eps));  // torch.rsqrt
      const int64_t at = row * size;
      for (int64_t i = 0; i < vectors; i += Simd::kLanes) {
        const typename Simd::F scaled = rounded<T>(Simd::mul(Simd::load(x + at + i), Simd::set1(inverse)));
        Simd::store(out + at + i, Simd::mul(Simd::load(w + i), scaled));
      }
      for (int64_t i = vectors; i < size; ++i) out[at + i] = product(w[i], static_cast<T>(wide(x[at + i]) * inverse));
    }
  });
}

template <typename T>
void rotate_and_cache_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                           const torch::Tensor& sin, torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& slots,
                           torch::Tensor& query) {
  const int64_t batch = q.size(0), tokens = q.size(1), dim = cos.size(-1), half = dim / 2;
  const int64_t heads = q.size(2) / dim, kv_heads = k.size(2) / dim;
  const auto* slot = slots.data_ptr<int64_t>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  // x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]): each product, then the sum, rounded.
  const auto rotate = [&](const T* in, const T* cs, const T* sn, T* out) {
    for (int64_t i = 0; i < dim; ++i) {
      const T turned = i < half ? static_cast<T>(-wide(in[i + half])) : in[i - half];
      out[i] = sum(product(in[i], cs[i]), product(turned, sn[i]));
    }
  };
  at::parallel_for(0, batch * tokens, grain((heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / tokens, t = row % tokens, position = slot[row];
      TORCH_CHECK(position >= 0 && position < keys.size(2), "slot ", position, " lies outside the cache's ", keys.size(2));
      const T* cs = c + row * dim;
      const T* sn = s + row * dim;
      const T* q_row = q.data_ptr<T>() + b * q.stride(0) + t * q.stride(1);
      const T* k_row = k.data_ptr<T>() + b * k.stride(0) + t * k.stride(1);
      const T* v_row = v.data_ptr<T>() + b * v.stride(0) + t * v.stride(1);
      for (int64_t h = 0; h < heads; ++h) rotate(q_row + h * dim, cs, sn, query.data_ptr<T>() + (row * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* key = keys.data_ptr<T>() + b * keys.stride(0) + h * keys.stride(1) + position * keys.stride(2);
        T* value = values.data_ptr<T>() + b * values.stride(0) + h * values.stride(1) + position * values.stride(2);
        rotate(k_row + h * dim, cs, sn, key);
        std::copy(v_row + h * dim, v_row + (h + 1) * dim, value);
      }
    }
  });
}

template <typename F>
void with_dtype(const torch::Tensor& like, F&& f) {
  if (like.scalar_type() == torch::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(like.scalar_type() == torch::kFloat, "the step's ops take bf16 or float32 activations, not ", like.scalar_type());
    f(float{});
  }
}

// (hidden + delta, RMSNorm(hidden + delta) * weight), or with no delta (hidden, RMSNorm(hidden) * weight):
// a decoder layer's residual add and the norm after it (LlamaRMSNorm / Qwen2RMSNorm), all of hidden's dtype.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& hidden, const c10::optional<torch::Tensor>& delta,
                                                      const torch::Tensor& weight, double eps) {
  RECORD_FUNCTION("add_rms_norm", std::vector<c10::IValue>());  // a part of step_profile's table, as each op below
  TORCH_CHECK(hidden.is_contiguous() && weight.is_contiguous() && hidden.size(-1) == weight.numel(), "hidden [..., H] and weight [H], contiguous");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), "weight and hidden must share a dtype");
  const torch::Tensor d = delta.has_value() ? delta->contiguous() : torch::Tensor();
  TORCH_CHECK(!d.defined() || (d.sizes() == hidden.sizes() && d.scalar_type() == hidden.scalar_type()), "delta must be hidden's shape and dtype");
  torch::Tensor out_hidden = d.defined() ? torch::empty_like(hidden) : hidden, normed = torch::empty_like(hidden);
  with_dtype(hidden, [&](auto type) { add_rms_norm_impl<decltype(type)>(hidden, d, weight, eps, out_hidden, normed); });
  return {out_hidden, normed};
}

// q, k, v [B, k, heads * D] (rows may be strided, as a fused projection's split leaves them) rotated as
// transformers' apply_rotary_pos_emb does with cos and sin [B, k, D]; the rotated k and v written to
// keys and values [B, Hkv, S, D] at slots [B, k]. Returns the rotated q as [B, heads, k, D], laid out
// [B, k, heads, D] in memory as the modules' transposed view of it is.
torch::Tensor rotate_and_cache(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                               const torch::Tensor& sin, torch::Tensor keys, torch::Tensor values, const torch::Tensor& slots) {
  RECORD_FUNCTION("rotate_and_cache", std::vector<c10::IValue>());
  const int64_t dim = cos.size(-1);
  for (const torch::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) % dim == 0 && t->scalar_type() == q.scalar_type(),
                "q, k and v must be [B, k, heads * D] with contiguous rows, of one dtype");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == q.scalar_type() && cos.numel() == q.size(0) * q.size(1) * dim,
              "cos and sin must be contiguous [B, k, D] of q's dtype");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(3) == dim && keys.scalar_type() == q.scalar_type(),
              "keys and values must be [B, Hkv, S, D] with contiguous rows, of q's dtype");
  const torch::Tensor slot = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(slot.numel() == q.size(0) * q.size(1), "slots must be [B, k]");
  torch::Tensor query = torch::empty({q.size(0), q.size(1), q.size(2) / dim, dim}, q.options());
  with_dtype(q, [&](auto type) { rotate_and_cache_impl<decltype(type)>(q, k, v, cos, sin, keys, values, slot, query); });
  return query.transpose(1, 2);
}

// y = x @ W.T (+ bias) on the quantized product, as VnniLinear computes it: x [..., K] -> [..., N] in x's dtype,
// the bias added by ATen in that dtype afterwards (a second rounding, as the module's `out + bias` does). A projection
// of layers in several formats (quant.FusedLinear) has a run of each, their outputs side by side.
struct QuantizedProjection {
  const char* name;  // the module's, as step_profile labels it
  std::vector<torch::Tensor> packed, scale_min;
  std::vector<c10::optional<torch::Tensor>> bias;

  torch::Tensor operator()(const torch::Tensor& x, bool tiles) const {
    RECORD_FUNCTION(name, std::vector<c10::IValue>());
    const torch::Tensor rows = x.reshape({-1, inputs_of(packed[0])}).contiguous();
    std::vector<torch::Tensor> runs;
    for (size_t run = 0; run < packed.size(); ++run) {
      torch::Tensor y = quantized_mm(rows, packed[run], scale_min[run], tiles);
      runs.push_back(bias[run].has_value() ? y + *bias[run] : y);
    }
    torch::Tensor y = runs.size() == 1 ? runs[0] : torch::cat(runs, -1);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = y.size(-1);
    return y.view(shape);
  }
};

// A Llama-family decoder layer (pre-norm attention, then a gated SiLU MLP) whose seven projections are on our
// kernel, q/k/v and gate/up each fused into one product (quant.fuse), in the two halves around its attention.
struct KernelLayer {
  torch::Tensor input_norm;
  QuantizedProjection qkv;
  std::vector<int64_t> qkv_sizes;  // q's, k's and v's outputs
  QuantizedProjection o;
  torch::Tensor post_norm;
  QuantizedProjection gate_up, down;
  double eps;

  // hidden [B, k, H] plus the last layer's MLP output `delta` (none before the first layer), normed, projected
  // to q, k and v, rotated by cos and sin [B, k, D], k and v written to keys and values [B, Hkv, S, D] at
  // slots [B, k]. Returns (hidden + delta, the rotated queries [B, heads, k, D]) for the attention.
  std::tuple<torch::Tensor, torch::Tensor> attention_in(const torch::Tensor& hidden, const c10::optional<torch::Tensor>& delta,
                                                        const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor keys,
                                                        torch::Tensor values, const torch::Tensor& slots, bool tiles) const {
    auto [summed, x] = add_rms_norm(hidden, delta, input_norm, eps);
    const std::vector<torch::Tensor> parts = qkv(x, tiles).split_with_sizes(qkv_sizes, -1);
    return {summed, rotate_and_cache(parts[0], parts[1], parts[2], cos, sin, keys, values, slots)};
  }

  // The attention's output `attended` [B, k, heads, D] (any strides) through o_proj, added to hidden and normed,
  // then the MLP: down(silu(gate) * up). Returns (hidden + o_proj's output, the MLP's output).
  std::tuple<torch::Tensor, torch::Tensor> mlp(const torch::Tensor& hidden, const torch::Tensor& attended, bool tiles) const {
    auto [summed, x] = add_rms_norm(hidden, o(attended.reshape({hidden.size(0), hidden.size(1), -1}), tiles), post_norm, eps);
    const std::vector<torch::Tensor> halves = gate_up(x, tiles).chunk(2, -1);
    torch::Tensor activated;
    {
      RECORD_FUNCTION("act_fn", std::vector<c10::IValue>());
      activated = at::silu(halves[0]) * halves[1];
    }
    return {summed, down(activated, tiles)};
  }
};

using Tensors = std::vector<torch::Tensor>;
using Biases = std::vector<c10::optional<torch::Tensor>>;

KernelLayer kernel_layer(torch::Tensor input_norm, Tensors qkv_packed, Tensors qkv_scale_min, Biases qkv_bias,
                         std::vector<int64_t> qkv_sizes, Tensors o_packed, Tensors o_scale_min, Biases o_bias, torch::Tensor post_norm,
                         Tensors gate_up_packed, Tensors gate_up_scale_min, Biases gate_up_bias, Tensors down_packed,
                         Tensors down_scale_min, Biases down_bias, double eps) {
  int64_t gate_up_blocks = 0;
  for (const torch::Tensor& run : gate_up_packed) gate_up_blocks += run.size(0);
  TORCH_CHECK(gate_up_blocks % 2 == 0 && gate_up_blocks / 2 * kRows == inputs_of(down_packed[0]),
              "gate_up must be gate's and up's outputs side by side, each down's inputs");
  return {input_norm, {"qkv_proj", qkv_packed, qkv_scale_min, qkv_bias}, qkv_sizes, {"o_proj", o_packed, o_scale_min, o_bias},
          post_norm, {"gate_up_proj", gate_up_packed, gate_up_scale_min, gate_up_bias},
          {"down_proj", down_packed, down_scale_min, down_bias}, eps};
}

}  // namespace

#define STEP_OPS_MODULE(module)                                                                                        \
  module.def("add_rms_norm", &add_rms_norm, "a residual add and the RMSNorm after it, as transformers computes them");  \
  module.def("rotate_and_cache", &rotate_and_cache, "rotary embedding of q and k, and k and v written to the cache");   \
  pybind11::class_<KernelLayer>(module, "KernelLayer")                                                                \
      .def("attention_in", &KernelLayer::attention_in, "norm, q/k/v, rotary and the cache write: (hidden, queries)")   \
      .def("mlp", &KernelLayer::mlp, "o_proj, the residual add and norm, the MLP: (hidden, the MLP's output)");       \
  module.def("kernel_layer", &kernel_layer, "a decoder layer's weights for KernelLayer's two halves")
