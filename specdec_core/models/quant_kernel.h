// int4 or int8 weights x int8 activations: the CPU quantized linear layer (docs/QUANT.md), the part
// every ISA shares. Each ISA family has its own file, built as its own extension and chosen at start
// by vnni.py from the CPU flags (or SPECDEC_ISA): quant_avx512.cpp (AVX-512 VNNI, and AMX-INT8 tiles)
// and quant_avx2.cpp (AVX2). It defines `Simd` (its vector type and the few operations below need)
// and `pass` (the integer dot products), then includes this file and QUANT_KERNEL_MODULE.
//
// torch's own CPU int4 kernel unpacks every nibble to a float and multiplies in floats, once per
// token: it is bound by that arithmetic, and a pass over 6 tokens (a verify pass) or 256 (a
// prefill) costs 3x or 100x a one-token pass. Here, as in llama.cpp's Q4 x Q8 dot products, each
// activation row is quantized to int8 per group of 32, and the weight codes are multiplied by the
// activation codes into exact int32 sums; a weight block is unpacked once and used for every token
// of the pass.
//
// Packed weights, [N/16, K/32, bits, 64] uint8 (bits 4, 6 or 8). For a block of 16 output rows and a
// group of 32 inputs, operand i (i = 0..7) is 64 bytes whose byte 4r + j is row r's code for input
// 4i + j of the group (one AVX-512 register for `vpdpbusd`, or two AVX2 registers of 8 rows each).
// int8 stores the 8 operands as they are; int4 stores operands 2c and 2c + 1 in one 64-byte chunk c,
// 2c in the low nibbles and 2c + 1 in the high ones. int6 stores its codes' low 4 bits as int4 does
// (chunks 0-3) and their top 2 bits in chunks 4 and 5: chunk 4 + c holds operands 4c..4c + 3, 2 bits
// each from the bottom. Per group and row, w = q * scale + min (q in 0..2^bits - 1); scale_min is
// [N/16, K/32, 2, 16] fp16 (16 scales, then 16 mins).
//
// Why every path's outputs are bit-identical, whatever the ISA and the number of rows in the pass:
// the integer sums are exact, and per output the float work is the same instructions in the same
// order, lane by lane (activation quantization, the epilogue per group below, the bf16 rounding).
// So a row's result does not depend on the pass, and a verify pass computes exactly what one-token
// steps do.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kAhead = 8;
constexpr int kLanes = Simd::kLanes, kVectors = kGroup / kLanes, kParts = kRows / kLanes;

template <int bits>
constexpr int64_t group_bytes() { return 8 * bits * 64 / 8; }

// f(std::integral_constant<int, count>{}) for a count in 1..most: a pass's row count as a compile-time one.
template <int most, typename F>
void with_count(int64_t count, F&& f) {
  if constexpr (most > 1) {
    if (count < most) return with_count<most - 1>(count, f);
  }
  f(std::integral_constant<int, most>{});
}

// Groups prefetched into L2 beyond kAhead (0: none): the CPU's own choice, timed at start (vnni.far_prefetch).
std::atomic<int64_t> far_ahead{0};

// The weights and scales of the group `ahead` groups on, into the cache level `hint` names.
template <auto hint, int bits>
void prefetch_ahead(const uint8_t* w, const uint16_t* sm, int64_t ahead) {
  for (int64_t line = 0; line < group_bytes<bits>(); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead * group_bytes<bits>() + line), hint);
  }
  _mm_prefetch(reinterpret_cast<const char*>(sm + ahead * 32), hint);
}

// A few groups ahead into L1, and where chosen far ahead into L2: one core's own prefetchers leave its share of
// the memory bandwidth unused. Prefetches past the weights' end are harmless (they never fault).
template <int bits>
void prefetch_group(const uint8_t* w, const uint16_t* sm) {
  prefetch_ahead<_MM_HINT_T0, bits>(w, sm, kAhead);
  if (const int64_t far = far_ahead.load(std::memory_order_relaxed)) prefetch_ahead<_MM_HINT_T1, bits>(w, sm, far);
}

