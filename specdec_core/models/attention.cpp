// Row-invariant attention (attention.py): each query row against its own list of key slots.
//
// For each query row and key head, the scores are dot products with 16 float lanes summed in a fixed tree, and
// the softmax and the weighted sum of values run over the row's slots in their order, computed whole by one
// thread (one task per key head and block of up to 16 rows, which read the keys they share once). So a row's
// output depends only on its query, its keys and values in token order, and nothing else: not the pass length,
// the other rows, the slot layout or the thread count. Inputs are float32 or bfloat16; the arithmetic is
// float32. The softmax's exponentials are our own polynomial (exp_nonpositive), eight at a time, where the C
// library's took one at a time and were half the kernel's time; each key and value row is converted to floats
// once for all its query heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <xmmintrin.h>  // _mm_prefetch, on every x86-64

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include <atomic>

#include "amx_tiles.h"
#endif

namespace {

constexpr int LANES = 16;

#if defined(__AVX2__) && defined(__FMA__)
// The loops below in vector registers, where the build has AVX2 (or AVX-512): the same additions and fused
// multiply-adds in the same order, lane by lane (GCC had vectorized the dot products' lanes but summed their
// tree one number at a time through memory, and kept the weighted sum's outputs in memory).
constexpr int VECTOR = 8;  // floats per AVX2 register
constexpr int64_t kSweep = 6;  // query heads per key head whose sums stay in registers at once

// f(std::integral_constant<int, count>{}) for a count in 1..most: a run-time count as a compile-time one.
template <int most, typename F>
void with_count(int64_t count, F&& f) {
  if constexpr (most > 1) {
    if (count < most) return with_count<most - 1>(count, f);
  }
  f(std::integral_constant<int, most>{});
}

inline __m256 load8(const float* in) { return _mm256_loadu_ps(in); }
inline __m256 load8(const at::BFloat16* in) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bf16 is float32's high half
}

// Sixteen float lanes: one AVX-512 register where the build has AVX-512 (the attention kernel of the avx512
// family), else two AVX2 ones, lanes 0-7 and 8-15. Each lane's arithmetic is the same either way, so both
// builds compute the same bits (tests/test_attention.py) with half the instructions on AVX-512.
#if defined(__AVX512F__)
struct Sixteen {
  __m512 v;
  static Sixteen zero() { return {_mm512_setzero_ps()}; }
  static Sixteen broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Sixteen load(const float* in) { return {_mm512_loadu_ps(in)}; }
  static Sixteen load(const at::BFloat16* in) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  void store(float* out) const { _mm512_storeu_ps(out, v); }
  Sixteen fmadd(Sixteen a, Sixteen b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }  // this + a * b
  __m256 folded() const {  // lane l + lane l + 8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#else
struct Sixteen {
  __m256 low, high;
  static Sixteen zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Sixteen broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  template <typename T>
  static Sixteen load(const T* in) { return {load8(in), load8(in + VECTOR)}; }
  void store(float* out) const { _mm256_storeu_ps(out, low), _mm256_storeu_ps(out + VECTOR, high); }
  Sixteen fmadd(Sixteen a, Sixteen b) const { return {_mm256_fmadd_ps(a.low, b.low, low), _mm256_fmadd_ps(a.high, b.high, high)}; }
  __m256 folded() const { return _mm256_add_ps(low, high); }
};
#endif
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  Sixteen lanes = Sixteen::zero();
  for (; j + LANES <= dim; j += LANES) lanes = lanes.fmadd(Sixteen::load(q + j), Sixteen::load(k + j));
  float tail = 0.f;
  for (; j < dim; ++j) tail += q[j] * static_cast<float>(k[j]);
  const __m256 eight = lanes.folded();  // the tree: lane l += lane l + 8, + 4, + 2, + 1
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

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
constexpr int64_t kKeyBlock = 16;  // keys whose scores `dot_keys` computes at once

// The scores of one query row against kKeyBlock keys (converted, [kKeyBlock, dim], dim a multiple of 16): each is
// `dot`'s, bit for bit (the same fused multiply-adds per lane, and the tree's additions pair the same lanes), but
// the tree runs across the 16 sums at once by shuffles, where `dot` reduced each alone (a horizontal sum a key,
// most of a score's instructions), and the query is loaded once for all of them.
inline void dot_keys(const float* q, const float* keys, int64_t dim, float* out) {
  __m512 s[kKeyBlock];
  for (int p = 0; p < kKeyBlock; ++p) s[p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < dim; j += LANES) {
    const __m512 qj = _mm512_loadu_ps(q + j);
    for (int p = 0; p < kKeyBlock; ++p) s[p] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(keys + p * dim + j), s[p]);
  }
  // Lane l + lane l + 8: keys 2i and 2i + 1 in the halves of e[i].
  __m512 e[8];
  for (int i = 0; i < 8; ++i)
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + lane l + 4: keys 4i..4i + 3 in the quarters of f[i].
  __m512 f[4];
  for (int i = 0; i < 4; ++i)
    f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // + lane l + 2: quarter k of g[i] holds keys 8i + k (lanes 0-1) and 8i + 4 + k (lanes 2-3).
  __m512 g[2];
  for (int i = 0; i < 2; ++i)
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + lane l + 1: lane 4k + m holds key 4m + k's score; put them in key order. `dot` adds its tail, here 0.
  const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_permutexvar_ps(order, h), _mm512_setzero_ps()));
}
#else
constexpr int64_t kKeyBlock = 8;

