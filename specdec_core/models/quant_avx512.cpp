// The quantized linear layer on AVX-512 VNNI, and on AMX-INT8 tiles for passes of several rows
// (quant_kernel.h has the layout and what every ISA shares).
//
// A one-token pass multiplies each group's 8 operands by 4 broadcast activation codes with
// `vpdpbusd`, 64 weight codes per instruction, 16 output rows in one register's int32 lanes.
//
// Passes of several rows (verify passes, short prefills) can take the integer sums from AMX tiles
// instead (vnni.py chooses where): `tdpbsud` multiplies up to 16 activation rows (A, signed) by one
// group's 8 operands, which are exactly a B tile's 8 rows of 64 bytes (int8 loads them in place;
// int4 and int6 unpack them to bytes first), into a 16 x 16 tile of int32 sums.
#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#ifdef SPECDEC_KERNEL_EMULATION
// tests/kernel_emulation.h: this code on a CPU without AVX-512 or AMX (slow: it checks the logic).
#include "kernel_emulation.h"
#else
#include <immintrin.h>

#include "amx_tiles.h"
#endif

// AVX-512's 16 float or int32 lanes: one lane per output row of a block.
struct Simd {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int64_t kSuperTokens = 8;  // a K format's activation rows per register block
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I byte(I a, int j) { return _mm512_and_si512(_mm512_srli_epi32(a, 8 * j), _mm512_set1_epi32(0xFF)); }
  // Activations and results are float32 or bf16, read and written as such (no conversion passes).
  static F load(const float* in) { return _mm512_loadu_ps(in); }
  static F load(const at::BFloat16* in) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F load_half(const uint16_t* in) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in))); }
  // 16 bytes, one per lane, as int32 (a K format's sub-scales).
  static I widen(const uint8_t* in) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))); }
  static I widen(const int8_t* in) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))); }
  // (a >> shift) & mask, and low | high << 4, lane by lane (a K format's 6-bit sub-scales).
  static I field(I a, int shift, int mask) { return _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(mask)); }
  static I with_high(I low, I high) { return _mm512_or_si512(low, _mm512_slli_epi32(high, 4)); }
  static void store(float* out, F values) { _mm512_storeu_ps(out, values); }
  // To bf16, rounding to nearest even (plain AVX-512F, so no bf16 instructions needed).
  static void store(at::BFloat16* out, F values) {
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  static void store_ints(int32_t* out, I values) { _mm512_storeu_si512(out, values); }
  // Rounds to int32 codes (nearest even), stores them as int8, returns their sum.
  static int32_t round_and_store(F values, int8_t* out) {
    const __m512i q = _mm512_cvtps_epi32(values);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q));
    return _mm512_reduce_add_epi32(q);
  }
  // The 8 operands of one group of one 16-row block (quant_kernel.h's layout); one register each, so part is 0.
  template <int bits>
  static void operands(const uint8_t* w, int, I op[8]) {
    for (int i = 0; i < 8; ++i) op[i] = operand<bits>(w, i);
  }
  template <int bits>
  static I operand(const uint8_t* w, int, int i) { return operand<bits>(w, i); }  // the one part of a block
  static I load_operand(const uint8_t* at) { return _mm512_load_si512(at); }
  static void store_operand(uint8_t* at, I op) { _mm512_store_si512(at, op); }
  // Operand i: int4 operands 2c and 2c + 1 are the low and high nibbles of 64-byte chunk c; int6 adds
  // bits 2(i % 4) and 2(i % 4) + 1 of chunk 4 + i / 4 as the code's bits 4 and 5.
  template <int bits>
  static I operand(const uint8_t* w, int i) {
    if constexpr (bits == 8) {
      return _mm512_loadu_si512(w + 64 * i);
    } else {
      const __m512i bytes = _mm512_loadu_si512(w + 64 * (i / 2));
      const __m512i low = _mm512_and_si512(i % 2 ? _mm512_srli_epi16(bytes, 4) : bytes, _mm512_set1_epi8(0x0F));
      if constexpr (bits == 4) return low;
      const __m512i tops = _mm512_loadu_si512(w + 64 * (4 + i / 4));
      const int up = 4 - 2 * (i % 4);  // moves the operand's 2 bits to bits 4 and 5 (16-bit shifts: masked after)
      const __m512i moved = up > 0 ? _mm512_slli_epi16(tops, up) : up < 0 ? _mm512_srli_epi16(tops, -up) : tops;
      return _mm512_or_si512(low, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
    }
  }
};

