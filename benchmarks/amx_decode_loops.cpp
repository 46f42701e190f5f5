// The AMX tile loops of CPU_ATTN's bfloat16 decode (tile_scores, tile_values in
// src/attn_di/backends/_cpu_kernel/paged_attention.cpp), alone: how fast the memory system
// feeds them, without the softmax and the transposes of P around them.
//
// Shape: SmolLM2-135M's decode, B8 x 510 keys, 9 query heads / 3 KV heads of 64, on vLLM's
// head-major pages of 128 tokens (per block and KV head, 128 key rows then 128 value rows),
// blocks in shuffled order. Per 16 keys: S^T = K Q^T per KV head (the key rows in place as
// the A operand, two products of 32 values of D), then P V per KV head (the value rows in
// place as the B operand, one A tile of 2G rows). Two orders of the same products, then the
// same two passes on two packed page interiors (same page size and place, keys and values in
// the order AMX's B operands take them, so that S comes out query row by query row and P is
// the A operand of P V as it is, with no transposes; the loops' products have G rows):
//   two-pass  all scores of a sequence, then all of its P V (the kernel's order)
//   chunked   scores then P V per chunk of keys (vLLM's single pass)
//   packed    keys as K^T in pairs of D ([D/2][block][2]), values in pairs of keys
//             ([block/2][D][2]): a tile's 16 rows are a row of the block apart
//   tiled     the same pairs with every tile one contiguous KiB: keys [block/16][D/2][16][2],
//             values [block/32][D/16][16][16][2]
//   stream    the same bytes read by plain 512-bit loads, no tiles: the memory system's roof
// Then the question whether the kernel's vector work between its two passes (the softmax and
// P's transposes) could hide under their loads. A stand-in for that work (exponentials over the
// sequence's score block, `reps` sweeps: reps 3 takes about as long as the kernel's softmax and
// transposes of a call), alone and in three places:
//   work            the stand-in alone
//   two-pass+work   scores, the work, P V, per sequence (the kernel's order)
//   interleaved     the work spread over the score pass's 16-key groups, a slice after each
//   interleaved+pf  the same, each group also prefetching the key rows of the group two ahead
// The operands' values are zeros: only the loads, products and stores are timed.
//
// Build and run (Linux, a CPU with AMX-BF16; `layers` caches taken in turn, 1 keeps them in
// the L2/L3, 30 and more spill past the L3 on most machines):
//   c++ -O2 -mamx-tile -mamx-bf16 -mavx512f -o /tmp/amx_decode_loops benchmarks/amx_decode_loops.cpp
//   /tmp/amx_decode_loops [layers=30] [chunk=64] [reps=3]
// Prints the CPU model, then per order the median of 7 sweeps: microseconds per layer call
// (the TSC, calibrated against CLOCK_MONOTONIC) and GB/s of K and V read. docs/benchmarks.md
// has the numbers and what they mean.

#include "_machine.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kKvHeads = 3, kGroup = 3, kHeads = kKvHeads * kGroup, kHeadSize = 64;
constexpr int kBlock = 128, kSeqs = 8, kContext = 510;
constexpr int kRowBytes = kHeadSize * 2;              // one token's row of one KV head
constexpr int kPageBytes = kBlock * 2 * kRowBytes;    // keys then values of one KV head
constexpr int kBlockBytes = kKvHeads * kPageBytes;
constexpr int kBlocksPerSeq = (kContext + kBlock - 1) / kBlock;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) uint32_t g_query_tiles[kKvHeads * kHeadSize / 2 * 16];
alignas(64) uint32_t g_prob_words[16 * 16];
alignas(64) float g_scores[(kContext + 16) * kHeads];
alignas(64) float g_out[16 * 16];

using bench_machine::cpu_model;
using bench_machine::ticks_per_us;

// The first byte of the block that holds position j0 of sequence s.
inline const char* block_of(const char* cache, const int* table, int s, int j0) {
  return cache + static_cast<size_t>(table[s * kBlocksPerSeq + j0 / kBlock]) * kBlockBytes;
}