// The same for AVX2, 8 keys: lanes l and l + 8 are two registers' lanes l, and the tree's other additions run
// across the 8 sums by shuffles, as above.
inline void dot_keys(const float* q, const float* keys, int64_t dim, float* out) {
  __m256 e[kKeyBlock];
  for (int p = 0; p < kKeyBlock; ++p) {
    Sixteen lanes = Sixteen::zero();
    for (int64_t j = 0; j < dim; j += LANES) lanes = lanes.fmadd(Sixteen::load(q + j), Sixteen::load(keys + p * dim + j));
    e[p] = lanes.folded();  // lane l + lane l + 8
  }
  // + lane l + 4: keys 2i and 2i + 1 in the halves of f[i].
  __m256 f[4];
  for (int i = 0; i < 4; ++i)
    f[i] = _mm256_add_ps(_mm256_permute2f128_ps(e[2 * i], e[2 * i + 1], 0x20), _mm256_permute2f128_ps(e[2 * i], e[2 * i + 1], 0x31));
  // + lane l + 2: half k of g[i] holds keys 4i + k (lanes 0-1) and 4i + 2 + k (lanes 2-3).
  __m256 g[2];
  for (int i = 0; i < 2; ++i)
    g[i] = _mm256_add_ps(_mm256_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(f[2 * i], f[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + lane l + 1: half k holds keys k, 2 + k, 4 + k, 6 + k; put them in key order. `dot` adds its tail, here 0.
  const __m256 h = _mm256_add_ps(_mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permutevar8x32_ps(h, order), _mm256_setzero_ps()));
}
#endif
#endif

// exp(x) for x <= 0 (a softmax's shifted scores), within about one ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by
// its Taylor polynomial to r^7 (the first term left out is below 4e-9 of it), times 2^n. Every operation is an
// exactly rounded one, so this scalar form and the vector form below give the same bits, lane by lane. Below
// -87 it gives exp(-87) (2^n must stay a normal float): beside the row's top score's 1, nothing.
constexpr float kExpFloor = -87.f, kLog2e = 1.44269504f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpTerms[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f};

inline float exp_nonpositive(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::nearbyint(x * kLog2e);
  const float r = std::fma(n, -kLn2Low, std::fma(n, -kLn2High, x));
  float p = kExpTerms[0];
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kExpTerms[i]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Low), _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2High), x));
  __m256 p = _mm256_set1_ps(kExpTerms[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTerms[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// The largest of s[0..n), n > 0 (the same value in any order: max is exact, and a zero's sign changes no
// exponential below).
inline float top_score(const float* s, int64_t n) {
  int64_t j = 0;
  float top = s[0];
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= VECTOR) {
    __m256 tops = _mm256_loadu_ps(s);
    for (j = VECTOR; j + VECTOR <= n; j += VECTOR) tops = _mm256_max_ps(tops, _mm256_loadu_ps(s + j));
    alignas(32) float lanes[VECTOR];
    _mm256_store_ps(lanes, tops);
    top = *std::max_element(lanes, lanes + VECTOR);
  }
#endif
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// s[j] = exp(s[j] - top) for j < n.
inline void exponentiate(float* s, int64_t n, float top) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; j + VECTOR <= n; j += VECTOR)
    _mm256_storeu_ps(s + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top))));