#include "quant_kernel.h"

namespace {

constexpr int64_t kTokens = 8;  // activation rows per register block
// 16-row blocks per register block of at most kTokens / 2 rows (decode and short verify passes), chosen at start
// (vnni.register_blocks, by timing both): 2 broadcasts a row's codes once for both and keeps two weight streams in
// flight (on a Xeon, 1-4 rows: 0.85-0.98x the time of one block at a time); on an AMD EPYC (Zen 4) one block at a
// time is faster (one row of 8960 x 1536: 0.18 against 0.28 ms). With more rows two blocks' sums and accumulators
// outgrow the 32 registers (8 rows: 1.17x), so those take one block at a time. docs/QUANT.md.
constexpr int64_t kMostBlocks = 2;
std::atomic<int64_t> register_blocks{kMostBlocks};

// VNNI: `tokens` (<= kTokens) activation rows starting at t0, `blocks` 16-row blocks from nb. A row's 4 codes are
// broadcast once for all the blocks, and every row's sums are in flight at once.
template <int bits, int tokens, int blocks, typename Epilogue>
void block(const PassInputs& in, int64_t t0, int64_t nb, const Epilogue& epilogue) {
  // Independent vpdpbusd chains per row and block: a single chain of eight dependent ones would wait on latency,
  // so a pass of few rows splits each row's eight into several chains (integer sums: the split changes nothing).
  constexpr int chains = tokens * blocks >= 4 ? 1 : 4 / (tokens * blocks);
  const int64_t groups = in.k / kGroup;
  __m512 acc[tokens][blocks];
  for (int t = 0; t < tokens; ++t)
    for (int b = 0; b < blocks; ++b) acc[t][b] = _mm512_setzero_ps();
  const uint8_t* w = in.w + nb * groups * group_bytes<bits>();
  const uint16_t* sm = in.sm + nb * groups * 32;
  const int64_t w_block = groups * group_bytes<bits>(), sm_block = groups * 32;
  for (int64_t g = 0; g < groups; ++g, w += group_bytes<bits>(), sm += 32) {
    for (int b = 0; b < blocks; ++b) prefetch_group<bits>(w + b * w_block, sm + b * sm_block);
    __m512i dot[tokens][blocks][chains];
    for (int t = 0; t < tokens; ++t)
      for (int b = 0; b < blocks; ++b)
        for (int c = 0; c < chains; ++c) dot[t][b][c] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      __m512i op[blocks];
      for (int b = 0; b < blocks; ++b) op[b] = Simd::operand<bits>(w + b * w_block, i);
      for (int t = 0; t < tokens; ++t) {
        int32_t four;
        std::memcpy(&four, in.codes + (t0 + t) * in.k + g * kGroup + 4 * i, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int b = 0; b < blocks; ++b) dot[t][b][i % chains] = _mm512_dpbusd_epi32(dot[t][b][i % chains], op[b], a);
      }
    }
    for (int b = 0; b < blocks; ++b) {
      const __m512 scale = group_scale(sm + b * sm_block, 0), min = group_min(sm + b * sm_block, 0);
      for (int t = 0; t < tokens; ++t) {
        __m512i sum = dot[t][b][0];
        for (int c = 1; c < chains; ++c) sum = _mm512_add_epi32(sum, dot[t][b][c]);
        epilogue.add(acc[t][b], sum, scale, min, t0 + t, g, (nb + b) * kRows);
      }
    }
  }
  for (int t = 0; t < tokens; ++t)
    for (int b = 0; b < blocks; ++b) epilogue.finish(acc[t][b], t0 + t, (nb + b) * kRows);
}

