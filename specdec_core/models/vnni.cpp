// int4 or int8 weights x int8 activations on AVX-512 VNNI and AMX-INT8: the CPU quantized linear
// layer (docs/QUANT.md).
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
// Passes of several rows (verify passes, short prefills) take the integer sums from AMX tiles
// instead: `tdpbsud` multiplies up to 16 activation rows (A, signed) by one group's 8 operands,
// which are exactly a B tile's 8 rows of 64 bytes (int8 loads them in place; int4 unpacks them to
// bytes first), into a 16 x 16 tile of int32 sums. Integer sums are exact either way, and the
// float epilogue per group is the same instructions in the same order, so the outputs of both
// paths are bit-identical: a row's result does not depend on how many rows share the pass, and
// a verify pass computes exactly what one-token steps do.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef SPECDEC_KERNEL_EMULATION
// tests/kernel_emulation.h: this code on a CPU without AVX-512 or AMX (slow: it checks the logic).
#include "kernel_emulation.h"
#else
#include <immintrin.h>

// The tile instructions, as inline asm with the operands the compiler must respect: GCC 12's
// `_tile_loadconfig` names only the config's first 8 bytes as read, so it may drop the stores of
// the rest (llama.cpp's AMX build fails so with GCC 12), and its `_tile_loadd` names no memory
// at all, so stores to an unpacked buffer could be sunk past the load. No -mamx-* flags needed.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline void tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" ::"m"(config)); }
inline void tile_release() { asm volatile("tilerelease" ::); }
template <int tile>
void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(tile) : "memory");
}
template <int tile>
void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(tile) : "memory");
}
template <int tile>
void tile_zero() { asm volatile("tilezero %%tmm%c0" ::"i"(tile)); }
// c += a (signed bytes) . b (unsigned bytes), 4 bytes per int32 lane.
template <int c, int a, int b>
void tile_dpbsud() { asm volatile("tdpbsud %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(b), "i"(a), "i"(c)); }

// Linux hands out the tile state (8 KB per thread) only to processes that ask, once.
bool request_tiles() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

namespace {

constexpr int64_t kRows = 16, kGroup = 32, kTokens = 8, kAhead = 8;  // kTokens: activation rows per register block

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

// A few groups ahead: one core's own prefetchers leave its share of the memory bandwidth unused.
template <int bits>
void prefetch_group(const uint8_t* w, const uint16_t* sm) {
  constexpr int64_t group_bytes = 8 * bits * 64 / 8;
  for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * group_bytes + line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sm + kAhead * 32), _MM_HINT_T0);
}

// What a pass does with the int32 sums of one token, one group and one block of 16 rows.
// Linear is vnni_mm's float epilogue: acc += sum * scale * xscale, then acc += min * xsum, groups in
// order. Both paths run exactly these instructions in this order, so their outputs are bit-identical.
template <typename T>
struct Linear {
  const float* scales;
  const float* sums;
  int64_t groups, n;
  T* out;
  void add(__m512& acc, __m512i sum, __m512 scale, __m512 min, int64_t row, int64_t g, int64_t) const {
    const int64_t at = row * groups + g;
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale), _mm512_set1_ps(scales[at]), acc);
    acc = _mm512_fmadd_ps(min, _mm512_set1_ps(sums[at]), acc);
  }
  void finish(__m512 acc, int64_t row, int64_t nb) const { store16(out + row * n + nb * kRows, acc); }
};

// The int32 sums themselves, [M, K/32, N]: for tests that compare the two paths' integers.
struct Sums {
  int64_t groups, n;
  int32_t* out;
  void add(__m512&, __m512i sum, __m512, __m512, int64_t row, int64_t g, int64_t nb) const {
    _mm512_storeu_si512(out + (row * groups + g) * n + nb * kRows, sum);
  }
  void finish(__m512, int64_t, int64_t) const {}
};

__m512 group_scale(const uint16_t* sm) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm))); }
__m512 group_min(const uint16_t* sm) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 16))); }