#endif
  for (; j < n; ++j) s[j] = exp_nonpositive(s[j] - top);
}

// Each of `count` rows of n scores, rows[i], to its softmax weights: exp(s - the row's top) over their sum, added
// in order of j. Several rows' sums run side by side: each is a chain of dependent additions, which alone waits
// on every addition's latency (a quarter of the kernel's time over 2,000 slots).
inline void softmax(float* const* rows, int64_t count, int64_t n) {
  if (n == 0) return;
  constexpr int64_t kChains = 8;
  for (int64_t i = 0; i < count; ++i) exponentiate(rows[i], n, top_score(rows[i], n));
  for (int64_t i0 = 0; i0 < count; i0 += kChains) {
    const int64_t chains = std::min(kChains, count - i0);
    float total[kChains] = {};
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < chains; ++i) total[i] += rows[i0 + i][j];
    for (int64_t i = 0; i < chains; ++i)
      for (int64_t j = 0; j < n; ++j) rows[i0 + i][j] /= total[i];  // the weights
  }
}

// acc[g][t] += weights[g][j] * value_j[t] for every group g < groups, j from `from_j` to `to_j` in order, value_j the
// row at value(j); weights[g] a group's weights by j, acc [groups, dim]. Each value row is converted to floats once
// for all the groups (query heads, of one or several query rows), which share it. Sums over consecutive ranges of
// j, one call each, are the sum over all of them in one call: acc goes through memory between them either way.
template <typename T, typename Value>
void weighted_sums(const float* const* weights, int64_t groups, int64_t from_j, int64_t to_j, Value value, int64_t dim,
                   float* acc) {
  int64_t from = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // 16 outputs of up to kSweep groups at a time, their sums in registers; each value row loaded once for them.
  for (; from + LANES <= dim; from += LANES) {
    for (int64_t g0 = 0; g0 < groups; g0 += kSweep) {
      with_count<kSweep>(std::min(kSweep, groups - g0), [&](auto count) {
        constexpr int G = decltype(count)::value;
        Sixteen sums[G];
        for (int g = 0; g < G; ++g) sums[g] = Sixteen::load(acc + (g0 + g) * dim + from);
        for (int64_t j = from_j; j < to_j; ++j) {
          const Sixteen v = Sixteen::load(value(j) + from);
          for (int g = 0; g < G; ++g) sums[g] = sums[g].fmadd(Sixteen::broadcast(weights[g0 + g][j]), v);
        }
        for (int g = 0; g < G; ++g) sums[g].store(acc + (g0 + g) * dim + from);
      });
    }
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = from_j; j < to_j; ++j) {
      const T* v = value(j);
      const float w = weights[g][j];
      for (int64_t t = from; t < dim; ++t) acc[g * dim + t] = std::fma(w, static_cast<float>(v[t]), acc[g * dim + t]);
    }
  }
}

constexpr int64_t kAhead = 8;  // rows of keys and values prefetched ahead of the scores' loop