// Scores of keys [j0, j0 + 16) of sequence s for every KV head (C tiles 0-2, G columns each).
inline void score_group(const char* cache, const int* table, int s, int j0) {
  const char* rows = block_of(cache, table, s, j0) + (j0 % kBlock) * kRowBytes;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int kc = 0; kc < kHeadSize / 32; ++kc) {
    _tile_loadd(5, g_query_tiles + 0 * 512 + kc * 256, 64);
    _tile_loadd(4, rows + 0 * kPageBytes + kc * 64, kRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, g_query_tiles + 1 * 512 + kc * 256, 64);
    _tile_loadd(6, rows + 1 * kPageBytes + kc * 64, kRowBytes);
    _tile_dpbf16ps(1, 6, 5);
    _tile_loadd(5, g_query_tiles + 2 * 512 + kc * 256, 64);
    _tile_loadd(4, rows + 2 * kPageBytes + kc * 64, kRowBytes);
    _tile_dpbf16ps(2, 4, 5);
  }
  float* out = g_scores + j0 * kHeads;
  _tile_stored(0, out, kHeads * 4);
  _tile_stored(1, out + kGroup, kHeads * 4);
  _tile_stored(2, out + 2 * kGroup, kHeads * 4);
}

// P V of keys [j0, j0 + 16) of sequence s for KV head g into C tile 3 (2G rows x 16 columns).
inline void value_group(const char* cache, const int* table, int s, int g, int j0) {
  const char* rows = block_of(cache, table, s, j0) +
                     g * kPageBytes + kBlock * kRowBytes + (j0 % kBlock) * kRowBytes;
  _tile_loadd(7, g_prob_words, 64);
  _tile_loadd(4, rows, kRowBytes);
  _tile_dpbf16ps(3, 7, 4);
  _tile_loadd(6, rows + 64, kRowBytes);
  _tile_dpbf16ps(3, 7, 6);
}

// P V of keys [lo, hi) of sequence s, KV head by KV head.
void values(const char* cache, const int* table, int s, int lo, int hi) {
  for (int g = 0; g < kKvHeads; ++g) {
    _tile_zero(3);
    for (int j0 = lo; j0 < hi; j0 += 16) value_group(cache, table, s, g, j0);
    _tile_stored(3, g_out, 64);
  }
}

void keys_then_values(const char* cache, const int* table, int s, int lo, int hi) {
  for (int j0 = lo; j0 < hi; j0 += 16) score_group(cache, table, s, j0);
  values(cache, table, s, lo, hi);
}

// The same products on a packed page interior. S = Q K^T then comes out one query row per
// tile row (G rows, 16 keys), and P (bfloat16, row-major) is the A operand of P V as it is:
// G-row products, no transposes. Two interiors of the same page (per block and KV head):
//   Packed::kRows  keys as K^T in pairs of D ([D/2][block][2]: a B tile is 16 pairs of D x 16
//                  keys, rows a block's row of pairs apart), values in pairs of keys
//                  ([block/2][D][2]: a B tile is 16 key pairs x 16 values of D)
//   Packed::kTiles the same pairs with every tile operand one contiguous KiB: keys
//                  [block/16][D/2][16][2], values [block/32][D/16][16][16][2]
alignas(64) uint16_t g_query_rows[kHeads * kHeadSize];
alignas(64) float g_row_scores[kHeads * (kContext + 32)];
alignas(64) uint16_t g_probs[kHeads * (kContext + 32)];

enum class Packed { kRows, kTiles };