template <int bits, typename Epilogue>
void vnni_pass(const PassInputs& in, const Epilogue& e) {
  const int64_t blocks = in.n / kRows, together = register_blocks.load(std::memory_order_relaxed);
  at::parallel_for(0, (blocks + together - 1) / together, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t nb = pair * together;
      for (int64_t t0 = 0; t0 < in.m; t0 += kTokens) {
        with_count<kTokens>(std::min(kTokens, in.m - t0), [&](auto tokens) {
          constexpr int count = decltype(tokens)::value;
          if (together == kMostBlocks && count * kMostBlocks <= kTokens && nb + kMostBlocks <= blocks) {
            block<bits, count, kMostBlocks>(in, t0, nb, e);
          } else {
            for (int64_t b = nb; b < std::min(nb + together, blocks); ++b) block<bits, count, 1>(in, t0, b, e);
          }
        });
      }
    }
  });
}

// A K format (quant_kernel.h): `tokens` (<= kTokens) activation rows from t0, one 16-row block. Per group the codes'
// sums per 16 inputs (vpdpbusd) times their integer sub-scales (vpmulld) add up over the super-block; per super-block
// the mins, two entries a lane as int16, times the activations' sums (vpdpwssd); then one float epilogue.
template <int bits, int tokens, Codes source, typename Epilogue>
void super_block(const PassInputs& in, int64_t t0, int64_t nb, uint8_t* kept, const Epilogue& epilogue) {
  constexpr int chains = tokens == 1 ? 2 : 1;  // per 16 inputs: a one-row pass splits its chains, as `block` does
  constexpr int pairs = min_entries<bits>() / 2;
  const int64_t supers = in.k / kSuper, sums16 = in.k / 16;
  const uint8_t* w = in.w + nb * supers * super_bytes<bits>();
  const uint16_t* dm = in.sm + nb * supers * super_scales<bits>();
  __m512 acc[tokens];
  for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s, w += super_bytes<bits>(), dm += super_scales<bits>()) {
    const uint8_t* sub = w + 8 * group_bytes<bits>();
    __m512i tot[tokens];
    for (int t = 0; t < tokens; ++t) tot[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      if (source != Codes::kUnpacked) prefetch_super<bits>(w, dm, j);
      const uint8_t* codes = w + j * group_bytes<bits>();
      __m512i dot[tokens][kHalves<bits>][chains];
      for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < kHalves<bits>; ++h)
          for (int c = 0; c < chains; ++c) dot[t][h][c] = _mm512_setzero_si512();
#pragma GCC unroll 8  // else dot[t][i / 4] is indexed at run time and lives in memory: 8-row passes took 2x the time
      for (int i = 0; i < 8; ++i) {
        const __m512i op = super_operand<bits, source>(codes, kept, s, j, i, 0);
        for (int t = 0; t < tokens; ++t) {
          int32_t four;
          std::memcpy(&four, in.codes + (t0 + t) * in.k + s * kSuper + j * kGroup + 4 * i, 4);
          dot[t][i / 4 % kHalves<bits>][i % chains] = _mm512_dpbusd_epi32(dot[t][i / 4 % kHalves<bits>][i % chains], op, _mm512_set1_epi32(four));
        }
      }
      const __m512i low = sub_scale<bits>(sub, j, 0, 0), high = sub_scale<bits>(sub, j, 1, 0);
      for (int t = 0; t < tokens; ++t) {
        __m512i half[kHalves<bits>];
        for (int h = 0; h < kHalves<bits>; ++h) {
          half[h] = dot[t][h][0];
          for (int c = 1; c < chains; ++c) half[h] = _mm512_add_epi32(half[h], dot[t][h][c]);
        }
        const __m512i scaled = kHalves<bits> == 1 ? _mm512_mullo_epi32(half[0], low)
                                           : _mm512_add_epi32(_mm512_mullo_epi32(half[0], low), _mm512_mullo_epi32(half[1], high));
        tot[t] = _mm512_add_epi32(tot[t], scaled);
      }
    }
    __m512i mins[pairs];
    for (int p = 0; p < pairs; ++p) {
      mins[p] = _mm512_or_si512(_mm512_and_si512(entry_min<bits>(sub, 2 * p, 0), _mm512_set1_epi32(0xFFFF)),
                                _mm512_slli_epi32(entry_min<bits>(sub, 2 * p + 1, 0), 16));
    }
    const auto [d, dmin] = super_scale_min<bits>(dm, 0);
    for (int t = 0; t < tokens; ++t) {
      const int32_t* sums = in.code_sums + (t0 + t) * sums16 + s * 16;
      __m512i mtot = _mm512_setzero_si512();
      for (int p = 0; p < pairs; ++p) {
        const uint32_t two = static_cast<uint16_t>(entry_sum<bits>(sums, 2 * p)) | static_cast<uint32_t>(entry_sum<bits>(sums, 2 * p + 1)) << 16;
        mtot = _mm512_dpwssd_epi32(mtot, mins[p], _mm512_set1_epi32(static_cast<int32_t>(two)));
      }
      epilogue.add_super(acc[t], tot[t], mtot, d, dmin, t0 + t, s, nb * kRows);
    }
  }
  for (int t = 0; t < tokens; ++t) epilogue.finish(acc[t], t0 + t, nb * kRows);
}