// x [M, K] -> codes [M, K] int8, and per row and group: the code sum, scale and scale * sum(codes).
template <typename T>
void quantize_activations(const T* x, int64_t m, int64_t k, int8_t* codes, int32_t* code_sums, float* scales, float* sums) {
  using F = typename Simd::F;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const T* in = x + row * k + g * kGroup;
        F v[kVectors];
        for (int i = 0; i < kVectors; ++i) v[i] = Simd::load(in + i * kLanes);
        F largest = Simd::abs(v[0]);
        for (int i = 1; i < kVectors; ++i) largest = Simd::max(largest, Simd::abs(v[i]));
        const float amax = Simd::reduce_max(largest);  // max is exact: any order of lanes gives it
        const F inverse = Simd::set1(amax > 0 ? 127.f / amax : 0.f);
        int32_t code_sum = 0;
        for (int i = 0; i < kVectors; ++i) {  // rounded to nearest even, as torch.round does
          code_sum += Simd::round_and_store(Simd::mul(v[i], inverse), codes + row * k + g * kGroup + i * kLanes);
        }
        const float scale = amax / 127.f;
        const int64_t at = row * (k / kGroup) + g;
        code_sums[at] = code_sum;
        scales[at] = scale;
        sums[at] = scale * static_cast<float>(code_sum);
      }
    }
  });
}

// What a pass does with the int32 sums of one token, one group and kLanes output rows from `col`.
// Linear is the float epilogue: acc += sum * scale * xscale, then acc += min * xsum, groups in order.
// Every path runs exactly these instructions in this order.
template <typename T>
struct Linear {
  const float* scales;
  const float* sums;
  int64_t groups, n;
  T* out;
  void add(typename Simd::F& acc, typename Simd::I sum, typename Simd::F scale, typename Simd::F min, int64_t row,
           int64_t g, int64_t) const {
    const int64_t at = row * groups + g;
    acc = Simd::fmadd(Simd::mul(Simd::to_float(sum), scale), Simd::set1(scales[at]), acc);
    acc = Simd::fmadd(min, Simd::set1(sums[at]), acc);
  }
  void finish(typename Simd::F acc, int64_t row, int64_t col) const { Simd::store(out + row * n + col, acc); }
};

// The int32 sums themselves, [M, K/32, N]: for tests that compare the paths' integers.
struct Sums {
  int64_t groups, n;
  int32_t* out;
  void add(typename Simd::F&, typename Simd::I sum, typename Simd::F, typename Simd::F, int64_t row, int64_t g, int64_t col) const {
    Simd::store_ints(out + (row * groups + g) * n + col, sum);
  }
  void finish(typename Simd::F, int64_t, int64_t) const {}
};

// The scales and mins of kLanes output rows (part `part` of the block) for one group.
typename Simd::F group_scale(const uint16_t* sm, int part) { return Simd::load_half(sm + part * kLanes); }
typename Simd::F group_min(const uint16_t* sm, int part) { return Simd::load_half(sm + 16 + part * kLanes); }

// The weights as a bf16 [K, N] tensor (transposed: 16 rows of one input are one store), for
// passes long enough that a bf16 matmul on the CPU's matrix units beats the integer dot products.
template <int bits>
torch::Tensor dequantize_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  const int64_t groups = packed.size(1), k = groups * kGroup, n = packed.size(0) * kRows;
  torch::Tensor out = torch::empty({k, n}, torch::kBFloat16);
  auto* dst = out.data_ptr<at::BFloat16>();
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  // Over groups of inputs, blocks of rows innermost: each output row is then written in order.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t nb = 0; nb < n / kRows; ++nb) {
        const uint16_t* group_sm = sm + (nb * groups + g) * 32;
        for (int part = 0; part < kParts; ++part) {
          const typename Simd::F scale = group_scale(group_sm, part), min = group_min(group_sm, part);
          typename Simd::I op[8];
          Simd::template operands<bits>(w + (nb * groups + g) * group_bytes<bits>(), part, op);
          for (int i = 0; i < 8; ++i) {
            for (int j = 0; j < 4; ++j) {  // lane r of the 32-bit view: row r's codes for inputs 4i..4i+3
              const typename Simd::F value = Simd::fmadd(Simd::to_float(Simd::byte(op[i], j)), scale, min);
              const int64_t input = g * kGroup + 4 * i + j;
              Simd::store(dst + input * n + nb * kRows + part * kLanes, value);
            }
          }
        }
      }
    }
  });
  return out;
}

int bits_of(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && (packed.size(2) == 4 || packed.size(2) == 6 || packed.size(2) == 8) && packed.size(3) == 64,
              "packed must be [N/16, K/32, 4 (int4), 6 (int6) or 8 (int8), 64]");
  return packed.size(2);
}