// Every cache line of a row of `dim` Ts into the cache level `hint` names.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim, int hint) {
  for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
    const char* line = reinterpret_cast<const char*>(row) + byte;
    hint == _MM_HINT_T0 ? _mm_prefetch(line, _MM_HINT_T0) : _mm_prefetch(line, _MM_HINT_T1);
  }
}

// Query rows of one batch row and key head taken together: the keys and values they all attend (a pass's
// context, before its own rows) are read and converted once for all of them.
constexpr int64_t kRowBlock = 16;

template <typename T>
void attend_rows(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                 const int64_t* slots, const int64_t* offsets, double scaling, torch::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), groups = heads / kv_heads, blocks = (length + kRowBlock - 1) / kRowBlock;
  const T* q_data = query.data_ptr<T>();
  const T* k_data = key.data_ptr<T>();
  const T* v_data = value.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides();
  at::parallel_for(0, batch * blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, acc, key_row(dim), scores;
#if defined(__AVX2__) && defined(__FMA__)
    std::vector<float> key_block(kKeyBlock * dim);
#endif
    std::vector<float*> weights;  // each query row's and head's scores, then weights, by slot
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, b = task / kv_heads / blocks, i0 = task / kv_heads % blocks * kRowBlock;
      const int64_t rows = std::min(kRowBlock, length - i0);
      const int64_t* first = offsets + b * length + i0;  // row r's slots: slots[first[r] : first[r + 1]]
      // The slots every row of the block attends: the longest prefix their lists share.
      int64_t shared = first[1] - first[0];
      for (int64_t r = 1; r < rows; ++r) {
        int64_t common = 0;
        while (common < std::min(shared, first[r + 1] - first[r]) && slots[first[r] + common] == slots[first[0] + common]) ++common;
        shared = common;
      }
      q.resize(rows * groups * dim);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t t = 0; t < dim; ++t)
            q[(r * groups + g) * dim + t] =
                static_cast<float>(q_data[b * qs[0] + (h * groups + g) * qs[1] + (i0 + r) * qs[2] + t * qs[3]]) * scaling;
      // Row r's scores, [groups, n_r], from scores[groups * (first[r] - first[0])].
      scores.assign(groups * (first[rows] - first[0]), 0.f);
      weights.resize(rows * groups);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) weights[r * groups + g] = &scores[groups * (first[r] - first[0]) + g * (first[r + 1] - first[r])];
      const auto key_of = [&](int64_t r, int64_t j) { return k_data + b * ks[0] + h * ks[1] + slots[first[r] + j] * ks[2]; };
      const auto value_of = [&](int64_t r) {
        return [&, r](int64_t j) { return v_data + b * vs[0] + h * vs[1] + slots[first[r] + j] * vs[2]; };
      };
      // Slot j's key and value rows of row r into this core's caches ahead of their use: a decode step finds its
      // cache in memory, not in a core's caches. The values are for the weighted sums, after the softmax.
      const auto prefetch_slot = [&](int64_t r, int64_t j) {
        prefetch_row(key_of(r, j), dim, _MM_HINT_T0);
        prefetch_row(value_of(r)(j), dim, _MM_HINT_T1);
      };
      // Slot j's key of row r as floats (exact): converted once for every group and row that scores it.
      const auto key_floats = [&](int64_t r, int64_t j, float* into) {
        const T* k = key_of(r, j);
        for (int64_t t = 0; t < dim; ++t) into[t] = static_cast<float>(k[t]);
      };
      // Scores of rows `from`..`to` - 1 for their slots j_from..j_to - 1 (all of them attend those).
      const auto score = [&](int64_t from, int64_t to, int64_t j_from, int64_t j_to) {
        int64_t j = j_from;
#if defined(__AVX2__) && defined(__FMA__)
        for (; dim % LANES == 0 && j + kKeyBlock <= j_to; j += kKeyBlock) {
          for (int64_t p = 0; p < kKeyBlock; ++p) {
            if (j + kKeyBlock + p < j_to) prefetch_slot(from, j + kKeyBlock + p);  // the next block's
            key_floats(from, j + p, &key_block[p * dim]);
          }
          for (int64_t r = from; r < to; ++r)
            for (int64_t g = 0; g < groups; ++g) dot_keys(&q[(r * groups + g) * dim], key_block.data(), dim, &weights[r * groups + g][j]);
        }
#endif
        for (; j < j_to; ++j) {
          if (j + kAhead < j_to) prefetch_slot(from, j + kAhead);
          key_floats(from, j, key_row.data());
          for (int64_t r = from; r < to; ++r)
            for (int64_t g = 0; g < groups; ++g)
              weights[r * groups + g][j] = dot(&q[(r * groups + g) * dim], key_row.data(), dim);
        }
      };
      score(0, rows, 0, shared);
      for (int64_t r = 0; r < rows; ++r) score(r, r + 1, shared, first[r + 1] - first[r]);
      for (int64_t r = 0; r < rows; ++r) softmax(&weights[r * groups], groups, first[r + 1] - first[r]);
      acc.assign(rows * groups * dim, 0.f);
      weighted_sums<T>(weights.data(), rows * groups, 0, shared, value_of(0), dim, acc.data());
      for (int64_t r = 0; r < rows; ++r)
        weighted_sums<T>(weights.data() + r * groups, groups, shared, first[r + 1] - first[r], value_of(r), dim, &acc[r * groups * dim]);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          T* o = out_data + ((b * length + i0 + r) * heads + h * groups + g) * dim;
          for (int64_t t = 0; t < dim; ++t) o[t] = static_cast<T>(acc[(r * groups + g) * dim + t]);
        }
    }
  });
}

