// The quantized linear layer on AVX2, for CPUs without AVX-512 VNNI (AMD Zen 2 and 3, Intel before
// Ice Lake), where torch's int4 kernel would multiply in floats once per token (quant_kernel.h has
// the layout and what every ISA shares).
//
// AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies 32 unsigned weight codes by 32 signed activation
// codes and adds neighbouring products into int16, saturating, and `vpmaddwd` by ones adds those
// pairs into int32. A block's 64-byte operand is two registers here, rows 0-7 and rows 8-15 (its two
// parts); a register block takes both parts for up to 4 activation rows, so each row's codes are
// broadcast once for both (one part at a time, the codes were broadcast twice and the weights unpacked
// twice as often: passes of 4-32 rows took 1.1-1.25x longer, docs/QUANT.md).
// - int4: a pair is at most 2 * 15 * 127 = 3,810 in size, so a group's 8 operands add up in int16
//   (at most 30,480 < 32,767) before one `vpmaddwd`.
// - int6: a pair is at most 2 * 63 * 127 = 16,002, but 8 operands' pairs would not add up in int16,
//   so each operand's pairs are widened to int32 at once (`vpmaddwd` by ones).
// - int8: codes 0..255 would saturate (2 * 255 * 127 = 64,770). Each code is taken as s = q - 128
//   (its top bit flipped), `vpmaddubsw` multiplies |s| (0..128, unsigned) by the activation code
//   with s's sign (|a| <= 127), at most 2 * 128 * 127 = 32,512 a pair, and 128 * the activations'
//   code sum is added back: sum(q * a) = sum(s * a) + 128 * sum(a).
// Either way the int32 sums are exact, the same integers as VNNI's and AMX's.
//
// Built a second time with SPECDEC_AVX_VNNI (the avxvnni family, for CPUs with AVX-VNNI but no AVX-512
// VNNI: Intel's Alder Lake and later client cores, its E-core servers) it takes AVX-VNNI's `vpdpbusd` on
// ymm instead: unsigned codes times signed activation codes, each 4 products added into int32 without
// saturation, for int4 and int8 alike, one instruction where the above takes two or three.
#include <torch/extension.h>
#ifdef SPECDEC_KERNEL_EMULATION
// tests/kernel_emulation.h: this code on a CPU without AVX-VNNI (slow: it checks the logic).
#include "kernel_emulation.h"
#else
#include <immintrin.h>
#endif

#include <cstring>
#include <type_traits>

// AVX2's 8 float or int32 lanes: one lane per output row of a part.
struct Simd {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int64_t kSuperTokens = 4;  // a K format's activation rows per register block, both parts
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float reduce_max(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I byte(I a, int j) { return _mm256_and_si256(_mm256_srli_epi32(a, 8 * j), _mm256_set1_epi32(0xFF)); }
  static F load(const float* in) { return _mm256_loadu_ps(in); }
  static F load(const at::BFloat16* in) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F load_half(const uint16_t* in) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))); }
  // 8 bytes, one per lane, as int32 (a K format's sub-scales).
  static I widen(const uint8_t* in) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in))); }
  static I widen(const int8_t* in) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in))); }
  // (a >> shift) & mask, and low | high << 4, lane by lane (a K format's 6-bit sub-scales).
  static I field(I a, int shift, int mask) { return _mm256_and_si256(_mm256_srli_epi32(a, shift), _mm256_set1_epi32(mask)); }
  static I with_high(I low, I high) { return _mm256_or_si256(low, _mm256_slli_epi32(high, 4)); }
  static void store(float* out, F values) { _mm256_storeu_ps(out, values); }
  // To bf16, rounding to nearest even: the AVX-512 path's integer steps, lane by lane.
  static void store(at::BFloat16* out, F values) {
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i words = _mm256_packus_epi32(high, high);  // per 128-bit half: its 4 lanes, twice
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(_mm256_permute4x64_epi64(words, 0b1000)));
  }
  static void store_ints(int32_t* out, I values) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), values); }
  // Rounds to int32 codes (nearest even), stores them as int8 (they lie in -127..127), returns their sum.
  static int32_t round_and_store(F values, int8_t* out) {
    const __m256i q = _mm256_cvtps_epi32(values);
    const __m256i words = _mm256_packs_epi32(q, q);
    const __m256i bytes = _mm256_packs_epi16(words, words);  // per 128-bit half: its 4 codes in the low 4 bytes
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(ordered));
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01001110));
    return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b10110001)));
  }
  // The 8 operands of one group, for the block's rows 8 * part .. 8 * part + 7.
  template <int bits>
  static void operands(const uint8_t* w, int part, I op[8]) {
    for (int i = 0; i < 8; ++i) op[i] = operand<bits>(w, part, i);
  }
  static I load_operand(const uint8_t* at) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(at)); }
  static void store_operand(uint8_t* at, I op) { _mm256_store_si256(reinterpret_cast<__m256i*>(at), op); }
  // Operand i of one group for one part: int4 operands 2c and 2c + 1 are the low and high nibbles of 64-byte chunk
  // c; int6 adds bits 2(i % 4) and 2(i % 4) + 1 of chunk 4 + i / 4 as the code's bits 4 and 5.
  template <int bits>
  static I operand(const uint8_t* w, int part, int i) {
    if constexpr (bits == 8) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * i + 32 * part));
    } else {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * (i / 2) + 32 * part));
      const __m256i low = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
      if constexpr (bits == 4) return low;
      const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * (4 + i / 4) + 32 * part));
      const int up = 4 - 2 * (i % 4);  // moves the operand's 2 bits to bits 4 and 5 (16-bit shifts: masked after)
      const __m256i moved = up > 0 ? _mm256_slli_epi16(tops, up) : up < 0 ? _mm256_srli_epi16(tops, -up) : tops;
      return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
    }
  }
};

