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
// A GGUF file's K-quant tensors keep their own super-blocks of 256 inputs (gguf_blocks.py): packed is
// [N/16, K/256, lines, 64] uint8, per 16-row block and super-block the 8 groups' codes in the layout above (4 bits
// for Q4_K, 6 for Q6_K), then the integer sub-scales as the file holds them, byte b of 16 rows side by side: Q4_K's
// 12 bytes of 6-bit scales and mins per group of 32 inputs (192 bytes, so its bytes are the file's), Q6_K's 16 int8
// scales per 16 inputs (256 bytes; its mins are its scales). scale_min is
// [N/16, K/256, 2, 16] fp16: d[16] then dmin[16] (Q6_K's [N/16, K/256, 1, 16]: d alone, its dmin 32 d). Per sub-block s and row,
// w = d * sc_s * q - dmin * m_s, the file's value (Q6_K: d * sc_s * (q - 32)). Activations are rounded to int8 per
// 256 inputs, and the integer sums sum(sc_s * q . a) and sum(m_s * sum(a)) are exact over the whole super-block, so
// a row takes one float epilogue per 256 inputs (llama.cpp's K-quant dot products take their sums the same way).
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
#include <cstdlib>
#include <memory>
#include <cstring>
#include <type_traits>
#include <utility>

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kAhead = 8, kSuper = 256;
// A K format's lines of 64 bytes per super-block, packed.size(2): Q4_K's and Q6_K's.
constexpr int64_t kQ4K = 35, kQ6K = 52;
constexpr int kLanes = Simd::kLanes, kVectors = kGroup / kLanes, kParts = kRows / kLanes;

template <int bits>
constexpr int64_t group_bytes() { return 8 * bits * 64 / 8; }
// A K format's super-block of one 16-row block: 8 groups' codes, then the sub-scales.
template <int bits>
constexpr int64_t super_bytes() { return 8 * group_bytes<bits>() + (bits == 4 ? 12 : 16) * kRows; }
// A K format's float16 scales per super-block of one 16-row block in scale_min: Q4_K's d and dmin, Q6_K's d alone.
template <int bits>
constexpr int64_t super_scales() { return bits == 4 ? 32 : 16; }
// A K format's integer sums a group keeps apart per row and part, one per sub-scale (Q4_K's covers the group's 32
// inputs, Q6_K's 16): no more, so that a register block of rows keeps its sums in registers.
template <int bits>
constexpr int kHalves = bits == 4 ? 1 : 2;

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

// The eighth `part` of the next super-block of a K format (one group's worth, called once per group), into L1, and
// where chosen the same far_ahead groups ahead into L2 (rounded up to whole super-blocks).
template <auto hint, int bits>
void prefetch_super_ahead(const uint8_t* w, const uint16_t* dm, int64_t ahead, int part) {
  const uint8_t* next = w + ahead * super_bytes<bits>();
  for (int64_t line = part * super_bytes<bits>() / 8 / 64 * 64; line < (part + 1) * super_bytes<bits>() / 8; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(next + line), hint);
  }
  if (part == 0) _mm_prefetch(reinterpret_cast<const char*>(dm + ahead * super_scales<bits>()), hint);
}

template <int bits>
void prefetch_super(const uint8_t* w, const uint16_t* dm, int part) {
  prefetch_super_ahead<_MM_HINT_T0, bits>(w, dm, 1, part);
  if (const int64_t far = far_ahead.load(std::memory_order_relaxed)) prefetch_super_ahead<_MM_HINT_T1, bits>(w, dm, (far + 7) / 8, part);
}