#if defined(__AVX512F__)
// The AMX-BF16 path (the avx512 build, where the CPU has AMX tiles and a pass asks: attention.py's `tiles`): the
// scores and the weighted sums as tile products, 16 query vectors (a row's query heads, several rows') by 16 keys,
// or by 16 outputs, per tile. Row-invariant by construction: each output of a tile product is its row's sums alone,
// in an order fixed by its operands' positions, so a query vector's scores are the same in any tile, and its
// weighted sum runs over its slots in blocks of 32 at fixed positions (slot 32i..32i + 31 of its list), with
// weights of zero past its own slots, which add nothing. The scores are float32 from bf16 queries and keys (scaled
// after), the softmax float32 as above, the weights rounded to bf16 for the weighted sums, which add in float32.
// Passes on tiles therefore compute other bits than the AVX paths, the same in every pass of a process.
constexpr int64_t kTile = 16;          // query vectors, keys or outputs a tile holds
constexpr int64_t kPairKeys = 32;      // slots one weighted-sum product adds: 16 rows of pairs
constexpr int64_t kAccumulators = 6;   // tiles tmm2-7 accumulate; tmm0 is A, tmm1 is B

TileConfig attention_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = kTile, config.colsb[t] = 64;
  return config;
}

// f(std::integral_constant<int, c>{}) for c = 0..n - 1, unrolled: tile numbers are immediates.
template <typename F, int... c>
void each(std::integer_sequence<int, c...>, F&& f) {
  (f(std::integral_constant<int, c>{}), ...);
}
template <int n, typename F>
void each(F&& f) {
  each(std::make_integer_sequence<int, n>{}, f);
}

