// specdec_core/models/quant_avx512.cpp on a CPU without AVX-512 or AMX, and quant_avx2.cpp's AVX-VNNI build
// on one without AVX-VNNI, for tests/test_quant.py: SIMDe's portable AVX-512 and a scalar model of the AMX tiles. Slow; it checks the kernel's logic (layouts,
// tile shapes, the order of the float epilogue), not its speed.
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

// What SIMDe 0.8 lacks of what the kernel uses.
inline int32_t emulated_reduce_add_epi32(__m512i v) {
  int32_t lanes[16];
  std::memcpy(lanes, &v, sizeof lanes);
  int32_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}
template <typename Narrow, typename Out>
Out truncate_lanes(__m512i v) {  // vpmovdb / vpmovdw: each int32 lane's low bytes
  int32_t lanes[16];
  std::memcpy(lanes, &v, sizeof lanes);
  Narrow narrow[16];
  for (int i = 0; i < 16; ++i) narrow[i] = static_cast<Narrow>(lanes[i]);
  Out out;
  std::memcpy(&out, narrow, sizeof out);
  return out;
}
inline __m128i emulated_cvtepi32_epi8(__m512i v) { return truncate_lanes<int8_t, __m128i>(v); }
inline __m256i emulated_cvtepi32_epi16(__m512i v) { return truncate_lanes<int16_t, __m256i>(v); }
template <typename Byte>
__m512i widen_lanes(__m128i v) {  // vpmovzxbd / vpmovsxbd: each byte to an int32 lane
  Byte bytes[16];
  std::memcpy(bytes, &v, sizeof bytes);
  int32_t lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = bytes[i];
  __m512i out;
  std::memcpy(&out, lanes, sizeof out);
  return out;
}
inline __m512i emulated_cvtepu8_epi32(__m128i v) { return widen_lanes<uint8_t>(v); }
inline __m512i emulated_cvtepi8_epi32(__m128i v) { return widen_lanes<int8_t>(v); }
// Macros, as SIMDe's own names are: GCC's <immintrin.h> declares the native ones too.
#define _mm512_reduce_add_epi32 emulated_reduce_add_epi32
#define _mm512_cvtepu8_epi32 emulated_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 emulated_cvtepi8_epi32
#define _mm512_cvtepi32_epi8 emulated_cvtepi32_epi8
#define _mm512_cvtepi32_epi16 emulated_cvtepi32_epi16
// AVX-VNNI's vpdpbusd on ymm is AVX512-VNNI's 256-bit one, VEX-encoded: the same sums.
#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32

// The AMX tiles: the same config layout as the hardware's, 8 tiles of up to 16 rows x 64 bytes per
// thread, and shape checks the hardware would fault on (#UD/#GP) or silently get wrong.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

struct EmulatedTiles {
  TileConfig config;
  bool configured = false;
  uint8_t data[8][16][64];
};
inline thread_local EmulatedTiles emulated_tiles;

inline void tile_check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("emulated AMX: ") + what);
}
inline void tile_config(const TileConfig& config) {
  tile_check(config.palette == 1, "palette must be 1");
  for (int t = 0; t < 8; ++t) tile_check(config.rows[t] <= 16 && config.colsb[t] <= 64, "tile larger than 16 x 64");
  emulated_tiles.config = config;
  emulated_tiles.configured = true;
  std::memset(emulated_tiles.data, 0, sizeof emulated_tiles.data);
}
inline void tile_release() { emulated_tiles.configured = false; }
template <int tile>
void tile_zero() {
  tile_check(emulated_tiles.configured, "tilezero before ldtilecfg");
  std::memset(emulated_tiles.data[tile], 0, sizeof emulated_tiles.data[tile]);
}
template <int tile>
void tile_load(const void* base, int64_t stride) {
  tile_zero<tile>();
  const TileConfig& c = emulated_tiles.config;
  for (int r = 0; r < c.rows[tile]; ++r) std::memcpy(emulated_tiles.data[tile][r], static_cast<const uint8_t*>(base) + r * stride, c.colsb[tile]);
}
template <int tile>
void tile_store(void* base, int64_t stride) {
  tile_check(emulated_tiles.configured, "tilestored before ldtilecfg");
  const TileConfig& c = emulated_tiles.config;
  for (int r = 0; r < c.rows[tile]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, emulated_tiles.data[tile][r], c.colsb[tile]);
}
// c[m][n] += sum over k of a[m][k] (int8) * b[k / 4][4n + k % 4] (uint8), as tdpbsud.
template <int c, int a, int b>
void tile_dpbsud() {
  tile_check(emulated_tiles.configured, "tdpbsud before ldtilecfg");
  const TileConfig& config = emulated_tiles.config;
  const int m = config.rows[a], k = config.colsb[a], n = config.colsb[b] / 4;
  tile_check(config.rows[c] == m && config.colsb[c] == 4 * n && config.rows[b] == k / 4 && k % 4 == 0, "tdpbsud shapes do not match");
  for (int row = 0; row < m; ++row) {
    for (int col = 0; col < n; ++col) {
      int32_t sum;
      std::memcpy(&sum, emulated_tiles.data[c][row] + 4 * col, 4);
      for (int i = 0; i < k; ++i) {
        sum += static_cast<int8_t>(emulated_tiles.data[a][row][i]) * static_cast<int32_t>(emulated_tiles.data[b][i / 4][4 * col + i % 4]);
      }
      std::memcpy(emulated_tiles.data[c][row] + 4 * col, &sum, 4);
    }
  }
}
inline bool request_tiles() { return true; }