// x [M, K] -> codes [M, K] int8; per row and `group` inputs (32, or a K format's 256) the scale and scale * sum(codes);
// per row and `summed` inputs the codes' sum (32, or 16 for a K format's sub-blocks).
template <int64_t group, int64_t summed, typename T>
void quantize_activations(const T* x, int64_t m, int64_t k, int8_t* codes, int32_t* code_sums, float* scales, float* sums) {
  using F = typename Simd::F;
  constexpr int vectors = group / kLanes;
  static_assert(summed % kLanes == 0 && group % summed == 0, "a code sum covers whole vectors of a group");
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t g = 0; g < k / group; ++g) {
        const T* in = x + row * k + g * group;
        F v[vectors];
        for (int i = 0; i < vectors; ++i) v[i] = Simd::load(in + i * kLanes);
        F largest = Simd::abs(v[0]);
        for (int i = 1; i < vectors; ++i) largest = Simd::max(largest, Simd::abs(v[i]));
        const float amax = Simd::reduce_max(largest);  // max is exact: any order of lanes gives it
        const F inverse = Simd::set1(amax > 0 ? 127.f / amax : 0.f);
        int32_t part_sums[group / summed] = {}, code_sum = 0;
        for (int i = 0; i < vectors; ++i) {  // rounded to nearest even, as torch.round does
          part_sums[i * kLanes / summed] += Simd::round_and_store(Simd::mul(v[i], inverse), codes + row * k + g * group + i * kLanes);
        }
        for (int p = 0; p < group / summed; ++p) {
          code_sums[row * (k / summed) + g * (group / summed) + p] = part_sums[p];
          code_sum += part_sums[p];
        }
        const float scale = amax / 127.f;
        scales[row * (k / group) + g] = scale;
        sums[row * (k / group) + g] = scale * static_cast<float>(code_sum);
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
  // A K format's super-block s: acc += (tot * d) * xscale, then acc += (mtot * dmin) * -xscale.
  void add_super(typename Simd::F& acc, typename Simd::I tot, typename Simd::I mtot, typename Simd::F d, typename Simd::F dmin,
                 int64_t row, int64_t s, int64_t) const {
    const float xscale = scales[row * groups + s];
    acc = Simd::fmadd(Simd::mul(Simd::to_float(tot), d), Simd::set1(xscale), acc);
    acc = Simd::fmadd(Simd::mul(Simd::to_float(mtot), dmin), Simd::set1(-xscale), acc);
  }
  void finish(typename Simd::F acc, int64_t row, int64_t col) const { Simd::store(out + row * n + col, acc); }
};

// The int32 sums themselves, [M, K/32, N] (a K format's [M, K/256, 2, N]: sum(sc * q . a), then sum(m * sum(a))):
// for tests that compare the paths' integers.
struct Sums {
  int64_t groups, n;
  int32_t* out;
  void add(typename Simd::F&, typename Simd::I sum, typename Simd::F, typename Simd::F, int64_t row, int64_t g, int64_t col) const {
    Simd::store_ints(out + (row * groups + g) * n + col, sum);
  }
  void add_super(typename Simd::F&, typename Simd::I tot, typename Simd::I mtot, typename Simd::F, typename Simd::F, int64_t row,
                 int64_t s, int64_t col) const {
    Simd::store_ints(out + (row * groups + s) * 2 * n + col, tot);
    Simd::store_ints(out + ((row * groups + s) * 2 + 1) * n + col, mtot);
  }
  void finish(typename Simd::F, int64_t, int64_t) const {}
};

// The scales and mins of kLanes output rows (part `part` of the block) for one group.
typename Simd::F group_scale(const uint16_t* sm, int part) { return Simd::load_half(sm + part * kLanes); }
typename Simd::F group_min(const uint16_t* sm, int part) { return Simd::load_half(sm + 16 + part * kLanes); }

// A packed tensor's format: a group format's code width (4, 6 or 8), or a K format's (kQ4K, kQ6K).
struct Format {
  int bits;
  bool super;  // a K format: super-blocks of 256 inputs
};

Format format_of(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(3) == 64,
              "packed must be [N/16, K/32, 4 (int4), 6 (int6) or 8 (int8), 64] or [N/16, K/256, 35 (Q4_K) or 52 (Q6_K), 64]");
  switch (packed.size(2)) {
    case 4: case 6: case 8: return {static_cast<int>(packed.size(2)), false};
    case kQ4K: return {4, true};
    case kQ6K: return {6, true};
  }
  TORCH_CHECK(false, "packed has ", packed.size(2), " lines a block: not 4, 6, 8 (int4, int6, int8), 35 (Q4_K) or 52 (Q6_K)");
}