#include "quant_kernel.h"

namespace {

constexpr int64_t kTokens = 4;  // activation rows per register block, both parts: 2 and 6 measured slower

#ifdef SPECDEC_AVX_VNNI
constexpr bool kVnni = true;
// One operand's products with one row's 4 activation codes `a` (broadcast), added into the row's int32 sums.
template <int bits>
__m256i accumulate(__m256i dot, __m256i op, __m256i, __m256i, __m256i a) { return _mm256_dpbusd_avx_epi32(dot, op, a); }
// A group's int32 sums from what `accumulate` gathered.
template <int bits>
__m256i group_sum(__m256i dot, int32_t) { return dot; }
#else
constexpr bool kVnni = false;
// int4: int16 pair sums (no saturation, header); int6: pair sums widened at once; int8: |s| times the activations
// with s's sign, widened at once. `magnitude` and `shifted` are |s| and s of the operand (int8 only).
template <int bits>
__m256i accumulate(__m256i dot, __m256i op, __m256i magnitude, __m256i shifted, __m256i a) {
  if constexpr (bits == 4) return _mm256_add_epi16(dot, _mm256_maddubs_epi16(op, a));
  if constexpr (bits == 6) return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(op, a), _mm256_set1_epi16(1)));
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, shifted)), _mm256_set1_epi16(1)));
}
template <int bits>
__m256i group_sum(__m256i dot, int32_t code_sum) {
  if constexpr (bits == 4) return _mm256_madd_epi16(dot, _mm256_set1_epi16(1));
  if constexpr (bits == 6) return dot;
  return _mm256_add_epi32(dot, _mm256_set1_epi32(128 * code_sum));
}
#endif