// VNNI: `tokens` (<= kTokens) activation rows starting at t0, one block of 16 rows. A group's operands are
// unpacked once for all `tokens` rows, and every row's sums are in flight at once.
template <int bits, int tokens, typename Epilogue>
void block(const uint8_t* packed, const uint16_t* scale_min, const int8_t* codes, int64_t k, int64_t t0, int64_t nb,
           const Epilogue& epilogue) {
  // Independent vpdpbusd chains per row: a single chain of eight dependent ones would wait on latency, so a
  // pass of few rows splits each row's eight into several chains (integer sums: the split changes nothing).
  constexpr int chains = tokens >= 4 ? 1 : 4 / tokens;
  const int64_t groups = k / kGroup, group_bytes = 8 * bits * 64 / 8;
  __m512 acc[tokens];
  for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* w = packed + nb * groups * group_bytes;
  const uint16_t* sm = scale_min + nb * groups * 32;
  for (int64_t g = 0; g < groups; ++g, w += group_bytes, sm += 32) {
    prefetch_group<bits>(w, sm);
    __m512i op[8];
    operands<bits>(w, op);
    __m512i dot[tokens][chains];
    for (int t = 0; t < tokens; ++t)
      for (int c = 0; c < chains; ++c) dot[t][c] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      for (int t = 0; t < tokens; ++t) {
        int32_t four;
        std::memcpy(&four, codes + (t0 + t) * k + g * kGroup + 4 * i, 4);
        dot[t][i % chains] = _mm512_dpbusd_epi32(dot[t][i % chains], op[i], _mm512_set1_epi32(four));
      }
    }
    const __m512 scale = group_scale(sm), min = group_min(sm);
    for (int t = 0; t < tokens; ++t) {
      __m512i sum = dot[t][0];
      for (int c = 1; c < chains; ++c) sum = _mm512_add_epi32(sum, dot[t][c]);
      epilogue.add(acc[t], sum, scale, min, t0 + t, g, nb);
    }
  }
  for (int t = 0; t < tokens; ++t) epilogue.finish(acc[t], t0 + t, nb);
}

// block with `count` (1..kTokens) rows as its compile-time `tokens`.
template <int bits, typename Epilogue, int tokens = kTokens>
void block_of(int64_t count, const uint8_t* w, const uint16_t* sm, const int8_t* codes, int64_t k, int64_t t0, int64_t nb,
              const Epilogue& e) {
  if constexpr (tokens > 1) {
    if (count < tokens) return block_of<bits, Epilogue, tokens - 1>(count, w, sm, codes, k, t0, nb, e);
  }
  block<bits, tokens>(w, sm, codes, k, t0, nb, e);
}

template <int bits, typename Epilogue>
void vnni_pass(const int8_t* codes, int64_t m, int64_t k, int64_t n, const uint8_t* w, const uint16_t* sm, const Epilogue& e) {
  at::parallel_for(0, n / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t t0 = 0; t0 < m; t0 += kTokens) block_of<bits>(std::min(kTokens, m - t0), w, sm, codes, k, t0, nb, e);
    }
  });
}