void packed(Packed layout, const char* cache, const int* table, int s, int lo, int hi) {
  constexpr int kScoreStride = (kContext + 32) * 4;
  const bool tiles = layout == Packed::kTiles;
  // Keys: the B tile of 16 keys from j0 and 32 values of D from kc * 32, and its row stride.
  const int key_stride = tiles ? 64 : kBlock * 4;
  auto key_tile = [&](const char* block, int j0, int kc) {
    return block + (tiles ? (j0 % kBlock) / 16 * (kHeadSize / 2 * 64) + kc * 1024
                          : (j0 % kBlock) * 4 + static_cast<size_t>(kc) * 16 * kBlock * 4);
  };
  // Values: the B tile of 32 keys from j0 and 16 values of D from c * 16, and its row stride.
  const int value_stride = tiles ? 64 : kHeadSize * 4;
  auto value_tile = [&](const char* page, int j0, int c) {
    return page + (tiles ? (j0 % kBlock) / 32 * (kHeadSize / 16 * 1024) + c * 1024
                         : (j0 % kBlock) / 2 * kHeadSize * 4 + c * 64);
  };
  for (int j0 = lo; j0 < hi; j0 += 16) {
    const char* block = block_of(cache, table, s, j0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int kc = 0; kc < kHeadSize / 32; ++kc) {
      _tile_loadd(4, g_query_rows + 0 * kGroup * kHeadSize + kc * 32, kHeadSize * 2);
      _tile_loadd(6, key_tile(block + 0 * kPageBytes, j0, kc), key_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, g_query_rows + 1 * kGroup * kHeadSize + kc * 32, kHeadSize * 2);
      _tile_loadd(7, key_tile(block + 1 * kPageBytes, j0, kc), key_stride);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(4, g_query_rows + 2 * kGroup * kHeadSize + kc * 32, kHeadSize * 2);
      _tile_loadd(6, key_tile(block + 2 * kPageBytes, j0, kc), key_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    _tile_stored(0, g_row_scores + 0 * kGroup * (kContext + 32) + j0, kScoreStride);
    _tile_stored(1, g_row_scores + 1 * kGroup * (kContext + 32) + j0, kScoreStride);
    _tile_stored(2, g_row_scores + 2 * kGroup * (kContext + 32) + j0, kScoreStride);
  }
  for (int g = 0; g < kKvHeads; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int j0 = lo; j0 < hi; j0 += 32) {
      const char* page = block_of(cache, table, s, j0) + g * kPageBytes + kBlock * kRowBytes;
      _tile_loadd(5, g_probs + g * kGroup * (kContext + 32) + j0, (kContext + 32) * 2);
      _tile_loadd(6, value_tile(page, j0, 0), value_stride);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, value_tile(page, j0, 1), value_stride);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, value_tile(page, j0, 2), value_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, value_tile(page, j0, 3), value_stride);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, g_out, 256);
    _tile_stored(1, g_out + 16, 256);
    _tile_stored(2, g_out + 32, 256);
    _tile_stored(3, g_out + 48, 256);
  }
}

// The roof: every byte the passes read (a sequence's blocks, whole, in block-table order),
// read by plain 512-bit loads, no tiles and no products.
__m512i g_sink;

void stream(const char* cache, const int* table, int s) {
  __m512i acc = g_sink;
  for (int j0 = 0; j0 < kContext; j0 += kBlock) {
    const char* block = block_of(cache, table, s, j0);
    const int rows = std::min(kBlock, kContext - j0);
    for (int g = 0; g < kKvHeads; ++g)
      for (int half = 0; half < 2; ++half) {  // keys, then values
        const char* page = block + g * kPageBytes + half * kBlock * kRowBytes;
        for (int b = 0; b < rows * kRowBytes; b += 64)
          acc = _mm512_add_epi32(acc, _mm512_load_si512(page + b));
      }
  }
  g_sink = acc;
}

// The stand-in for the vector work between the passes: exponentials (range reduction, a
// degree-5 polynomial, VSCALEFPS: the kernel's softmax_exp) over floats [lo, hi) of a score
// block, `reps` times, each vector independent of the others (as the softmax's are).
constexpr int kWorkFloats = (kContext + 15) / 16 * 16 * kHeads;
alignas(64) float g_work[kWorkFloats];
int g_reps = 3;

constexpr float kTaylor[6] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

void vector_work(int lo, int hi) {
  const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2 = _mm512_set1_ps(0.693147181f);
  for (int r = 0; r < g_reps; ++r)
    for (int i = lo; i < hi; i += 16) {
      const __m512 x = _mm512_load_ps(g_work + i);  // <= 0: zeros, then exp(x) - 1
      const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, log2e), _mm512_set1_ps(-125.f));
      const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), ln2);
      __m512 p = _mm512_set1_ps(kTaylor[0]);  // Horner: e^f to degree 5
      for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kTaylor[c]));
      _mm512_store_ps(g_work + i, _mm512_sub_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.f)));
    }
}