// The inputs a packed tensor takes.
int64_t inputs_of(const torch::Tensor& packed) { return packed.size(1) * (format_of(packed).super ? kSuper : kGroup); }

// f(std::integral_constant<int, bits>{}, std::integral_constant<bool, super>{}) for packed's format.
template <typename F>
void with_format(const torch::Tensor& packed, F&& f) {
  using Four = std::integral_constant<int, 4>;
  using Six = std::integral_constant<int, 6>;
  using Group = std::false_type;
  using Super = std::true_type;
  const Format format = format_of(packed);
  if (format.super) {
    format.bits == 4 ? f(Four{}, Super{}) : f(Six{}, Super{});
  } else {
    switch (format.bits) {
      case 4: f(Four{}, Group{}); break;
      case 6: f(Six{}, Group{}); break;
      default: f(std::integral_constant<int, 8>{}, Group{}); break;
    }
  }
}

// A K format's d and dmin of kLanes rows (part `part` of the block) for one super-block; Q6_K's dmin is 32 d, exact.
template <int bits>
std::pair<typename Simd::F, typename Simd::F> super_scale_min(const uint16_t* dm, int part) {
  const typename Simd::F d = group_scale(dm, part);
  return {d, bits == 4 ? group_min(dm, part) : Simd::mul(d, Simd::set1(32.f))};
}

// Byte b of a K format's sub-scales for kLanes rows (part `part` of the block), each row's in its lane.
typename Simd::I sub_byte(const uint8_t* sub, int b, int part) { return Simd::widen(sub + 16 * b + part * kLanes); }

// A K format's integer sub-scales of kLanes rows for sub-block half `half` (inputs 16 half .. 16 half + 15) of group j:
// Q4_K's per group (6 bits: group j < 4 in byte j's low bits, j >= 4 in byte j + 4's low nibble with byte j - 4's
// top 2 bits above it), Q6_K's per 16 inputs (int8).
template <int bits>
typename Simd::I sub_scale(const uint8_t* sub, int j, int half, int part) {
  if constexpr (bits == 4) {
    if (j < 4) return Simd::field(sub_byte(sub, j, part), 0, 63);
    return Simd::with_high(Simd::field(sub_byte(sub, j + 4, part), 0, 15), Simd::field(sub_byte(sub, j - 4, part), 6, 3));
  } else {
    return Simd::widen(reinterpret_cast<const int8_t*>(sub) + 16 * (2 * j + half) + part * kLanes);
  }
}
// A K format's mins, one entry per 32 inputs (Q4_K: 8 a super-block, 6 bits: entry e < 4 in byte e + 4's low bits,
// e >= 4 in byte e + 4's high nibble with byte e's top 2 bits above it) or 16 (Q6_K: 16, its sub-scales again), and
// the activation codes' sum over that entry's inputs (`sums16`: the super-block's 16 sums per 16 inputs).
template <int bits>
constexpr int min_entries() { return bits == 4 ? 8 : 16; }
template <int bits>
typename Simd::I entry_min(const uint8_t* sub, int e, int part) {
  if constexpr (bits == 4) {
    if (e < 4) return Simd::field(sub_byte(sub, e + 4, part), 0, 63);
    return Simd::with_high(Simd::field(sub_byte(sub, e + 4, part), 4, 15), Simd::field(sub_byte(sub, e, part), 6, 3));
  } else {
    return Simd::widen(reinterpret_cast<const int8_t*>(sub) + 16 * e + part * kLanes);
  }
}
template <int bits>
int32_t entry_sum(const int32_t* sums16, int e) { return bits == 4 ? sums16[2 * e] + sums16[2 * e + 1] : sums16[e]; }