// exp_nonpositive on 16 lanes, as two halves of 8.
inline __m512 exp_nonpositive(__m512 x) {
  const __m256 low = exp_nonpositive(_mm512_castps512_ps256(x));
  const __m256 high = exp_nonpositive(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

// 16 floats to bf16 (in each int32 lane's low half), rounded to nearest even as at::BFloat16 rounds finite floats.
inline __m512i bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

// A query vector's scores s[0..n) (n > 0) to its softmax weights in bf16, p[0..n): exp(s * scaling - the top)
// over their sum, which adds slot j in lane j mod 16, in order, and then the lanes in a fixed tree.
inline void tile_softmax(float* s, int64_t n, float scaling, uint16_t* p) {
  const auto mask = [&](int64_t j) { return static_cast<__mmask16>(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1); };
  __m512 tops = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) tops = _mm512_mask_max_ps(tops, mask(j), tops, _mm512_loadu_ps(s + j));
  // Rounding is monotonic: the top of the scaled scores is the scaled top.
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops) * scaling), scale = _mm512_set1_ps(scaling);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(mask(j), exp_nonpositive(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), scale), top)));
    _mm512_storeu_ps(s + j, e);
    sums = _mm512_add_ps(sums, e);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sums));
  for (int64_t j = 0; j < n; j += 16)
    _mm512_mask_cvtepi32_storeu_epi16(p + j, mask(j), bf16_bits(_mm512_div_ps(_mm512_loadu_ps(s + j), total)));
}

// Rows r[0..15] of 16 int32 each, transposed in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {  // u[4i + e]'s 128-bit lane l: element 4l + e of rows 4i..4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]), u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]), u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[8 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[4 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88), r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

struct TileBuffers {
  std::vector<uint16_t> q, keys, p, values;  // bf16 bits
  std::vector<float> scores, acc;
};

// One block's query vectors (queries[i], `count` of them, bf16, each of row i / groups) against the slots
// list[0..n), of which row r attends the first lengths[r]. key(j) and value(j): slot list[j]'s rows. Writes
// out[i] (bf16). The tiles are configured (attention_tiles).
template <typename Key, typename Value>
void tile_attend(const uint16_t* const* queries, int64_t count, int64_t groups, const int64_t* lengths, int64_t n,
                 Key key, Value value, int64_t dim, float scaling, uint16_t* const* out, TileBuffers& b) {
  const int64_t vectors = (count + kTile - 1) / kTile * kTile, slots = (n + kPairKeys - 1) / kPairKeys * kPairKeys;
  const int64_t steps = dim / 32, outputs = dim / kTile;  // A-tile widths of a query; 16-output tiles of a sum
  static const std::vector<uint16_t> zeros(256);
  const auto padded = [&](const uint16_t* row) { return row ? row : zeros.data(); };
  b.q.assign(vectors * dim, 0);
  for (int64_t i = 0; i < count; ++i) std::memcpy(&b.q[i * dim], queries[i], dim * 2);
  // Scores [vectors, slots]: per block of 16 slots, its keys transposed into B tiles of bf16 pairs.
  b.scores.resize(vectors * slots);
  b.keys.resize(steps * kTile * 32);
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    for (int64_t k = 0; k < kTile && j0 + kTile + k < n; ++k) prefetch_row(key(j0 + kTile + k), dim, _MM_HINT_T0);
    for (int64_t s = 0; s < steps; ++s) {
      __m512i r[16];
      for (int64_t k = 0; k < kTile; ++k)
        r[k] = _mm512_loadu_si512(padded(j0 + k < n ? key(j0 + k) : nullptr) + s * 32);
      transpose16(r);
      for (int64_t k = 0; k < kTile; ++k) _mm512_storeu_si512(&b.keys[(s * kTile + k) * 32], r[k]);
    }
    for (int64_t t0 = 0; t0 < vectors / kTile; t0 += kAccumulators) {
      with_count<kAccumulators>(vectors / kTile - t0, [&](auto tiles) {
        constexpr int kTiles = decltype(tiles)::value;
        each<kTiles>([](auto c) { tile_zero<2 + decltype(c)::value>(); });
        for (int64_t s = 0; s < steps; ++s) {
          tile_load<1>(&b.keys[s * kTile * 32], 64);
          each<kTiles>([&](auto c) {
            tile_load<0>(&b.q[(t0 + c) * kTile * dim + s * 32], dim * 2);
            tile_dpbf16ps<2 + decltype(c)::value, 0, 1>();
          });
        }
        each<kTiles>([&](auto c) { tile_store<2 + decltype(c)::value>(&b.scores[(t0 + c) * kTile * slots + j0], slots * 4); });
      });
    }
  }
  // Softmax per query vector over its row's slots; the weights in bf16, zero past them.
  b.p.assign(vectors * slots, 0);
  for (int64_t i = 0; i < count; ++i) tile_softmax(&b.scores[i * slots], lengths[i / groups], scaling, &b.p[i * slots]);
  // Values as B tiles: per 32 slots and 16 outputs, 16 rows of (slot 2i, slot 2i + 1) bf16 pairs.
  b.values.resize(slots * dim);
  for (int64_t j0 = 0; j0 < slots; j0 += kPairKeys)
    for (int64_t i = 0; i < kPairKeys / 2; ++i) {
      const uint16_t* even = padded(j0 + 2 * i < n ? value(j0 + 2 * i) : nullptr);
      const uint16_t* odd = padded(j0 + 2 * i + 1 < n ? value(j0 + 2 * i + 1) : nullptr);
      for (int64_t o = 0; o < outputs; ++o) {
        const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + o * kTile)));
        const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + o * kTile)));
        _mm512_storeu_si512(&b.values[((j0 / kPairKeys * outputs + o) * kTile + i) * 32], _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
  // Weighted sums [vectors, dim]: per tile of 16 query vectors, up to 6 tiles of 16 outputs at a time.
  b.acc.resize(vectors * dim);
  for (int64_t t = 0; t < vectors / kTile; ++t)
    for (int64_t o0 = 0; o0 < outputs; o0 += kAccumulators) {
      with_count<kAccumulators>(outputs - o0, [&](auto tiles) {
        constexpr int kTiles = decltype(tiles)::value;
        each<kTiles>([](auto c) { tile_zero<2 + decltype(c)::value>(); });
        for (int64_t j0 = 0; j0 < slots; j0 += kPairKeys) {
          tile_load<0>(&b.p[t * kTile * slots + j0], slots * 2);
          each<kTiles>([&](auto c) {
            tile_load<1>(&b.values[((j0 / kPairKeys * outputs + o0 + c) * kTile) * 32], 64);
            tile_dpbf16ps<2 + decltype(c)::value, 0, 1>();
          });
        }
        each<kTiles>([&](auto c) { tile_store<2 + decltype(c)::value>(&b.acc[t * kTile * dim + (o0 + c) * kTile], dim * 4); });
      });
    }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t t = 0; t < dim; t += kTile)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[i] + t), _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(&b.acc[i * dim + t]))));
}

