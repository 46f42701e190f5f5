// AMX primitives of the `amx` build (paged_attention.cpp's decode kernel): asking Linux for
// the tile state, the one tile configuration the kernel uses, and the packing steps between
// the paged cache (read in place) and the tiles.
//
// AMX (Intel Sapphire Rapids and later) multiplies bfloat16 tiles: TDPBF16PS adds to C
// ([16 rows, 16 float32]) the product of A ([16 rows, 32 bfloat16], row-major) and B
// ([16 rows, 16 pairs], "VNNI": row k holds the pairs (B[2k, n], B[2k + 1, n]) for n < 16),
// each product exact in float32 and the sums float32 (Intel's Architecture Instruction Set
// Extensions Programming Reference, ch. 3). A tile row is loaded from any address with any
// stride (TILELOADD), so a cache whose token rows are D contiguous values needs no packing
// when the key rows are the A operand: the kernel computes S^T = K Q^T (keys as rows, query
// rows as columns) with the queries packed once per item, and O = P V with the
// probabilities transposed into A and two value rows at a time interleaved into B
// (paged_attention.cpp, Kernel::run_item_amx), or, for one-token items, with 16 value rows in
// place as B and the probabilities beside zeros in A tiles (Kernel::tile_values).
#pragma once

#if defined(ATTN_DI_AMX)

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace attn_di_kernel {

// Whether this process may use the AMX tiles, and if not why (one line). Linux grants the
// tile data state (XTILEDATA, 8 KiB per thread) only to a process that asks for it
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux 5.16+, Documentation/arch/x86/
// xstate.rst); a thread using a tile without it is killed by SIGILL. Asked once per process
// (torch's oneDNN asks the same; the grant is per process and idempotent).
struct AmxState {
  bool usable;
  std::string why;  // empty when usable
};

inline const AmxState& amx_state() {
  static const AmxState state = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
      return AmxState{false, "this CPU has no AMX-BF16 tiles (CPUID.7.0:EDX bits 22, 24)"};
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0)
      return AmxState{false, std::string("Linux refused the AMX tile state (arch_prctl: ") +
                                 std::strerror(errno) + ")"};
    return AmxState{true, ""};
  }();
  return state;
}

// The tile configuration (LDTILECFG's 64-byte operand, palette 1): all eight tiles 16 rows of
// 64 bytes, partial tiles zero-padded in memory, so one configuration serves every shape of
// run_item_amx; or, for the one-token scores (Kernel::tile_scores), the C tiles (0-3) and B
// tiles (5, 7) narrowed to the N query rows of a KV head (4 bytes each), so that a C tile
// stores straight into the score block.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration on this thread (the tile registers are per thread; oneDNN's GEMMs
// in the prefill kernel configure them their own way, so each item loads ours).
inline void configure_tiles(int narrow_bytes = 64) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = static_cast<uint16_t>(t == 4 || t == 6 ? 64 : narrow_bytes);
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// Loads a configuration of Kernel::tile_values (paged_attention.cpp), all tiles 64 bytes
// wide: A tiles 4, 5 of `rows` rows (the G query heads of one KV head, or 2G where one A tile
// holds both parities) and B tiles 6, 7 of 16 rows (value rows in place); tiles 0-3 C tiles of
// `rows` rows, or with `b_pairs` C tiles 0, 1 and B tiles 2, 3 of 16 rows (a second set of
// operands, A 5 and B 2, 3, loading while the first set's products run).
inline void configure_value_tiles(int rows, bool b_pairs) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    const bool b_tile = t >= 6 || (b_pairs && (t == 2 || t == 3));
    config.rows[t] = static_cast<uint8_t>(b_tile ? 16 : rows);
  }
  _tile_loadconfig(&config);
}

// C tiles 0 .. count - 1 (count <= 4) = sum over chunks kc < `chunks` of A(h, kc) B(h, kc),
// h < count, with TDPBF16PS (bfloat16 pairs, float32 sums): a(h, kc) is the A operand's first
// row (16 rows `a_stride` bytes apart, 64 bytes each), b(h, kc) the B operand's (16 rows of
// 64 bytes, contiguous). Operands alternate between tmm4/5 and tmm6/7, so one product's tiles
// load while the previous product runs.
template <typename A, typename B>
inline void multiply_c_tiles(int64_t count, int64_t chunks, A&& a, int64_t a_stride, B&& b) {
  _tile_zero(0);
  if (count > 1) _tile_zero(1);
  if (count > 2) _tile_zero(2);
  if (count > 3) _tile_zero(3);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    _tile_loadd(4, a(0, kc), a_stride);
    _tile_loadd(5, b(0, kc), 64);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) {
      _tile_loadd(6, a(1, kc), a_stride);
      _tile_loadd(7, b(1, kc), 64);
      _tile_dpbf16ps(1, 6, 7);
    }
    if (count > 2) {
      _tile_loadd(4, a(2, kc), a_stride);
      _tile_loadd(5, b(2, kc), 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (count > 3) {
      _tile_loadd(6, a(3, kc), a_stride);
      _tile_loadd(7, b(3, kc), 64);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
}

// Transposes 16 x 16 32-bit words in registers: row i of the result is column i of the input
// (unpack within 128-bit lanes, then a 4 x 4 transpose of the lanes).
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], lane L: column 4L + j of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

}  // namespace attn_di_kernel

#endif  // ATTN_DI_AMX