// AMX. Tiles: tmm0-1 B (one group's 8 weight operands, groups alternating), tmm2-3 A (`rows`
// activation rows x 32 codes), tmm4-7 C (rows x 16 int32 sums), a ring of 4, so that the tile
// unit works kLag groups ahead of the float epilogue instead of waiting on it.
constexpr int64_t kTileRows = 16, kLag = 2, kSlots = 4, kOperandBytes = 8 * 64;

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
// int4 ones from `unpacked` (the block's groups as bytes), which the block's first call (`first`,
// the one that streams the weights from memory) fills and its later calls, for later tokens, reuse.
template <int bits, int tokens, typename Epilogue>
void amx_block(const uint8_t* packed, const uint16_t* scale_min, const int8_t* codes, int64_t k, int64_t t0, int64_t nb,
               uint8_t* unpacked, bool first, const Epilogue& epilogue) {
  const int64_t groups = k / kGroup, group_bytes = 8 * bits * 64 / 8;
  const uint8_t* w = packed + nb * groups * group_bytes;
  const uint16_t* sm = scale_min + nb * groups * 32;
  alignas(64) int32_t sums[kSlots][kTileRows][kRows];
  __m512 acc[tokens];
  for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
  const auto issue = [&](auto slot, int64_t g) {
    constexpr int s = decltype(slot)::value;
    if (first) prefetch_group<bits>(w + g * group_bytes, sm + g * 32);
    const uint8_t* b = w + g * group_bytes;
    if constexpr (bits == 4) {
      b = unpacked + g * kOperandBytes;
      if (first) {
        __m512i op[8];
        operands<4>(w + g * group_bytes, op);
        for (int i = 0; i < 8; ++i) _mm512_store_si512(unpacked + g * kOperandBytes + 64 * i, op[i]);
      }
    }
    tile_load<s % 2>(b, 64);
    tile_load<2 + s % 2>(codes + t0 * k + g * kGroup, k);
    tile_zero<4 + s>();
    tile_dpbsud<4 + s, 2 + s % 2, s % 2>();
    tile_store<4 + s>(sums[s], kRows * sizeof(int32_t));
  };
  const auto drain = [&](int64_t g) {
    const __m512 scale = group_scale(sm + g * 32), min = group_min(sm + g * 32);
    for (int t = 0; t < tokens; ++t) epilogue.add(acc[t], _mm512_load_si512(sums[g % kSlots][t]), scale, min, t0 + t, g, nb);
  };
  for (int64_t g = 0; g < groups + kLag; ++g) {
    if (g < groups) with_slot(g, [&](auto slot) { issue(slot, g); });
    if (g >= kLag) drain(g - kLag);
  }
  for (int t = 0; t < tokens; ++t) epilogue.finish(acc[t], t0 + t, nb);
}

// amx_block with `count` (1..16) tokens as its compile-time `tokens` (the accumulators stay in registers).
template <int bits, typename Epilogue, int tokens = kTileRows>
void amx_block_of(int64_t count, const uint8_t* w, const uint16_t* sm, const int8_t* codes, int64_t k, int64_t t0,
                  int64_t nb, uint8_t* unpacked, bool first, const Epilogue& e) {
  if constexpr (tokens > 1) {
    if (count < tokens) return amx_block_of<bits, Epilogue, tokens - 1>(count, w, sm, codes, k, t0, nb, unpacked, first, e);
  }
  amx_block<bits, tokens>(w, sm, codes, k, t0, nb, unpacked, first, e);
}

std::atomic<bool> tiles_granted{false};

// Activation rows per A tile for a pass of m rows; the codes are padded to a multiple of it.
int64_t tile_rows(int64_t m) { return std::min(m, kTileRows); }

template <int bits, typename Epilogue>
void amx_pass(const int8_t* codes, int64_t m, int64_t k, int64_t n, const uint8_t* w, const uint16_t* sm, const Epilogue& e) {
  TORCH_CHECK(tiles_granted, "the AMX path needs amx_enable() to have succeeded");
  const int64_t rows = tile_rows(m), unpacked_bytes = bits == 4 ? k / kGroup * kOperandBytes : 0;
  at::parallel_for(0, n / kRows, 1, [&](int64_t begin, int64_t end) {
    // Per thread and call: torch's own AMX kernels (oneDNN's bf16 matmuls) load their own shapes in between.
    tile_config(tile_shapes(rows));
    std::unique_ptr<uint8_t, decltype(&std::free)> unpacked(
        static_cast<uint8_t*>(unpacked_bytes ? std::aligned_alloc(64, unpacked_bytes) : nullptr), &std::free);
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t t0 = 0; t0 < m; t0 += rows) {
        amx_block_of<bits>(std::min(rows, m - t0), w, sm, codes, k, t0, nb, unpacked.get(), t0 == 0, e);
      }
    }
    tile_release();
  });
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

int bits_of(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && (packed.size(2) == 4 || packed.size(2) == 8) && packed.size(3) == 64,
              "packed must be [N/16, K/32, 4 (int4) or 8 (int8), 64]");
  return packed.size(2) == 4 ? 4 : 8;
}

// x [M, K] rounded to int8 per group: codes [rows >= M, K] (rows past M zero, for the A tiles),
// scales and scale * sum(codes) [M, K/32].
struct Quantized {
  torch::Tensor codes, scales, sums;
};

