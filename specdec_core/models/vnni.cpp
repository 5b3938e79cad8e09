// int4 or int8 weights x int8 activations on AVX-512 VNNI: the CPU quantized linear layer (docs/QUANT.md).
//
// torch's own CPU int4 kernel unpacks every nibble to a float and multiplies in floats, once per
// token: it is bound by that arithmetic, and a pass over 6 tokens (a verify pass) or 256 (a
// prefill) costs 3x or 100x a one-token pass. Here, as in llama.cpp's Q4 x Q8 dot products, each
// activation row is quantized to int8 per group of 32, and `vpdpbusd` multiplies 64 weight codes
// by 64 activation codes into int32 in one instruction; a weight block is unpacked once and used
// for every token of the pass.
//
// Packed weights, [N/16, K/32, 8 * bits / 8, 64] uint8. For a block of 16 output rows and a group
// of 32 inputs, operand i (i = 0..7) is one 64-byte register whose byte 4r + j is row r's code for
// input 4i + j of the group: `vpdpbusd` multiplies it by 4 broadcast activation codes. int8 stores
// the 8 operands as they are; int4 stores operands 2c and 2c + 1 in one 64-byte chunk c, 2c in
// the low nibbles and 2c + 1 in the high ones. Per group and row, w = q * scale + min (q in 0..15
// or 0..255); scale_min is [N/16, K/32, 2, 16] fp16 (16 scales, then 16 mins).
//
// A row's result does not depend on how many rows share the pass (integer sums are exact, the
// float sums run in one fixed order), so a verify pass computes exactly what one-token steps do.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kTokens = 4, kAhead = 8;  // kTokens: activation rows per register tile

// 16 floats to bf16, rounding to nearest even (plain AVX-512F, so no bf16 instructions needed).
__m256i to_bf16(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Activations and results are float32 or bf16, read and written as such (no conversion passes).
__m512 load16(const float* in) { return _mm512_loadu_ps(in); }
__m512 load16(const at::BFloat16* in) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
void store16(float* out, __m512 values) { _mm512_storeu_ps(out, values); }
void store16(at::BFloat16* out, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(values));
}

// x [M, K] -> codes [M, K] int8, and per row and group: scale and scale * sum(codes).
template <typename T>
void quantize_activations(const T* x, int64_t m, int64_t k, int8_t* codes, float* scales, float* sums) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const __m512 a = load16(x + row * k + g * kGroup), b = load16(x + row * k + g * kGroup + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
        // Rounded to nearest even, as torch.round does.
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
        int8_t* out = codes + row * k + g * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(qb));
        const float scale = amax / 127.f;
        scales[row * (k / kGroup) + g] = scale;
        sums[row * (k / kGroup) + g] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
      }
    }
  });
}

// The 8 operands of one group of one 16-row block (see the layout above).
template <int bits>
void operands(const uint8_t* w, __m512i op[8]) {
  if constexpr (bits == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = _mm512_loadu_si512(w + 64 * c);
      op[2 * c] = _mm512_and_si512(bytes, nibble);
      op[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    }
  } else {
    for (int i = 0; i < 8; ++i) op[i] = _mm512_loadu_si512(w + 64 * i);
  }
}

// out[t, 16 rows] for `tokens` (<= kTokens) activation rows starting at t0, one block of 16 rows.
template <int bits, int tokens, typename T>
void block(const uint8_t* packed, const uint16_t* scale_min, const int8_t* codes, const float* scales,
           const float* sums, int64_t k, int64_t n, int64_t t0, int64_t nb, T* out) {
  const int64_t groups = k / kGroup, group_bytes = 8 * bits * 64 / 8;
  __m512 acc[tokens];
  for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* w = packed + nb * groups * group_bytes;
  const uint16_t* sm = scale_min + nb * groups * 32;
  for (int64_t g = 0; g < groups; ++g, w += group_bytes, sm += 32) {
    // A few groups ahead: one core's own prefetchers leave its share of the memory bandwidth unused.
    for (int line = 0; line < group_bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * group_bytes + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sm + kAhead * 32), _MM_HINT_T0);
    __m512i op[8];
    operands<bits>(w, op);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
    const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 16)));
    for (int t = 0; t < tokens; ++t) {
      const int8_t* x = codes + (t0 + t) * k + g * kGroup;
      // Four independent sums: a single chain of eight dependent vpdpbusd would wait on latency.
      __m512i dot[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int i = 0; i < 8; ++i) {
        int32_t four;
        std::memcpy(&four, x + 4 * i, 4);
        dot[i % 4] = _mm512_dpbusd_epi32(dot[i % 4], op[i], _mm512_set1_epi32(four));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[1]), _mm512_add_epi32(dot[2], dot[3]));
      const int64_t at = (t0 + t) * groups + g;
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale), _mm512_set1_ps(scales[at]), acc[t]);
      acc[t] = _mm512_fmadd_ps(min, _mm512_set1_ps(sums[at]), acc[t]);
    }
  }
  for (int t = 0; t < tokens; ++t) store16(out + (t0 + t) * n + nb * kRows, acc[t]);
}