// The weights as a [K, N] tensor of Out (transposed: 16 rows of one input are one store): bf16 for passes long enough
// that a bf16 matmul on the CPU's matrix units beats the integer dot products, float32 to check them. Each value is
// its exact value rounded once (one fmadd: a group format's q * scale + min; a K format's q * (d * sc) - dmin * m, both
// products exact in float32), as the gguf package's dequantization gives a GGUF tensor's values.
template <typename Out, int bits, bool super>
torch::Tensor dequantize_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  const int64_t groups = inputs_of(packed) / kGroup, k = groups * kGroup, n = packed.size(0) * kRows;
  const int64_t block_bytes = super ? packed.size(1) * super_bytes<bits>() : groups * group_bytes<bits>();
  torch::Tensor out = torch::empty({k, n}, c10::CppTypeToScalarType<Out>::value);
  auto* dst = out.data_ptr<Out>();
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  using F = typename Simd::F;
  // Over groups of inputs, blocks of rows innermost: each output row is then written in order.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t nb = 0; nb < n / kRows; ++nb) {
        const int64_t s = g / 8, j = g % 8;  // a K format's super-block, and the group in it
        const uint8_t* block = w + nb * block_bytes;
        const uint8_t* codes = super ? block + s * super_bytes<bits>() + j * group_bytes<bits>() : block + g * group_bytes<bits>();
        const uint16_t* group_sm = sm + (nb * packed.size(1) + (super ? s : g)) * (super ? super_scales<bits>() : 32);
        for (int part = 0; part < kParts; ++part) {
          typename Simd::I op[8];
          Simd::template operands<bits>(codes, part, op);
          // A group format's scale and min; a K format's d and dmin (Q6_K's scale_min holds d alone).
          const auto [block_scale, block_min] = [&] {
            if constexpr (super) return super_scale_min<bits>(group_sm, part);
            else return std::pair{group_scale(group_sm, part), group_min(group_sm, part)};
          }();
          for (int i = 0; i < 8; ++i) {
            F scale = block_scale, min = block_min;
            if constexpr (super) {  // d * sc and -(dmin * m): exact
              const uint8_t* sub = block + s * super_bytes<bits>() + 8 * group_bytes<bits>();
              const int e = bits == 4 ? j : 2 * j + i / 4;
              scale = Simd::mul(block_scale, Simd::to_float(sub_scale<bits>(sub, j, i / 4, part)));
              min = Simd::mul(Simd::mul(block_min, Simd::to_float(entry_min<bits>(sub, e, part))), Simd::set1(-1.f));
            }
            for (int jj = 0; jj < 4; ++jj) {  // lane r of the 32-bit view: row r's codes for inputs 4i..4i+3
              const F value = Simd::fmadd(Simd::to_float(Simd::byte(op[i], jj)), scale, min);
              const int64_t input = g * kGroup + 4 * i + jj;
              Simd::store(dst + input * n + nb * kRows + part * kLanes, value);
            }
          }
        }
      }
    }
  });
  return out;
}

// x [M, K] rounded to int8 per group (32 inputs, or a K format's 256): codes [rows >= M, K] (rows past M zero, for AMX's A
// tiles); per row and group the scale and scale * the codes' sum; per row and 32 inputs (a K format's 16) the codes' sum.
struct Quantized {
  torch::Tensor codes, code_sums, scales, sums;
};

