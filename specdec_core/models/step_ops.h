// The static step's glue between its linear layers, fused (static_runner.decoder_pass, step_ops.py).
//
// At one token a layer's norms, rotary embedding and cache writes are about twenty ATen ops of a few
// microseconds each, on a few thousand numbers: 28 layers of them were a tenth of the 1.5B's step
// (docs/benchmarks/qwen2.5-coder-1.5b-int4-step-profile). Each op here does one of those chains in one
// call, and computes exactly what transformers' modules compute, bit for bit: every product and sum
// is rounded to the activation dtype where torch's would be, and the one reduction (the norm's mean)
// is ATen's own, whose order of additions the modules' numbers depend on. So the static step stays the
// eager step's numbers, and a row's result stays independent of the pass.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>

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

template <typename T>
void add_rms_norm_impl(const torch::Tensor& hidden, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       torch::Tensor& out_hidden, torch::Tensor& normed) {
  const int64_t size = weight.numel(), rows = hidden.numel() / size;
  const T* h = hidden.data_ptr<T>();
  const T* d = delta.defined() ? delta.data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* x = out_hidden.data_ptr<T>();
  torch::Tensor squares = torch::empty(hidden.sizes(), hidden.options().dtype(torch::kFloat));
  float* sq = squares.data_ptr<float>();
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * size; i < end * size; ++i) {
      if (d) x[i] = sum(h[i], d[i]);  // the residual add, hidden + delta
      sq[i] = wide(x[i]) * wide(x[i]);  // pow(2) of the float32 copy
    }
  });
  const torch::Tensor variance = squares.mean(-1, true);  // ATen's reduction, as the module's
  const float* var = variance.data_ptr<float>();
  T* out = normed.data_ptr<T>();
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float inverse = 1.f / std::sqrt(var[row] + static_cast<float>(eps));  // torch.rsqrt
      for (int64_t i = 0; i < size; ++i) out[row * size + i] = product(w[i], static_cast<T>(wide(x[row * size + i]) * inverse));
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

}  // namespace

// (hidden + delta, RMSNorm(hidden + delta) * weight), or with no delta (hidden, RMSNorm(hidden) * weight):
// a decoder layer's residual add and the norm after it (LlamaRMSNorm / Qwen2RMSNorm), all of hidden's dtype.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& hidden, const c10::optional<torch::Tensor>& delta,
                                                      const torch::Tensor& weight, double eps) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("add_rms_norm", &add_rms_norm, "a residual add and the RMSNorm after it, as transformers computes them");
  module.def("rotate_and_cache", &rotate_and_cache, "rotary embedding of q and k, and k and v written to the cache at their slots");
}
