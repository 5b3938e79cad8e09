// Row-invariant attention (attention.py): each query row against its own list of key slots.
//
// One task per (query row, key head). The scores are dot products with 16 float lanes summed in a
// fixed tree, the softmax and the weighted sum of values run over the row's slots in their order, and
// a task is computed whole by one thread. So a row's output depends only on its query, its keys and
// values in token order, and nothing else: not the pass length, the other rows, the slot layout or the
// thread count. Inputs are float32 or bfloat16; the arithmetic is float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;

#if defined(__AVX2__) && defined(__FMA__)
// The loops below in AVX2 registers, where the build has AVX2: the same additions and fused multiply-adds
// in the same order, lane by lane (GCC had vectorized the dot products' lanes but summed their tree one
// number at a time through memory, and kept the weighted sum's outputs in memory).
constexpr int VECTOR = 8, VALUE_REGISTERS = 8;  // floats per register; output dims kept in registers per pass over the slots

inline __m256 load8(const float* in) { return _mm256_loadu_ps(in); }
inline __m256 load8(const at::BFloat16* in) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bf16 is float32's high half
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();  // lanes 0-7 and 8-15
  for (; j + LANES <= dim; j += LANES) {
    low = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), low);
    high = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + VECTOR), load8(k + j + VECTOR), high);
  }
  float tail = 0.f;
  for (; j < dim; ++j) tail += q[j] * static_cast<float>(k[j]);
  const __m256 eight = _mm256_add_ps(low, high);  // the tree: lane l += lane l + 8, + 4, + 2, + 1
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two))) + tail;
#else
  float lanes[LANES] = {};
  for (; j + LANES <= dim; j += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] += q[j + l] * static_cast<float>(k[j + l]);
  float tail = 0.f;
  for (; j < dim; ++j) tail += q[j] * static_cast<float>(k[j]);
  for (int width = LANES / 2; width; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0] + tail;
#endif
}

// a[t] += weights[j] * value_j[t] for j in order, value_j the row at value(j).
template <typename T, typename Value>
void weighted_sum(const float* weights, int64_t n, Value value, int64_t dim, float* a) {
  int64_t from = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; from + VECTOR * VALUE_REGISTERS <= dim; from += VECTOR * VALUE_REGISTERS) {
    __m256 sums[VALUE_REGISTERS];
    for (int r = 0; r < VALUE_REGISTERS; ++r) sums[r] = _mm256_loadu_ps(a + from + VECTOR * r);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(weights[j]);
      const T* v = value(j) + from;
      for (int r = 0; r < VALUE_REGISTERS; ++r) sums[r] = _mm256_fmadd_ps(w, load8(v + VECTOR * r), sums[r]);
    }
    for (int r = 0; r < VALUE_REGISTERS; ++r) _mm256_storeu_ps(a + from + VECTOR * r, sums[r]);
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* v = value(j);
    for (int64_t t = from; t < dim; ++t) a[t] += weights[j] * static_cast<float>(v[t]);
  }
}

template <typename T>
void attend_rows(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                 const int64_t* slots, const int64_t* offsets, double scaling, torch::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), groups = heads / kv_heads;
  const T* q_data = query.data_ptr<T>();
  const T* k_data = key.data_ptr<T>();
  const T* v_data = value.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides();
  at::parallel_for(0, batch * length * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), acc(groups * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, h = task % kv_heads, b = row / length, i = row % length;
      const int64_t first = offsets[row], n = offsets[row + 1] - first;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t t = 0; t < dim; ++t)
          q[g * dim + t] = static_cast<float>(q_data[b * qs[0] + (h * groups + g) * qs[1] + i * qs[2] + t * qs[3]]) * scaling;
      scores.assign(groups * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const T* k = k_data + b * ks[0] + h * ks[1] + slots[first + j] * ks[2];
        for (int64_t g = 0; g < groups; ++g) scores[g * n + j] = dot(&q[g * dim], k, dim);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        float* s = &scores[g * n];
        const float top = n ? *std::max_element(s, s + n) : 0.f;
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - top));
        for (int64_t j = 0; j < n; ++j) s[j] /= total;  // the weights
        const auto value = [&](int64_t j) { return v_data + b * vs[0] + h * vs[1] + slots[first + j] * vs[2]; };
        float* a = &acc[g * dim];
        weighted_sum<T>(s, n, value, dim, a);
        T* o = out_data + ((b * length + i) * heads + h * groups + g) * dim;
        for (int64_t t = 0; t < dim; ++t) o[t] = static_cast<T>(a[t]);
      }
    }
  });
}

}  // namespace

// query [B, H, k, d]; key, value [B, Hkv, S, d] (last dim contiguous); row (b, i)'s slots are
// slots[offsets[b * k + i] : offsets[b * k + i + 1]], in token order. Returns [B, k, H, d].
torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor slots,
                     torch::Tensor offsets, double scaling) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key and value must be 4-D");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(offsets.numel() == query.size(0) * query.size(2) + 1, "one offset per query row, plus one");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "a CPU kernel");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(3),
              "key and value must be [B, Hkv, S, d] for query [B, H, k, d]");
  TORCH_CHECK(offsets[-1].item<int64_t>() == slots.numel(), "the offsets must end at the number of slots");
  TORCH_CHECK(slots.numel() == 0 || (slots.min().item<int64_t>() >= 0 && slots.max().item<int64_t>() < key.size(2)),
              "a slot outside the keys");
  key = key.stride(3) == 1 ? key : key.contiguous();
  value = value.stride(3) == 1 ? value : value.contiguous();
  slots = slots.to(torch::kLong).contiguous();
  offsets = offsets.to(torch::kLong).contiguous();
  auto out = torch::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == torch::kBFloat16)
    attend_rows<at::BFloat16>(query, key, value, slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), scaling, out);
  else if (query.scalar_type() == torch::kFloat)
    attend_rows<float>(query, key, value, slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), scaling, out);
  else
    TORCH_CHECK(false, "row-invariant attention takes float32 or bfloat16, not ", query.scalar_type());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attend", &attend, "row-invariant attention over per-row slot lists"); }