// f(std::integral_constant<int, bits>{}) for packed's code width.
template <typename F>
void with_bits(const torch::Tensor& packed, F&& f) {
  switch (bits_of(packed)) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// x [M, K] rounded to int8 per group: codes [rows >= M, K] (rows past M zero, for AMX's A tiles),
// and per row and group [M, K/32]: the codes' sum, the scale, and scale * the sum.
struct Quantized {
  torch::Tensor codes, code_sums, scales, sums;
};

Quantized quantize(const torch::Tensor& x, int64_t rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bf16, not ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "x has ", x.size(1), " inputs, not a multiple of ", kGroup);
  const int64_t m = x.size(0), k = x.size(1);
  Quantized q{torch::empty({rows, k}, torch::kInt8), torch::empty({m, k / kGroup}, torch::kInt),
              torch::empty({m, k / kGroup}, torch::kFloat), torch::empty({m, k / kGroup}, torch::kFloat)};
  q.codes.narrow(0, m, rows - m).zero_();
  const auto run = [&](const auto* in) {
    quantize_activations(in, m, k, q.codes.data_ptr<int8_t>(), q.code_sums.data_ptr<int32_t>(), q.scales.data_ptr<float>(),
                         q.sums.data_ptr<float>());
  };
  x.scalar_type() == torch::kBFloat16 ? run(x.data_ptr<at::BFloat16>()) : run(x.data_ptr<float>());
  return q;
}

// Where the ISA's `pass` reads the pass's operands.
struct PassInputs {
  const int8_t* codes;
  const int32_t* code_sums;
  int64_t m, k, n;
  const uint8_t* w;
  const uint16_t* sm;
};

// The ISA's file defines these after including this one: a pass's integer dot products, fed to `epilogue`
// (on AMX tiles where `tiles` asks), and how many rows of codes a pass of m rows reads (AMX's A tiles
// read whole tiles, so the codes are padded with zero rows).
template <int bits, typename Epilogue>
void pass(const PassInputs& in, bool tiles, const Epilogue& epilogue);
int64_t padded_rows(int64_t m, bool tiles);

// One pass over x's codes with `epilogue`.
template <typename Epilogue>
void run_pass(const Quantized& q, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles, const Epilogue& epilogue) {
  const int64_t k = q.codes.size(1);
  TORCH_CHECK(k == packed.size(1) * kGroup, "x has ", k, " inputs; the weights take ", packed.size(1) * kGroup);
  const PassInputs in{q.codes.data_ptr<int8_t>(), q.code_sums.data_ptr<int32_t>(), q.scales.size(0), k, packed.size(0) * kRows,
                      packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>())};
  with_bits(packed, [&](auto bits) { pass<decltype(bits)::value>(in, tiles, epilogue); });
}

template <typename T>
Linear<T> linear_into(const Quantized& q, torch::Tensor& out) {
  return {q.scales.data_ptr<float>(), q.sums.data_ptr<float>(), q.scales.size(1), out.size(1), out.data_ptr<T>()};
}

torch::Tensor dequantize_weights_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  torch::Tensor out;
  with_bits(packed, [&](auto bits) { out = dequantize_t<decltype(bits)::value>(packed, scale_min); });
  return out;
}

// y [M, N] = x [M, K] @ dequant(packed).T, in x's dtype (float32 or bf16).
torch::Tensor quantized_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles) {
  const Quantized q = quantize(x, padded_rows(x.size(0), tiles));
  torch::Tensor out = torch::empty({x.size(0), packed.size(0) * kRows}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    run_pass(q, packed, scale_min, tiles, linear_into<at::BFloat16>(q, out));
  } else {
    run_pass(q, packed, scale_min, tiles, linear_into<float>(q, out));
  }
  return out;
}

// The int32 sums [M, K/32, N] of each token, group and output row, as a pass computes them.
torch::Tensor group_sums(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles) {
  const Quantized q = quantize(x, padded_rows(x.size(0), tiles));
  const int64_t groups = packed.size(1), n = packed.size(0) * kRows;
  torch::Tensor out = torch::empty({x.size(0), groups, n}, torch::kInt);
  run_pass(q, packed, scale_min, tiles, Sums{groups, n, out.data_ptr<int32_t>()});
  return out;
}

}  // namespace

#include "step_ops.h"

// The functions every ISA's extension has.
#define QUANT_KERNEL_MODULE(module)                                                                                   \
  module.def("dequantize_t", &dequantize_weights_t, "the weights as bf16 [K, N]");                                   \
  module.def("mm", &quantized_mm, "y = x @ dequant(int4 or int8 weights).T with int8 activations (tiles: AMX-INT8)"); \
  module.def("group_sums", &group_sums, "the int32 sums per token, group and output row (tests)");                  \
  module.def("set_far_prefetch", [](int64_t groups) { far_ahead.store(groups, std::memory_order_relaxed); },           \
             "groups of weights prefetched into L2 beyond the near prefetch, 0 for none (the same bits)");           \
  module.def("far_prefetch", [] { return far_ahead.load(std::memory_order_relaxed); }, "set_far_prefetch's value");   \
  STEP_OPS_MODULE(module)