// AMX. Tiles: tmm0-1 B (one group's 8 weight operands, groups alternating), tmm2-3 A (`rows`
// activation rows x 32 codes), tmm4-7 C (rows x 16 int32 sums), a ring of 4, so that the tile
// unit works kLag groups ahead of the float epilogue instead of waiting on it.
constexpr int64_t kTileRows = 16, kLag = 2, kSlots = 4, kOperandBytes = 8 * 64;
// int4 and int6 groups are unpacked to bytes this many groups before their tile load reads them: a tile load waits for
// stores to the bytes it reads to leave the core, and at once that wait cost a pass of 2-16 rows 1.2-1.3x its time
// (8960 x 1536 on a Xeon with AMX, 2 threads: 0.51 against 0.39 ms at 2 rows, 0.66 against 0.54 at 16).
constexpr int64_t kUnpackAhead = 2;

TileConfig tile_shapes(int64_t rows) {
  TileConfig config;
  for (int b = 0; b < 2; ++b) config.rows[b] = 8, config.colsb[b] = 64;
  for (int a = 2; a < 4; ++a) config.rows[a] = rows, config.colsb[a] = kGroup;
  for (int c = 4; c < 8; ++c) config.rows[c] = rows, config.colsb[c] = kRows * sizeof(int32_t);
  return config;
}

// Tile numbers are immediates: f gets g's slot of the ring as a compile-time constant.
template <typename F>
void with_slot(int64_t g, F&& f) {
  switch (g % kSlots) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}

// `tokens` (<= 16) activation rows from t0, one block of 16 rows; the A tiles read the configured
// rows (>= tokens; codes past M are zero). int8 operands load straight from the packed weights;
// int4 and int6 ones from `unpacked` (the block's groups as bytes), which the block's first call (`first`,
// the one that streams the weights from memory) fills and its later calls, for later tokens, reuse.
template <int bits, int tokens, typename Epilogue>
void amx_block(const PassInputs& in, int64_t t0, int64_t nb, uint8_t* unpacked, bool first, const Epilogue& epilogue) {
  const int64_t groups = in.k / kGroup;
  const uint8_t* w = in.w + nb * groups * group_bytes<bits>();
  const uint16_t* sm = in.sm + nb * groups * 32;
  alignas(64) int32_t sums[kSlots][kTileRows][kRows];
  __m512 acc[tokens];
  for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
  const auto unpack = [&](int64_t g) {
    __m512i op[8];
    Simd::operands<bits>(w + g * group_bytes<bits>(), 0, op);
    for (int i = 0; i < 8; ++i) _mm512_store_si512(unpacked + g * kOperandBytes + 64 * i, op[i]);
  };
  if constexpr (bits != 8) {
    if (first) for (int64_t g = 0; g < std::min(kUnpackAhead, groups); ++g) unpack(g);
  }
  const auto issue = [&](auto slot, int64_t g) {
    constexpr int s = decltype(slot)::value;
    if (first) prefetch_group<bits>(w + g * group_bytes<bits>(), sm + g * 32);
    const uint8_t* b = w + g * group_bytes<bits>();
    if constexpr (bits != 8) {
      b = unpacked + g * kOperandBytes;
      if (first && g + kUnpackAhead < groups) unpack(g + kUnpackAhead);
    }
    tile_load<s % 2>(b, 64);
    tile_load<2 + s % 2>(in.codes + t0 * in.k + g * kGroup, in.k);
    tile_zero<4 + s>();
    tile_dpbsud<4 + s, 2 + s % 2, s % 2>();
    tile_store<4 + s>(sums[s], kRows * sizeof(int32_t));
  };
  const auto drain = [&](int64_t g) {
    const __m512 scale = group_scale(sm + g * 32, 0), min = group_min(sm + g * 32, 0);
    for (int t = 0; t < tokens; ++t) epilogue.add(acc[t], _mm512_load_si512(sums[g % kSlots][t]), scale, min, t0 + t, g, nb * kRows);
  };
  for (int64_t g = 0; g < groups + kLag; ++g) {
    if (g < groups) with_slot(g, [&](auto slot) { issue(slot, g); });
    if (g >= kLag) drain(g - kLag);
  }
  for (int t = 0; t < tokens; ++t) epilogue.finish(acc[t], t0 + t, nb * kRows);
}