// `tokens` (<= kTokens) activation rows starting at t0, both parts (16 rows) of one block: each row's 4 codes are
// broadcast once for both parts' operands.
template <int bits, int tokens, typename Epilogue>
void block(const PassInputs& in, int64_t t0, int64_t nb, const Epilogue& epilogue) {
  // `vpdpbusd` chains on its own sums: a pass of one row splits each part's eight into two independent chains,
  // so that they do not wait on its latency (integer sums: the split changes nothing).
  constexpr int chains = kVnni && tokens < 2 ? 2 : 1;
  const int64_t groups = in.k / kGroup, col = nb * kRows;
  const __m256i top_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[tokens][kParts];
  for (int t = 0; t < tokens; ++t)
    for (int p = 0; p < kParts; ++p) acc[t][p] = _mm256_setzero_ps();
  const uint8_t* w = in.w + nb * groups * group_bytes<bits>();
  const uint16_t* sm = in.sm + nb * groups * 32;
  for (int64_t g = 0; g < groups; ++g, w += group_bytes<bits>(), sm += 32) {
    prefetch_group<bits>(w, sm);
    __m256i dot[tokens][kParts][chains];
    for (int t = 0; t < tokens; ++t)
      for (int p = 0; p < kParts; ++p)
        for (int c = 0; c < chains; ++c) dot[t][p][c] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      __m256i op[kParts], shifted[kParts], magnitude[kParts];
      for (int p = 0; p < kParts; ++p) {
        op[p] = Simd::operand<bits>(w, p, i);
        shifted[p] = _mm256_xor_si256(op[p], top_bit), magnitude[p] = _mm256_abs_epi8(shifted[p]);  // int8: s, |s|
      }
      for (int t = 0; t < tokens; ++t) {
        int32_t four;
        std::memcpy(&four, in.codes + (t0 + t) * in.k + g * kGroup + 4 * i, 4);
        const __m256i a = _mm256_set1_epi32(four);
        for (int p = 0; p < kParts; ++p)
          dot[t][p][i % chains] = accumulate<bits>(dot[t][p][i % chains], op[p], magnitude[p], shifted[p], a);
      }
    }
    for (int p = 0; p < kParts; ++p) {
      const __m256 scale = group_scale(sm, p), min = group_min(sm, p);
      for (int t = 0; t < tokens; ++t) {
        __m256i sum = dot[t][p][0];
        for (int c = 1; c < chains; ++c) sum = _mm256_add_epi32(sum, dot[t][p][c]);
        epilogue.add(acc[t][p], group_sum<bits>(sum, in.code_sums[(t0 + t) * groups + g]), scale, min, t0 + t, g, col + p * kLanes);
      }
    }
  }
  for (int t = 0; t < tokens; ++t)
    for (int p = 0; p < kParts; ++p) epilogue.finish(acc[t][p], t0 + t, col + p * kLanes);
}