// The weights as a bf16 [K, N] tensor (transposed: 16 rows of one input are one store), for
// passes long enough that a bf16 matmul on the CPU's matrix units beats the integer dot products.
template <int bits>
torch::Tensor dequantize_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  const int64_t groups = packed.size(1), k = groups * kGroup, n = packed.size(0) * kRows, group_bytes = 8 * bits * 64 / 8;
  torch::Tensor out = torch::empty({k, n}, torch::kBFloat16);
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  // Over groups of inputs, blocks of rows innermost: each output row is then written in order.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t nb = 0; nb < n / kRows; ++nb) {
        const uint16_t* group_sm = sm + (nb * groups + g) * 32;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_sm)));
        const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_sm + 16)));
        __m512i op[8];
        operands<bits>(w + (nb * groups + g) * group_bytes, op);
        for (int i = 0; i < 8; ++i) {
          for (int j = 0; j < 4; ++j) {  // lane r of the 32-bit view: row r's codes for inputs 4i..4i+3
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(op[i], 8 * j), byte);
            const __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, min);
            const int64_t input = g * kGroup + 4 * i + j;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + input * n + nb * kRows), to_bf16(value));
          }
        }
      }
    }
  });
  return out;
}

template <int bits, typename T>
void mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, torch::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), groups = k / kGroup;
  torch::Tensor codes = torch::empty({m, k}, torch::kInt8);
  torch::Tensor scales = torch::empty({m, groups}, torch::kFloat), sums = torch::empty({m, groups}, torch::kFloat);
  quantize_activations(x.data_ptr<T>(), m, k, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<float>());
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float *sc = scales.data_ptr<float>(), *su = sums.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, n / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      int64_t t0 = 0;
      for (; t0 + kTokens <= m; t0 += kTokens) block<bits, kTokens>(w, sm, c, sc, su, k, n, t0, nb, y);
      switch (m - t0) {
        case 3: block<bits, 3>(w, sm, c, sc, su, k, n, t0, nb, y); break;
        case 2: block<bits, 2>(w, sm, c, sc, su, k, n, t0, nb, y); break;
        case 1: block<bits, 1>(w, sm, c, sc, su, k, n, t0, nb, y); break;
        default: break;
      }
    }
  });
}

int bits_of(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && (packed.size(2) == 4 || packed.size(2) == 8) && packed.size(3) == 64,
              "packed must be [N/16, K/32, 4 (int4) or 8 (int8), 64]");
  return packed.size(2) == 4 ? 4 : 8;
}

}  // namespace

torch::Tensor vnni_dequantize_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  return bits_of(packed) == 4 ? dequantize_t<4>(packed, scale_min) : dequantize_t<8>(packed, scale_min);
}

// y [M, N] = x [M, K] @ dequant(packed).T, in x's dtype (float32 or bf16).
torch::Tensor vnni_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bf16, not ", x.scalar_type());
  const int bits = bits_of(packed);
  TORCH_CHECK(x.size(1) == packed.size(1) * kGroup, "x has ", x.size(1), " inputs; the weights take ", packed.size(1) * kGroup);
  torch::Tensor out = torch::empty({x.size(0), packed.size(0) * kRows}, x.options());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if (bits == 4) {
    bf16 ? mm<4, at::BFloat16>(x, packed, scale_min, out) : mm<4, float>(x, packed, scale_min, out);
  } else {
    bf16 ? mm<8, at::BFloat16>(x, packed, scale_min, out) : mm<8, float>(x, packed, scale_min, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("vnni_dequantize_t", &vnni_dequantize_t, "the weights as bf16 [K, N]");
  module.def("vnni_mm", &vnni_mm, "y = x @ dequant(int4 or int8 weights).T with int8 activations (AVX-512 VNNI)");
}