// The two-pass order with the vector work placed as `place` says: 0 between the passes, 1
// spread over the score pass (a slice after each 16-key group), 2 the same with each group
// prefetching the key rows (all KV heads) of the group two ahead into L1.
void keys_work_values(const char* cache, const int* table, int s, int place) {
  constexpr int kGroups = (kContext + 15) / 16;
  constexpr int kSlice = (kWorkFloats / kGroups + 15) / 16 * 16;
  for (int q = 0; q < kGroups; ++q) {
    if (place == 2 && q + 2 < kGroups) {
      const int j0 = (q + 2) * 16;
      const char* rows = block_of(cache, table, s, j0) + (j0 % kBlock) * kRowBytes;
      for (int g = 0; g < kKvHeads; ++g)
        for (int b = 0; b < 16 * kRowBytes; b += 64) _mm_prefetch(rows + g * kPageBytes + b, _MM_HINT_T0);
    }
    score_group(cache, table, s, q * 16);
    if (place > 0) vector_work(std::min(kWorkFloats, q * kSlice), std::min(kWorkFloats, (q + 1) * kSlice));
  }
  if (place == 0) vector_work(0, kWorkFloats);
  values(cache, table, s, 0, kContext);
}

}  // namespace

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 30;
  const int chunk = argc > 2 ? std::atoi(argv[2]) : 64;
  g_reps = argc > 3 ? std::atoi(argv[3]) : 3;
  std::printf("CPU: %s; AMX-BF16 tiles; %d layers, chunks of %d keys\n", cpu_model().c_str(), layers,
              chunk);
  if (layers < 1 || chunk < 16 || chunk % 16 != 0 || g_reps < 0) {
    std::fprintf(stderr, "layers must be >= 1, chunk a multiple of 16 keys and reps >= 0\n");
    return 2;
  }
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) != 0) {
    std::fprintf(stderr, "Linux refused the AMX tile state (no AMX on this CPU or kernel)\n");
    return 1;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  for (int t : {0, 1, 2, 5}) config.colsb[t] = kGroup * 4;  // score C tiles and query B tile
  config.rows[3] = config.rows[7] = 2 * kGroup;            // P V: C tile and probability A tile
  _tile_loadconfig(&config);

  const int blocks = kSeqs * kBlocksPerSeq;
  std::vector<char*> caches;
  for (int l = 0; l < layers; ++l) {
    char* cache = static_cast<char*>(std::aligned_alloc(4096, static_cast<size_t>(blocks) * kBlockBytes));
    std::memset(cache, 0, static_cast<size_t>(blocks) * kBlockBytes);
    caches.push_back(cache);
  }
  std::vector<int> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), std::mt19937(0));
  const double bytes = 2.0 * kSeqs * kContext * kKvHeads * kRowBytes;  // K and V read per call
  const double tick_rate = ticks_per_us();
  std::printf("TSC: %.0f ticks a microsecond\n", tick_rate);

  TileConfig packed_config;
  for (int t = 0; t < 8; ++t) {
    packed_config.rows[t] = 16;
    packed_config.colsb[t] = 64;
  }
  for (int t : {0, 1, 2, 3, 4, 5}) packed_config.rows[t] = kGroup;  // C tiles, Q and P A tiles
  for (int order = 0; order < 9; ++order) {
    if (order == 2) _tile_loadconfig(&packed_config);
    if (order == 5) _tile_loadconfig(&config);
    std::vector<double> sweeps;
    for (int sweep = 0; sweep < 8; ++sweep) {
      const uint64_t start = __rdtsc();
      for (int l = 0; l < layers; ++l)
        for (int s = 0; s < kSeqs; ++s) {
          if (order == 0) {
            keys_then_values(caches[l], table.data(), s, 0, kContext);
          } else if (order == 2) {
            packed(Packed::kRows, caches[l], table.data(), s, 0, kContext);
          } else if (order == 3) {
            packed(Packed::kTiles, caches[l], table.data(), s, 0, kContext);
          } else if (order == 4) {
            stream(caches[l], table.data(), s);
          } else if (order == 5) {
            vector_work(0, kWorkFloats);
          } else if (order >= 6) {
            keys_work_values(caches[l], table.data(), s, order - 6);
          } else {
            for (int lo = 0; lo < kContext; lo += chunk)
              keys_then_values(caches[l], table.data(), s, lo, std::min(kContext, lo + chunk));
          }
        }
      if (sweep > 0) sweeps.push_back(static_cast<double>(__rdtsc() - start) / tick_rate / layers);
    }
    std::sort(sweeps.begin(), sweeps.end());
    const double us = sweeps[sweeps.size() / 2];
    static const char* const kOrders[] = {"two-pass", "chunked", "packed", "tiled", "stream",
                                          "work", "two-pass+work", "interleaved", "interleaved+pf"};
    std::printf("%-14s %8.1f us a layer call  %6.1f GB/s\n", kOrders[order], us,
                bytes / us / 1e3);
  }
  _tile_release();
  for (char* cache : caches) std::free(cache);
  return 0;
}