// Each lane's int32 as the same int16 twice (its low 16 bits): `vpmaddwd` by it multiplies both of a lane's pair
// sums by the lane's sub-scale.
__m256i twice(__m256i lanes) { return _mm256_or_si256(_mm256_and_si256(lanes, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(lanes, 16)); }

// A K format (quant_kernel.h): `tokens` (<= kTokens) activation rows from t0, both parts of one block. Per group the
// codes' sums times their integer sub-scales add up over the super-block: with AVX-VNNI, sums per 16 inputs times
// the sub-scales (vpmulld); on AVX2, `vpmaddubsw`'s int16 pair sums (Q4_K's 8 operands, Q6_K's 2: at most 30,480 and
// 32,004) widened by `vpmaddwd` with the sub-scale itself. Per super-block the mins, two entries a lane as int16,
// times the activations' sums (`vpmaddwd`); then one float epilogue. The same integers as AVX-512's.
template <int bits, int tokens, Codes source, typename Epilogue>
void super_block(const PassInputs& in, int64_t t0, int64_t nb, uint8_t* kept, const Epilogue& epilogue) {
  constexpr int pairs = min_entries<bits>() / 2;
  const int64_t supers = in.k / kSuper, sums16 = in.k / 16, col = nb * kRows;
  const uint8_t* w = in.w + nb * supers * super_bytes<bits>();
  const uint16_t* dm = in.sm + nb * supers * super_scales<bits>();
  __m256 acc[tokens][kParts];
  for (int t = 0; t < tokens; ++t)
    for (int p = 0; p < kParts; ++p) acc[t][p] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s, w += super_bytes<bits>(), dm += super_scales<bits>()) {
    const uint8_t* sub = w + 8 * group_bytes<bits>();
    __m256i tot[tokens][kParts];
    for (int t = 0; t < tokens; ++t)
      for (int p = 0; p < kParts; ++p) tot[t][p] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      if (source != Codes::kUnpacked) prefetch_super<bits>(w, dm, j);
      const uint8_t* codes = w + j * group_bytes<bits>();
      __m256i scale[2][kParts];  // per half of the group (Q4_K: both the same)
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < kParts; ++p) scale[h][p] = kVnni ? sub_scale<bits>(sub, j, h, p) : twice(sub_scale<bits>(sub, j, h, p));
      __m256i dot[tokens][kParts][kHalves<bits>];  // VNNI: int32 per sub-scale; AVX2: int16 pair sums since the last widening
      for (int t = 0; t < tokens; ++t)
        for (int p = 0; p < kParts; ++p)
          for (int h = 0; h < kHalves<bits>; ++h) dot[t][p][h] = _mm256_setzero_si256();
#pragma GCC unroll 8  // dot[t][p][i / 4] indexed at compile time, in registers
      for (int i = 0; i < 8; ++i) {
        __m256i op[kParts];
        for (int p = 0; p < kParts; ++p) op[p] = super_operand<bits, source>(codes, kept, s, j, i, p);
        for (int t = 0; t < tokens; ++t) {
          int32_t four;
          std::memcpy(&four, in.codes + (t0 + t) * in.k + s * kSuper + j * kGroup + 4 * i, 4);
          const __m256i a = _mm256_set1_epi32(four);
          for (int p = 0; p < kParts; ++p) {
#ifdef SPECDEC_AVX_VNNI
            dot[t][p][i / 4 % kHalves<bits>] = _mm256_dpbusd_avx_epi32(dot[t][p][i / 4 % kHalves<bits>], op[p], a);
#else
            dot[t][p][0] = _mm256_add_epi16(dot[t][p][0], _mm256_maddubs_epi16(op[p], a));
            if (bits == 6 && i % 2 == 1) {  // Q6_K: widen every 2 operands, before int16 could overflow
              tot[t][p] = _mm256_add_epi32(tot[t][p], _mm256_madd_epi16(dot[t][p][0], scale[i / 4][p]));
              dot[t][p][0] = _mm256_setzero_si256();
            }
#endif
          }
        }
      }
      for (int t = 0; t < tokens; ++t) {
        for (int p = 0; p < kParts; ++p) {
          if constexpr (kVnni) {
            tot[t][p] = _mm256_add_epi32(tot[t][p], bits == 4 ? _mm256_mullo_epi32(dot[t][p][0], scale[0][p])
                                                              : _mm256_add_epi32(_mm256_mullo_epi32(dot[t][p][0], scale[0][p]),
                                                                                 _mm256_mullo_epi32(dot[t][p][1], scale[1][p])));
          } else if constexpr (bits == 4) {
            tot[t][p] = _mm256_add_epi32(tot[t][p], _mm256_madd_epi16(dot[t][p][0], scale[0][p]));
          }
        }
      }
    }
    for (int p = 0; p < kParts; ++p) {
      __m256i mins[pairs];
      for (int e = 0; e < pairs; ++e) {
        mins[e] = _mm256_or_si256(_mm256_and_si256(entry_min<bits>(sub, 2 * e, p), _mm256_set1_epi32(0xFFFF)),
                                  _mm256_slli_epi32(entry_min<bits>(sub, 2 * e + 1, p), 16));
      }
      const auto [d, dmin] = super_scale_min<bits>(dm, p);
      for (int t = 0; t < tokens; ++t) {
        const int32_t* sums = in.code_sums + (t0 + t) * sums16 + s * 16;
        __m256i mtot = _mm256_setzero_si256();
        for (int e = 0; e < pairs; ++e) {
          const uint32_t two = static_cast<uint16_t>(entry_sum<bits>(sums, 2 * e)) | static_cast<uint32_t>(entry_sum<bits>(sums, 2 * e + 1)) << 16;
          mtot = _mm256_add_epi32(mtot, _mm256_madd_epi16(mins[e], _mm256_set1_epi32(static_cast<int32_t>(two))));
        }
        epilogue.add_super(acc[t][p], tot[t][p], mtot, d, dmin, t0 + t, s, col + p * kLanes);
      }
    }
  }
  for (int t = 0; t < tokens; ++t)
    for (int p = 0; p < kParts; ++p) epilogue.finish(acc[t][p], t0 + t, col + p * kLanes);
}

template <int bits, typename Epilogue>
void pass(const PassInputs& in, bool tiles, const Epilogue& epilogue) {
  TORCH_CHECK(!tiles, "the AVX2 kernels have no AMX path");
  at::parallel_for(0, in.n / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t t0 = 0; t0 < in.m; t0 += kTokens) {
        with_count<kTokens>(std::min(kTokens, in.m - t0), [&](auto tokens) { block<bits, decltype(tokens)::value>(in, t0, nb, epilogue); });
      }
    }
  });
}

int64_t padded_rows(int64_t m, bool) { return m; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { QUANT_KERNEL_MODULE(module); }