std::atomic<bool> tiles_granted{false};

// attend_rows on tiles, bf16: the same tasks; a block of rows whose slot lists are each a prefix of the longest's
// (a prefill's or a chain's causal rows) takes the tiles together, other blocks (trees) one row at a time.
void tile_attend_rows(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                      const int64_t* slots, const int64_t* offsets, double scaling, torch::Tensor& out) {
  TORCH_CHECK(tiles_granted, "the AMX attention needs amx_enable() to have succeeded");
  const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), groups = heads / kv_heads, blocks = (length + kRowBlock - 1) / kRowBlock;
  const auto* q_data = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* k_data = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* v_data = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  auto* out_data = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides();
  at::parallel_for(0, batch * blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    tile_config(attention_tiles());  // per thread and call: oneDNN's and our int8 kernel's tiles load their own
    TileBuffers buffers;
    std::vector<const uint16_t*> queries;
    std::vector<uint16_t*> outs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, b = task / kv_heads / blocks, i0 = task / kv_heads % blocks * kRowBlock;
      const int64_t rows = std::min(kRowBlock, length - i0);
      const int64_t* first = offsets + b * length + i0;
      int64_t longest = 0;
      for (int64_t r = 1; r < rows; ++r) longest = first[r + 1] - first[r] > first[longest + 1] - first[longest] ? r : longest;
      bool nested = true;
      for (int64_t r = 0; r < rows && nested; ++r)
        nested = std::equal(slots + first[r], slots + first[r + 1], slots + first[longest]);
      // Rows r0..r1 - 1 over row `over`'s slots.
      const auto attend = [&](int64_t r0, int64_t r1, int64_t over) {
        const int64_t* list = slots + first[over];
        queries.clear(), outs.clear();
        int64_t lengths[kRowBlock];
        for (int64_t r = r0; r < r1; ++r) {
          lengths[r - r0] = first[r + 1] - first[r];
          for (int64_t g = 0; g < groups; ++g) {
            queries.push_back(q_data + b * qs[0] + (h * groups + g) * qs[1] + (i0 + r) * qs[2]);
            outs.push_back(out_data + ((b * length + i0 + r) * heads + h * groups + g) * dim);
          }
        }
        tile_attend(queries.data(), (r1 - r0) * groups, groups, lengths, first[over + 1] - first[over],
                    [&](int64_t j) { return k_data + b * ks[0] + h * ks[1] + list[j] * ks[2]; },
                    [&](int64_t j) { return v_data + b * vs[0] + h * vs[1] + list[j] * vs[2]; }, dim,
                    static_cast<float>(scaling), outs.data(), buffers);
      };
      if (nested) {
        attend(0, rows, longest);
      } else {
        for (int64_t r = 0; r < rows; ++r) attend(r, r + 1, r);
      }
    }
    tile_release();
  });
}
#endif

}  // namespace