Quantized quantize(const torch::Tensor& x, int64_t rows, bool super) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bf16, not ", x.scalar_type());
  const int64_t group = super ? kSuper : kGroup, summed = super ? 16 : kGroup;
  TORCH_CHECK(x.size(1) % group == 0, "x has ", x.size(1), " inputs, not a multiple of ", group);
  const int64_t m = x.size(0), k = x.size(1);
  Quantized q{torch::empty({rows, k}, torch::kInt8), torch::empty({m, k / summed}, torch::kInt),
              torch::empty({m, k / group}, torch::kFloat), torch::empty({m, k / group}, torch::kFloat)};
  q.codes.narrow(0, m, rows - m).zero_();
  const auto run = [&](const auto* in) {
    const auto call = [&](auto quantizer) {
      quantizer(in, m, k, q.codes.data_ptr<int8_t>(), q.code_sums.data_ptr<int32_t>(), q.scales.data_ptr<float>(), q.sums.data_ptr<float>());
    };
    using T = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    super ? call(quantize_activations<kSuper, 16, T>) : call(quantize_activations<kGroup, kGroup, T>);
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
// (on AMX tiles where `tiles` asks; a K format's `super_block` has no tile path), and how many rows of codes a pass of m
// rows reads (AMX's A tiles read whole tiles, so the codes are padded with zero rows).
template <int bits, typename Epilogue>
void pass(const PassInputs& in, bool tiles, const Epilogue& epilogue);
// Where a K format's register block of rows reads a group's operands: unpacked from the packed weights (a pass of one
// register block); unpacked and kept in the thread's buffer (a longer pass's first); or read back from it (its later
// ones, so that a pass unpacks each block's codes once for all its rows).
enum class Codes { kPacked, kUnpack, kUnpacked };

// Operand i of group j of super-block s, part `part` of the block, from `codes` (the group's packed codes) or `kept`
// (the block's unpacked operands: 64 bytes an operand, groups in order).
template <int bits, Codes source>
typename Simd::I super_operand(const uint8_t* codes, uint8_t* kept, int64_t s, int j, int i, int part) {
  const auto at = [&] { return kept + ((s * 8 + j) * 8 + i) * 64 + part * 64 / kParts; };
  if constexpr (source == Codes::kUnpacked) return Simd::load_operand(at());
  const typename Simd::I op = Simd::template operand<bits>(codes, part, i);
  if constexpr (source == Codes::kUnpack) Simd::store_operand(at(), op);
  return op;
}

template <int bits, int tokens, Codes source, typename Epilogue>
void super_block(const PassInputs& in, int64_t t0, int64_t nb, uint8_t* kept, const Epilogue& epilogue);
int64_t padded_rows(int64_t m, bool tiles);

// A K format's pass: its blocks of 16 rows over the threads, Simd::kSuperTokens activation rows a register block
// (the ISA's `super_block`); a pass of more rows unpacks each block's codes once, into a buffer its later register
// blocks read (a Q6_K operand takes six instructions to unpack, one to load).
template <int bits, typename Epilogue>
void super_pass(const PassInputs& in, const Epilogue& epilogue) {
  constexpr int64_t most = Simd::kSuperTokens;
  const bool keep = in.m > most;
  const int64_t kept_bytes = keep ? in.k / kSuper * 8 * 8 * 64 : 0;
  at::parallel_for(0, in.n / kRows, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint8_t, decltype(&std::free)> kept(
        static_cast<uint8_t*>(keep ? std::aligned_alloc(64, kept_bytes) : nullptr), &std::free);
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t t0 = 0; t0 < in.m; t0 += most) {
        with_count<most>(std::min(most, in.m - t0), [&](auto tokens) {
          constexpr int count = decltype(tokens)::value;
          if (!keep) {
            super_block<bits, count, Codes::kPacked>(in, t0, nb, kept.get(), epilogue);
          } else if (t0 == 0) {
            super_block<bits, count, Codes::kUnpack>(in, t0, nb, kept.get(), epilogue);
          } else {
            super_block<bits, count, Codes::kUnpacked>(in, t0, nb, kept.get(), epilogue);
          }
        });
      }
    }
  });
}

// One pass over x's codes with `epilogue`.
template <typename Epilogue>
void run_pass(const Quantized& q, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles, const Epilogue& epilogue) {
  const int64_t k = q.codes.size(1);
  TORCH_CHECK(k == inputs_of(packed), "x has ", k, " inputs; the weights take ", inputs_of(packed));
  const PassInputs in{q.codes.data_ptr<int8_t>(), q.code_sums.data_ptr<int32_t>(), q.scales.size(0), k, packed.size(0) * kRows,
                      packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>())};
  with_format(packed, [&](auto bits, auto super) {
    if constexpr (decltype(super)::value) {
      super_pass<decltype(bits)::value>(in, epilogue);
    } else {
      pass<decltype(bits)::value>(in, tiles, epilogue);
    }
  });
}

template <typename T>
Linear<T> linear_into(const Quantized& q, torch::Tensor& out) {
  return {q.scales.data_ptr<float>(), q.sums.data_ptr<float>(), q.scales.size(1), out.size(1), out.data_ptr<T>()};
}

