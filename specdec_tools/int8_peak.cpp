// The CPU's int8 multiply-add peak, measured: per thread a loop of independent dot-product chains held in
// registers (tiles, for AMX), nothing read from memory in the loop. step_costs sets each pass's multiply-adds
// a second against it (docs/benchmarks/NOTES.md). One function per instruction family, each compiled for its
// own ISA by a target attribute: the module builds anywhere, and Python calls only what the CPU runs.
//
// Each returns the sum of its accumulators' int32 lanes (wrapping), so a test can check every iteration ran.
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <cstdint>

#include "../specdec_core/models/amx_tiles.h"

namespace {

constexpr int kChains = 12;  // independent chains per thread: past the instruction's latency x its ports

// The products' operands, opaque to the compiler, so that it cannot fold a chain into a multiplication.
template <typename Vector>
inline void opaque(Vector& a, Vector& b) { asm volatile("" : "+v"(a), "+v"(b)); }

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t avx512_vnni_chains(int64_t iterations) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int64_t i = 0; i < iterations; ++i) {
    opaque(a, b);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);  // 64 multiply-adds
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
  return _mm512_reduce_add_epi32(acc[0]);
}

// The wrapping sum of a ymm register's int32 lanes.
__attribute__((target("avx2"))) int64_t lane_sum(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t sum = 0;
  for (uint32_t lane : lanes) sum += lane;
  return static_cast<int32_t>(sum);
}

__attribute__((target("avx2,avxvnni"))) int64_t avx_vnni_chains(int64_t iterations) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int64_t i = 0; i < iterations; ++i) {
    opaque(a, b);
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);  // 32 multiply-adds
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
  return lane_sum(acc[0]);
}

// AVX2 has no vpdpbusd: vpmaddubsw (pairs into int16), vpmaddwd by ones (into int32), vpaddd, as our kernel does.
__attribute__((target("avx2"))) int64_t avx2_chains(int64_t iterations) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iterations; ++i) {
    opaque(a, b);
    for (int c = 0; c < kChains; ++c)  // 32 multiply-adds
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
  }
  for (int c = 1; c < kChains; ++c) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
  return lane_sum(acc[0]);
}

// Four 16 x 16 int32 accumulators over two 16 x 64-byte A tiles and two B tiles: 4 x 16 x 16 x 64 multiply-adds
// an iteration, every operand in a tile.
int64_t amx_int8_chains(int64_t iterations) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  alignas(64) int8_t a[16 * 64];
  alignas(64) uint8_t b[16 * 64];
  alignas(64) int32_t c[4][16 * 16];
  for (int i = 0; i < 16 * 64; ++i) a[i] = 3, b[i] = 5;
  tile_config(config);
  tile_zero<0>(), tile_zero<1>(), tile_zero<2>(), tile_zero<3>();
  tile_load<4>(a, 64), tile_load<5>(a, 64), tile_load<6>(b, 64), tile_load<7>(b, 64);
  for (int64_t i = 0; i < iterations; ++i) {
    tile_dpbsud<0, 4, 6>(), tile_dpbsud<1, 4, 7>(), tile_dpbsud<2, 5, 6>(), tile_dpbsud<3, 5, 7>();
  }
  tile_store<0>(c[0], 64), tile_store<1>(c[1], 64), tile_store<2>(c[2], 64), tile_store<3>(c[3], 64);
  tile_release();
  uint32_t sum = 0;  // wrapping, as the vector lanes do
  for (const auto& tile : c)
    for (int32_t lane : tile) sum += static_cast<uint32_t>(lane);
  return static_cast<int32_t>(sum);
}

// `iterations` of `chains` on each of `threads` threads at once; the wall seconds of the whole, and the sum of the
// threads' checksums.
std::tuple<double, int64_t> run(int64_t (*chains)(int64_t), int64_t iterations, int64_t threads) {
  int64_t checksum = 0;
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : checksum)
  checksum += chains(iterations);
  return {omp_get_wtime() - start, checksum};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("avx512_vnni", [](int64_t n, int64_t t) { return run(avx512_vnni_chains, n, t); },
             "12 vpdpbusd zmm chains: (seconds, checksum)");
  module.def("avx_vnni", [](int64_t n, int64_t t) { return run(avx_vnni_chains, n, t); }, "12 vpdpbusd ymm chains");
  module.def("avx2", [](int64_t n, int64_t t) { return run(avx2_chains, n, t); },
             "12 vpmaddubsw + vpmaddwd + vpaddd chains");
  module.def("amx_int8", [](int64_t n, int64_t t) { return run(amx_int8_chains, n, t); },
             "4 tdpbsud accumulators (the tile state must be granted first)");
  module.def("request_tiles", &request_tiles, "ask Linux for the AMX tile state (once a process)");
}