// query [B, H, k, d]; key, value [B, Hkv, S, d] (last dim contiguous); row (b, i)'s slots are
// slots[offsets[b * k + i] : offsets[b * k + i + 1]], in token order. Returns [B, k, H, d].
// On AMX tiles where `tiles` asks (bf16, the avx512 build, head size a multiple of 32 up to 256): other bits.
torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor slots,
                     torch::Tensor offsets, double scaling, bool tiles) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key and value must be 4-D");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(offsets.numel() == query.size(0) * query.size(2) + 1, "one offset per query row, plus one");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "a CPU kernel");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(3),
              "key and value must be [B, Hkv, S, d] for query [B, H, k, d]");
  key = key.stride(3) == 1 ? key : key.contiguous();
  value = value.stride(3) == 1 ? value : value.contiguous();
  slots = slots.to(torch::kLong).contiguous();
  offsets = offsets.to(torch::kLong).contiguous();
  // Plain loops, not ATen reductions: this runs once per layer of every pass.
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(offsets.data_ptr<int64_t>()[offsets.numel() - 1] == slots.numel(), "the offsets must end at the number of slots");
  TORCH_CHECK(std::all_of(slot, slot + slots.numel(), [&](int64_t s) { return s >= 0 && s < key.size(2); }), "a slot outside the keys");
  auto out = torch::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
#if defined(__AVX512F__)
  if (tiles) {
    TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && query.size(3) % 32 == 0 && query.size(3) <= 256,
                "the AMX attention takes bf16 heads of a multiple of 32 up to 256");
    query = query.stride(3) == 1 ? query : query.contiguous();
    tile_attend_rows(query, key, value, slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), scaling, out);
    return out;
  }
#else
  TORCH_CHECK(!tiles, "the AMX attention is in the avx512 build only");
#endif
  if (query.scalar_type() == torch::kBFloat16)
    attend_rows<at::BFloat16>(query, key, value, slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), scaling, out);
  else if (query.scalar_type() == torch::kFloat)
    attend_rows<float>(query, key, value, slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), scaling, out);
  else
    TORCH_CHECK(false, "row-invariant attention takes float32 or bfloat16, not ", query.scalar_type());
  return out;
}

// Whether the AMX path may run: the tile state asked of Linux (once); false in builds without it.
bool amx_enable() {
#if defined(__AVX512F__)
  tiles_granted = tiles_granted || request_tiles();
  return tiles_granted;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention over per-row slot lists");
  m.def("amx_enable", &amx_enable, "ask Linux for the AMX tile state (once); whether the AMX path may run");
}