torch::Tensor dequantize_weights_t(const torch::Tensor& packed, const torch::Tensor& scale_min, bool float32) {
  torch::Tensor out;
  with_format(packed, [&](auto bits, auto super) {
    constexpr int b = decltype(bits)::value;
    constexpr bool s = decltype(super)::value;
    out = float32 ? dequantize_t<float, b, s>(packed, scale_min) : dequantize_t<at::BFloat16, b, s>(packed, scale_min);
  });
  return out;
}

// The packed format's activation rounding: a K format's per 256 inputs, with no AMX path.
Quantized quantize_for(const torch::Tensor& x, const torch::Tensor& packed, bool tiles) {
  const bool super = format_of(packed).super;
  return quantize(x, padded_rows(x.size(0), tiles && !super), super);
}

// y [M, N] = x [M, K] @ dequant(packed).T, in x's dtype (float32 or bf16).
torch::Tensor quantized_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles) {
  const Quantized q = quantize_for(x, packed, tiles);
  torch::Tensor out = torch::empty({x.size(0), packed.size(0) * kRows}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    run_pass(q, packed, scale_min, tiles, linear_into<at::BFloat16>(q, out));
  } else {
    run_pass(q, packed, scale_min, tiles, linear_into<float>(q, out));
  }
  return out;
}

// The int32 sums of each token, group and output row, as a pass computes them: [M, K/32, N], or a K format's
// [M, K/256, 2, N] (sum(sc * q . a), then sum(m * sum(a))).
torch::Tensor group_sums(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool tiles) {
  const Quantized q = quantize_for(x, packed, tiles);
  const int64_t groups = packed.size(1), n = packed.size(0) * kRows;
  torch::Tensor out = format_of(packed).super ? torch::empty({x.size(0), groups, 2, n}, torch::kInt)
                                              : torch::empty({x.size(0), groups, n}, torch::kInt);
  run_pass(q, packed, scale_min, tiles, Sums{groups, n, out.data_ptr<int32_t>()});
  return out;
}

// Every byte of `bytes` read once, two threads' shares at a time, nothing else: the machine's read rate, the bound a
// one-token step's weights are read at (step_costs compares the step with it). The XOR is returned so that the reads
// stay.
int64_t read_all(const torch::Tensor& bytes) {
  TORCH_CHECK(bytes.is_contiguous() && bytes.nbytes() % 64 == 0, "bytes must be contiguous, a multiple of 64 bytes");
  const auto* words = reinterpret_cast<const uint64_t*>(bytes.data_ptr());
  const int64_t count = bytes.nbytes() / 8;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, count / 8, 4096, [&](int64_t begin, int64_t end) {
    uint64_t lanes[8] = {};
    for (int64_t at = begin * 8; at < end * 8; at += 8)
      for (int lane = 0; lane < 8; ++lane) lanes[lane] ^= words[at + lane];
    uint64_t folded = 0;
    for (uint64_t lane : lanes) folded ^= lane;
    total.fetch_xor(folded, std::memory_order_relaxed);
  });
  return static_cast<int64_t>(total.load());
}

}  // namespace

#include "step_ops.h"

// The functions every ISA's extension has.
#define QUANT_KERNEL_MODULE(module)                                                                                   \
  module.def("dequantize_t", &dequantize_weights_t, "the weights as bf16 (or float32) [K, N]", pybind11::arg("packed"),   \
             pybind11::arg("scale_min"), pybind11::arg("float32") = false);                                           \
  module.def("mm", &quantized_mm, "y = x @ dequant(int4 or int8 weights).T with int8 activations (tiles: AMX-INT8)"); \
  module.def("group_sums", &group_sums, "the int32 sums per token, group and output row (tests)");                  \
  module.def("set_far_prefetch", [](int64_t groups) { far_ahead.store(groups, std::memory_order_relaxed); },           \
             "groups of weights prefetched into L2 beyond the near prefetch, 0 for none (the same bits)");           \
  module.def("far_prefetch", [] { return far_ahead.load(std::memory_order_relaxed); }, "set_far_prefetch's value");   \
  module.def("read_all", &read_all, "every byte read once on the threads, nothing else (the machine's read rate)");     \
  STEP_OPS_MODULE(module)
