// AMX tiles as inline asm, shared by the kernels that use them (quant_avx512.cpp's int8 passes,
// attention.cpp's bf16 scores and weighted sums).
//
// Inline asm with the operands the compiler must respect: GCC 12's `_tile_loadconfig` names only the
// config's first 8 bytes as read, so it may drop the stores of the rest (llama.cpp's AMX build fails so
// with GCC 12), and its `_tile_loadd` names no memory at all, so stores to an unpacked buffer could be
// sunk past the load. No -mamx-* flags needed.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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
// c += a (bf16 pairs) . b (bf16 pairs), float32 lanes.
template <int c, int a, int b>
void tile_dpbf16ps() { asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(b), "i"(a), "i"(c)); }

// Linux hands out the tile state (8 KB per thread) only to processes that ask, once.
inline bool request_tiles() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