std::atomic<bool> tiles_granted{false};

// Activation rows per A tile for a pass of m rows.
int64_t tile_rows(int64_t m) { return std::min(m, kTileRows); }

template <int bits, typename Epilogue>
void amx_pass(const PassInputs& in, const Epilogue& e) {
  TORCH_CHECK(tiles_granted, "the AMX path needs amx_enable() to have succeeded");
  const int64_t rows = tile_rows(in.m), unpacked_bytes = bits != 8 ? in.k / kGroup * kOperandBytes : 0;
  at::parallel_for(0, in.n / kRows, 1, [&](int64_t begin, int64_t end) {
    // Per thread and call: torch's own AMX kernels (oneDNN's bf16 matmuls) load their own shapes in between.
    tile_config(tile_shapes(rows));
    std::unique_ptr<uint8_t, decltype(&std::free)> unpacked(
        static_cast<uint8_t*>(unpacked_bytes ? std::aligned_alloc(64, unpacked_bytes) : nullptr), &std::free);
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t t0 = 0; t0 < in.m; t0 += rows) {
        with_count<kTileRows>(std::min(rows, in.m - t0), [&](auto tokens) {
          amx_block<bits, decltype(tokens)::value>(in, t0, nb, unpacked.get(), t0 == 0, e);
        });
      }
    }
    tile_release();
  });
}

template <int bits, typename Epilogue>
void pass(const PassInputs& in, bool tiles, const Epilogue& epilogue) {
  tiles ? amx_pass<bits>(in, epilogue) : vnni_pass<bits>(in, epilogue);
}

// The A tiles read whole tiles: the codes are padded to a multiple of the rows per tile.
int64_t padded_rows(int64_t m, bool tiles) {
  const int64_t rows = tiles ? tile_rows(m) : 1;
  return tiles && m > 0 ? (m + rows - 1) / rows * rows : m;
}

}  // namespace

bool amx_enable() {
  tiles_granted = tiles_granted || request_tiles();
  return tiles_granted;
}

void set_register_blocks(int64_t blocks) {
  TORCH_CHECK(blocks == 1 || blocks == kMostBlocks, "register blocks: 1 or ", kMostBlocks, ", not ", blocks);
  register_blocks.store(blocks, std::memory_order_relaxed);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  QUANT_KERNEL_MODULE(module);
  module.def("amx_enable", &amx_enable, "ask Linux for the AMX tile state (once); whether the AMX path may run");
  module.def("set_register_blocks", &set_register_blocks,
             "16-row blocks a short pass's register block holds: 1 or 2 (the same bits, a CPU's own speed)");
  module.def("register_blocks", [] { return register_blocks.load(std::memory_order_relaxed); }, "set_register_blocks' value");
}