Quantized quantize(const torch::Tensor& x, int64_t rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bf16, not ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "x has ", x.size(1), " inputs, not a multiple of ", kGroup);
  const int64_t m = x.size(0), k = x.size(1);
  Quantized q{torch::empty({rows, k}, torch::kInt8), torch::empty({m, k / kGroup}, torch::kFloat), torch::empty({m, k / kGroup}, torch::kFloat)};
  q.codes.narrow(0, m, rows - m).zero_();
  if (x.scalar_type() == torch::kBFloat16) {
    quantize_activations(x.data_ptr<at::BFloat16>(), m, k, q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(), q.sums.data_ptr<float>());
  } else {
    quantize_activations(x.data_ptr<float>(), m, k, q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(), q.sums.data_ptr<float>());
  }
  return q;
}

// One pass over x's codes with `epilogue`, on the tiles (amx) or with vpdpbusd.
template <typename Epilogue>
void pass(const Quantized& q, const torch::Tensor& packed, const torch::Tensor& scale_min, bool amx, const Epilogue& epilogue) {
  const int64_t m = q.scales.size(0), k = q.codes.size(1), n = packed.size(0) * kRows;
  TORCH_CHECK(k == packed.size(1) * kGroup, "x has ", k, " inputs; the weights take ", packed.size(1) * kGroup);
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  const int8_t* codes = q.codes.data_ptr<int8_t>();
  if (bits_of(packed) == 4) {
    amx ? amx_pass<4>(codes, m, k, n, w, sm, epilogue) : vnni_pass<4>(codes, m, k, n, w, sm, epilogue);
  } else {
    amx ? amx_pass<8>(codes, m, k, n, w, sm, epilogue) : vnni_pass<8>(codes, m, k, n, w, sm, epilogue);
  }
}

Quantized quantize_for(const torch::Tensor& x, bool amx) {
  const int64_t m = x.size(0), rows = amx ? tile_rows(m) : 1;
  return quantize(x, amx && m > 0 ? (m + rows - 1) / rows * rows : m);
}

template <typename T>
Linear<T> linear_into(const Quantized& q, torch::Tensor& out) {
  return {q.scales.data_ptr<float>(), q.sums.data_ptr<float>(), q.scales.size(1), out.size(1), out.data_ptr<T>()};
}

}  // namespace

bool amx_enable() {
  tiles_granted = tiles_granted || request_tiles();
  return tiles_granted;
}

torch::Tensor vnni_dequantize_t(const torch::Tensor& packed, const torch::Tensor& scale_min) {
  return bits_of(packed) == 4 ? dequantize_t<4>(packed, scale_min) : dequantize_t<8>(packed, scale_min);
}

// y [M, N] = x [M, K] @ dequant(packed).T, in x's dtype (float32 or bf16); the integer sums on AMX
// tiles (amx) or with vpdpbusd, bit-identical results either way.
torch::Tensor vnni_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool amx) {
  const Quantized q = quantize_for(x, amx);
  torch::Tensor out = torch::empty({x.size(0), packed.size(0) * kRows}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    pass(q, packed, scale_min, amx, linear_into<at::BFloat16>(q, out));
  } else {
    pass(q, packed, scale_min, amx, linear_into<float>(q, out));
  }
  return out;
}

// The int32 sums [M, K/32, N] of each token, group and output row, as a pass computes them.
torch::Tensor vnni_group_sums(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_min, bool amx) {
  const Quantized q = quantize_for(x, amx);
  const int64_t groups = packed.size(1), n = packed.size(0) * kRows;
  torch::Tensor out = torch::empty({x.size(0), groups, n}, torch::kInt);
  pass(q, packed, scale_min, amx, Sums{groups, n, out.data_ptr<int32_t>()});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("amx_enable", &amx_enable, "ask Linux for the AMX tile state (once); whether the AMX path may run");
  module.def("vnni_dequantize_t", &vnni_dequantize_t, "the weights as bf16 [K, N]");
  module.def("vnni_mm", &vnni_mm, "y = x @ dequant(int4 or int8 weights).T with int8 activations (AVX-512 VNNI or AMX-INT8)");
  module.def("vnni_group_sums", &vnni_group_sums, "the int32 sums per token, group and output row (tests)");
}
