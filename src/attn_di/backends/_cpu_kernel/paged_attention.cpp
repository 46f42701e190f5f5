// CPU_ATTN's compiled decode kernel: attention of short queries (decode, chunked decode) over
// a paged KV cache, read in place through the block table.
//
// softmax(q . k * scale [soft cap] [+ ALiBi] [sliding window]) . v (Vaswani et al. 2017), with
// sinks in the denominator only. Layouts are vLLM's (and attn_di's, see attn_di.backend):
//   query      [N, H, D]                     (last dim contiguous; any row strides)
//   key_cache, value_cache [num_blocks, block_size, H_kv, D], strided (last dim contiguous)
//   block_table[B, max_blocks]               position p of sequence b is at slot
//                                            block_table[b, p / block_size] * block_size + p % block_size
//   seq_lens   [B], query_start_loc [B + 1]; the queries of sequence b are its last
//                                            q_len = query_start_loc[b+1] - query_start_loc[b] positions.
//   out        [N, H, D]                     (last dim contiguous), rows of real tokens written.
//
// The caches are strided views: key_cache and value_cache are [num_blocks, block_size, H_kv, D]
// with any strides whose last one is 1 (kv_cache[0] and kv_cache[1] of attn_di's layout, the
// blocks-outermost [num_blocks, 2, block_size, H_kv, D] buffer vLLM hands a layer, a head-major
// block interior [num_blocks, H_kv, block_size, D], ...). A token's row of one KV head is D
// contiguous values at block * block_stride + offset * token_stride + head * head_stride.
//
// Memory safety: every op checks, before it touches memory, every shape, stride, dtype, device
// and index it relies on (out rows, block size > 0, query_start_loc monotone and within query and
// out, seq_lens covered by the block table, block ids and slots within the cache, no tensor it
// writes sharing memory with another of its arguments) and raises a RuntimeError (TORCH_CHECK)
// naming the argument.
//
// Work: one item = one sequence x one partition of its visible keys. An item reads its key
// rows in block-table order, a whole token row (all KV heads) at a time, computes every
// query row's score in one pass over the keys, then the softmax, then a pass over the value
// rows; the query heads of one KV head are processed together (GQA/MQA). Sequences split in
// several partitions are merged afterwards through their (max, sum) pairs (log-sum-exp
// merge, Milakov & Gimelshein 2018). Items are handed out dynamically, longest first, to
// the threads of torch's own intra-op pool (at::parallel_for). In the amx build, bfloat16
// items take AMX tiles for both passes (tile_scores and tile_values, or run_item_amx;
// kTileScoresMaxGroup and kAmxMinRowWork say which), reading the cache in place all the same.
//
// Only slots of positions a query may see are ever loaded; a masked score never enters a
// product, so garbage (NaN/Inf) anywhere else in the cache cannot reach the output.
// Accumulation is float32 whatever the cache dtype.

#include "kernel.h"
#include "amx.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <atomic>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <queue>

#include <unistd.h>

namespace attn_di_kernel {
namespace {

// Most float scores an item keeps at once (query rows x keys): 128 KiB, with the item's V rows
// well within an L2 (256 KiB measured 0.87-0.97x of vLLM's op in decode B8 x 2048 float32 on the
// EPYC dev machine, where whole 2048-key sequences became items, against 0.84-0.87x).
constexpr int64_t kScoreBudget = 32 * 1024;
// Fewest keys per partition: below this the merge and the per-item set-up dominate.
constexpr int64_t kMinPartition = 256;
// An item's fixed cost (query staging, accumulator set-up, softmax bookkeeping, the scheduler's
// counter), and a partial row's merge, in units of one key seen by one query token: what the
// partition planner weighs against a better balance (plan_partition).
constexpr int64_t kItemCost = 64;

// The AMX path (run_item_amx) takes an item whose query rows per KV head times D (the
// AVX512_BF16 dot products' work per key, which AMX does at a flat cost up to 16 rows) is at
// least this: bench_vs_vllm on the Xeon with AMX, 2 threads, alternating processes, AMX /
// AVX512_BF16 ms: speculative B8 x 4 (16 rows of 128) 3.42 / 8.25, decode B8 x 2048 (4 rows of
// 128) 2.15 / 2.32, SmolLM2 decode (3 rows of 64) 0.14 / 0.12.
constexpr int64_t kAmxMinRowWork = 512;

// A one-token item of at most this many query heads per KV head (16: the rows of a tile)
// computes its scores (tile_scores) and P V (tile_values) on AMX tiles with the value rows in
// place, rather than run_item_amx, which interleaves value rows in pairs. Microbenchmark on
// the Xeon with AMX, one thread, one sequence of 1024 keys, us, ours / vLLM's op in the same
// process (noisy: +-10%): G = 3 of D = 64 (SmolLM2) 21-22 / 16 (scores on tiles, P V by
// float32 FMA: 23-25 / 16-18); G = 4 of 128 x 8 KV heads 186-206 / 139-155 (FMA P V: 216 /
// 140); G = 8 of 128 32-36 / 21-22; G = 16 of 128 29 / 21-24 (run_item_amx: 39 / 22); G = 12
// of 64 x 2 KV heads 28 / 26 (run_item_amx: 46 / 24). Both products are bound by TDPBF16PS
// throughput there (perf), not by the vector work around them.
constexpr int64_t kTileScoresMaxGroup = 16;

// Fewest keys an item needs for either AMX path: below, the tiles' fixed costs per item (query
// tiles packed, a tile configuration per pass and the stall of the first product after it)
// outweigh the products. bench: B8 one-token sequences of SmolLM2's heads, one thread, us,
// amx build / avx512_bf16 build (vector registers) / vLLM's op: 1 key 17.7 / 8.7 / 9.7, 16
// keys 18.1 / 13.6 / 9.5, 32 keys 19.4 / 17.7 / 9.4, 64 keys 24.4 / 26.1 / 12.2.
constexpr int64_t kAmxMinKeys = 33;

// Tokens per tile: rows whose pointers are resolved together and read register-blocked.
constexpr int64_t kTile = 16;
// Longest query (tokens per sequence) the decode kernel takes; longer ones, and non-causal
// queries of more than one token, go to the prefill kernel (prefill.cpp).
constexpr int64_t kDecodeMaxQuery = 16;

// Decode items run in this process (decode_items(), for tests that ask which path ran): [0] on
// AMX tiles (run_item_amx), [1] scores and P V on AMX tiles with the softmax on vector
// registers (run_item with tile_scores and tile_values), [2] on vector registers; [3] of the
// items of [1], those whose P V tile_values handed back to vector registers (a NaN in its
// accumulators, from a non-finite input).
std::atomic<int64_t> g_item_counts[4] = {0, 0, 0, 0};

struct Sequence {
  int64_t first_query, q_len, seq_len, lo;  // lo: first key any of its queries sees
  bool prefill;  // attended by the prefill kernel
  int64_t first_item, num_items;
  int64_t partial_offset;  // into the partial buffers, in rows, when num_items > 1
};

struct Item {
  int64_t seq, start, stop, part;
};

// Horizontal sum of one vector.
inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// res[r] = dot(q + r * q_stride, k) for NR query rows at once: each key vector is loaded once.
template <int NR>
inline void dot_rows(const float* k, const float* q, int64_t q_stride, int64_t size, float* res) {
  fVec acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = fVec(0.f);
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes) {
    const fVec kv = fVec::loadu(k + d);
    for (int r = 0; r < NR; ++r) acc[r] = at::vec::fmadd(fVec::loadu(q + r * q_stride + d), kv, acc[r]);
  }
  if (d < size) {
    const int64_t rest = size - d;
    const fVec kv = fVec::loadu(k + d, rest);
    for (int r = 0; r < NR; ++r)
      acc[r] = at::vec::fmadd(fVec::loadu(q + r * q_stride + d, rest), kv, acc[r]);
  }
  for (int r = 0; r < NR; ++r) res[r] = reduce_sum(acc[r]);
}

// acc[r] += p[r] * v for NR accumulator rows (stride acc_stride): v is loaded once.
template <int NR>
inline void axpy_rows(const float* v, const float* p, float* acc, int64_t acc_stride, int64_t size) {
  fVec pv[NR];
  for (int r = 0; r < NR; ++r) pv[r] = fVec(p[r]);
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes) {
    const fVec vv = fVec::loadu(v + d);
    for (int r = 0; r < NR; ++r) {
      float* a = acc + r * acc_stride + d;
      at::vec::fmadd(pv[r], vv, fVec::loadu(a)).store(a);
    }
  }
  if (d < size) {
    const int64_t rest = size - d;
    const fVec vv = fVec::loadu(v + d, rest);
    for (int r = 0; r < NR; ++r) {
      float* a = acc + r * acc_stride + d;
      at::vec::fmadd(pv[r], vv, fVec::loadu(a, rest)).store(a, rest);
    }
  }
}

// kLanes values of a cache row as float32 (`count` < kLanes: the first `count`, zeros after).
template <typename T>
inline fVec load_f(const T* p) {
  fVec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
template <>
inline fVec load_f<float>(const float* p) {
  return fVec::loadu(p);
}
template <typename T>
inline fVec load_f(const T* p, int64_t count) {
  float line[kLanes];
  for (int64_t i = 0; i < count; ++i) line[i] = static_cast<float>(p[i]);
  return fVec::loadu(line, count);
}
template <>
inline fVec load_f<float>(const float* p, int64_t count) {
  return fVec::loadu(p, count);
}

// out[0..4) = horizontal sums of a0..a3.
inline void reduce4(const fVec& a0, const fVec& a1, const fVec& a2, const fVec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  auto fold = [](const fVec& a) {
    const __m512 v = a;
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  };
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#else
  out[0] = reduce_sum(a0);
  out[1] = reduce_sum(a1);
  out[2] = reduce_sum(a2);
  out[3] = reduce_sum(a3);
#endif
}

// sums[i] = the horizontal sum of a[i], i < N, four vectors at a time (reduce4: one shuffle
// tree for four sums); the last N % 4 with zero vectors beside them, except a single vector
// (N = 1), which one reduce_sum takes in fewer instructions.
template <int N>
inline void reduce_n(const fVec* a, float* sums) {
  if constexpr (N == 1) {
    sums[0] = reduce_sum(a[0]);
  } else {
    int i = 0;
    for (; i + 4 <= N; i += 4) reduce4(a[i], a[i + 1], a[i + 2], a[i + 3], sums + i);
    if constexpr (N % 4 != 0) {
      const fVec zero(0.f);
      float rest[4];
      reduce4(a[i], N % 4 > 1 ? a[i + 1] : zero, N % 4 > 2 ? a[i + 2] : zero, zero, rest);
      for (int k = 0; k < N % 4; ++k) sums[i + k] = rest[k];
    }
  }
}

// out[u * out_stride + r] = scale x the horizontal sum of a[u * NR + r] (U tokens, NR rows):
// the score steps' ending. With AVX-512 and U, NR <= 4, one shuffle tree for all of them puts
// token u's NR sums in 128-bit lane u (two unpack levels sum within lanes, two lane shuffles
// across them: 45 instructions for up to 16 sums, where reduce4 takes 20 per 4 and the sums
// then go out one scalar multiply and store each), then one multiply and a masked store of
// NR floats per token. Else reduce_n.
template <int NR, int U>
__attribute__((always_inline)) inline void store_sums(const fVec* a, float scale, float* out,
                                                      int64_t out_stride) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NR <= 4 && U <= 4) {
    const __m512 zero = _mm512_setzero_ps();
    auto at = [&](int u, int r) -> __m512 { return u < U && r < NR ? __m512(a[u * NR + r]) : zero; };
    __m512 v[4];  // v[u], lane L: the sums over lane L of token u's rows 0..3
    for (int u = 0; u < 4; ++u) {
      const __m512 a0 = at(u, 0), a1 = at(u, 1), a2 = at(u, 2), a3 = at(u, 3);
      const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
      const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
      const __m512d p0 = _mm512_castps_pd(t0), p1 = _mm512_castps_pd(t1);
      v[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)), _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xdd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xdd));
    const __m512 sums = _mm512_mul_ps(
        _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd)), _mm512_set1_ps(scale));
    constexpr __mmask8 kRows = static_cast<__mmask8>((1u << NR) - 1);
    _mm_mask_storeu_ps(out, kRows, _mm512_castps512_ps128(sums));
    if constexpr (U > 1) _mm_mask_storeu_ps(out + out_stride, kRows, _mm512_extractf32x4_ps(sums, 1));
    if constexpr (U > 2) _mm_mask_storeu_ps(out + 2 * out_stride, kRows, _mm512_extractf32x4_ps(sums, 2));
    if constexpr (U > 3) _mm_mask_storeu_ps(out + 3 * out_stride, kRows, _mm512_extractf32x4_ps(sums, 3));
    return;
  }
#endif
  float sums[U * NR];
  reduce_n<U * NR>(a, sums);
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < NR; ++r) out[u * out_stride + r] = sums[u * NR + r] * scale;
}

// Tokens a score tile takes per step for NR query rows: 4 where the 4 x NR accumulators leave
// room for the step's key and query vectors (all NR <= 4 with AVX-512's 32 registers, NR <= 3
// with AVX2's 16), else 2. Each step ends in store_sums: the horizontal sums of all its (token,
// row) pairs in one tree (with 256-bit vectors, ceil(U x NR / 4) reduce4 trees), where one
// reduce_sum per pair took ~9 instructions (SmolLM2's 3 rows of D = 64: the sums were most of
// a decode's score time, measured with perf). Four rows (G = 4: 32/8 heads) took 2 tokens a
// step on AVX-512 too until 2026-12-07, half a tree each; 4 a step cut the score pass of one
// sequence of 256 keys (32/8 heads of 128, one thread, TSC ticks a sequence, two runs each)
// in float32 decode 63-65K -> 56-61K, speculative (4 tokens) 183-185K -> 147-153K, and in
// the avx512_bf16 build's bfloat16 speculative 214-219K -> 198-200K.
template <int NR>
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kScoreUnroll = NR <= 4 ? 4 : 2;
#else
constexpr int kScoreUnroll = NR * 4 <= 12 ? 4 : 2;
#endif

// Scores of NR query rows (q, stride `size`) against U token rows k[0..U) (pointers already
// at the KV head): out[u * out_stride + r]. U x NR accumulators, summed by store_sums.
template <typename T, int NR, int U>
inline void score_step(const T* const* k, const float* q, int64_t size, float* out,
                       int64_t out_stride) {
  fVec a[U * NR];  // a[u * NR + r]: token u, row r
  for (int i = 0; i < U * NR; ++i) a[i] = fVec(0.f);
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes) {
    fVec x[U];
    for (int u = 0; u < U; ++u) x[u] = load_f<T>(k[u] + d);
    for (int r = 0; r < NR; ++r) {
      const fVec qv = fVec::loadu(q + r * size + d);
      for (int u = 0; u < U; ++u) a[u * NR + r] = at::vec::fmadd(qv, x[u], a[u * NR + r]);
    }
  }
  if (d < size) {
    const int64_t rest = size - d;
    fVec x[U];
    for (int u = 0; u < U; ++u) x[u] = load_f<T>(k[u] + d, rest);
    for (int r = 0; r < NR; ++r) {
      const fVec qv = fVec::loadu(q + r * size + d, rest);
      for (int u = 0; u < U; ++u) a[u * NR + r] = at::vec::fmadd(qv, x[u], a[u * NR + r]);
    }
  }
  store_sums<NR, U>(a, 1.f, out, out_stride);
}

#if defined(CPU_CAPABILITY_AVX512)
// score_step with the NR query rows of C x 16 values held in registers (qv[r * C + c]) for a
// whole tile, where score_step loads them again at every step: the stores of a step's sums
// may alias the queries, so the compiler cannot keep them. Taken where NR x C <= 12, so that
// the queries, the U x NR accumulators and U key vectors fit AVX-512's 32 registers (SmolLM2:
// 3 rows of 64). AMD EPYC: the score pass of one SmolLM2 sequence (vector_score_steps' step)
// 15.3-15.7 -> 11.9-12.3 TSC ticks per key and KV head; SmolLM2's float32 decode, alternating
// processes, 1.15-1.16x -> 1.06-1.07x of vLLM's op on one thread, 1.12-1.14x -> 1.09x on two;
// over 30 layers' caches (bound by memory) within noise. store_sums is always inlined: out of
// line, the accumulators go through memory.
template <typename T, int NR, int U, int C>
__attribute__((always_inline)) inline void score_step_held(const T* const* k, const fVec* qv,
                                                           float* out, int64_t out_stride) {
  fVec a[U * NR];  // a[u * NR + r]: token u, row r
  for (int i = 0; i < U * NR; ++i) a[i] = fVec(0.f);
  for (int c = 0; c < C; ++c) {
    fVec x[U];
    for (int u = 0; u < U; ++u) x[u] = load_f<T>(k[u] + c * kLanes);
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) a[u * NR + r] = at::vec::fmadd(qv[r * C + c], x[u], a[u * NR + r]);
  }
  store_sums<NR, U>(a, 1.f, out, out_stride);
}

template <typename T, int NR, int C>
inline void score_tile_held(const T* const* k, int64_t nt, const float* q, float* out,
                            int64_t out_stride) {
  constexpr int U = kScoreUnroll<NR>;
  fVec qv[NR * C];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) qv[r * C + c] = fVec::loadu(q + (r * C + c) * kLanes);
  int64_t t = 0;
  for (; t + U <= nt; t += U) score_step_held<T, NR, U, C>(k + t, qv, out + t * out_stride, out_stride);
  for (; t < nt; ++t) score_step_held<T, NR, 1, C>(k + t, qv, out + t * out_stride, out_stride);
}
#endif

// Scores of NR query rows (q, stride D) against the keys of `nt` token rows (pointers already
// at the KV head), kScoreUnroll<NR> tokens a step, then one at a time: out[t * out_stride + r].
template <typename T, int NR>
inline void score_tile(const T* const* k, int64_t nt, const float* q, int64_t size, float* out,
                       int64_t out_stride) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NR <= 3)
    if (size == 4 * kLanes) return score_tile_held<T, NR, 4>(k, nt, q, out, out_stride);
  if constexpr (NR <= 4)
    if (size == 2 * kLanes) return score_tile_held<T, NR, 2>(k, nt, q, out, out_stride);
#endif
  constexpr int U = kScoreUnroll<NR>;
  int64_t t = 0;
  for (; t + U <= nt; t += U) score_step<T, NR, U>(k + t, q, size, out + t * out_stride, out_stride);
  for (; t < nt; ++t) score_step<T, NR, 1>(k + t, q, size, out + t * out_stride, out_stride);
}

#if defined(ATTN_DI_AVX512_BF16)
// bfloat16 values in one 512-bit vector (VDPBF16PS's 32 pairs' worth of one operand).
constexpr int64_t kPair = 32;

// Scores of NR bfloat16 query rows (unscaled, stride `size`) against U bfloat16 token rows
// k[0..U) (pointers already at the KV head), times `scale`: out[u * out_stride + r].
// AVX512_BF16's VDPBF16PS multiplies 32 bfloat16 pairs (each product exact in float32) and
// adds them pairwise into 16 float32 lanes, so the cache rows are read as they are, without a
// conversion; accumulation is float32. The last size % 32 values are loaded masked (`tail`:
// zeros beyond the head), so any head size works. Always inlined: where GCC kept it a call
// of its own (from score_tile_bf16, inlined into run_item), its accumulators went through
// memory each step, and SmolLM2's one-thread bfloat16 decode took 1.12x its inlined time
// (AMD EPYC, avx512_bf16 build: 213 against 159 us a call; perf showed the step out of line).
template <int NR, int U>
__attribute__((always_inline)) inline void score_step_bf16(const c10::BFloat16* const* k,
                                                           const c10::BFloat16* q, int64_t size,
                                                           int64_t full, __mmask32 tail, float scale,
                                                           float* out, int64_t out_stride) {
  auto load = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  auto load_tail = [tail](const c10::BFloat16* p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(tail, p);
  };
  fVec a[U * NR];  // a[u * NR + r]: token u, row r
  for (int i = 0; i < U * NR; ++i) a[i] = fVec(0.f);
  for (int64_t d = 0; d < full; d += kPair) {
    __m512bh x[U];
    for (int u = 0; u < U; ++u) x[u] = load(k[u] + d);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qv = load(q + r * size + d);
      for (int u = 0; u < U; ++u) a[u * NR + r] = _mm512_dpbf16_ps(a[u * NR + r], qv, x[u]);
    }
  }
  if (tail != 0) {
    __m512bh x[U];
    for (int u = 0; u < U; ++u) x[u] = load_tail(k[u] + full);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qv = load_tail(q + r * size + full);
      for (int u = 0; u < U; ++u) a[u * NR + r] = _mm512_dpbf16_ps(a[u * NR + r], qv, x[u]);
    }
  }
  store_sums<NR, U>(a, scale, out, out_stride);
}

// score_step_bf16 over the keys of `nt` token rows, kScoreUnroll<NR> tokens a step, then one
// at a time: out[t * out_stride + r].
template <int NR>
inline void score_tile_bf16(const c10::BFloat16* const* k, int64_t nt, const c10::BFloat16* q,
                            int64_t size, float scale, float* out, int64_t out_stride) {
  constexpr int U = kScoreUnroll<NR>;
  const int64_t full = size / kPair * kPair;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (size - full)) - 1);
  int64_t t = 0;
  for (; t + U <= nt; t += U)
    score_step_bf16<NR, U>(k + t, q, size, full, tail, scale, out + t * out_stride, out_stride);
  for (; t < nt; ++t)
    score_step_bf16<NR, 1>(k + t, q, size, full, tail, scale, out + t * out_stride, out_stride);
}

// The probabilities of a token-major softmax block (p[j * rows + r], n keys) as bfloat16
// pairs for run_item_amx's A tiles: pairs[u * rows + r] = bf16(p[2u, r]) | bf16(p[2u + 1, r])
// << 16, the odd last key paired with 0, 16 at a time with VCVTNEPS2BF16 (round to nearest
// even). It reads denormal inputs as zero; softmax_exp gives none.
inline void pack_probability_pairs(const float* p, int64_t n, int64_t rows,
                                   LineVector<uint32_t>& pairs) {
  const int64_t count = (n + 1) / 2;
  pairs.resize(count * rows);
  for (int64_t u = 0; u < count; ++u) {
    const float* lo = p + 2 * u * rows;
    const bool has_hi = 2 * u + 1 < n;
    for (int64_t r = 0; r < rows; r += 16) {
      const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, rows - r)) - 1);
      const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, lo + r));
      const __m256i h = has_hi ? (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, lo + rows + r))
                               : _mm256_setzero_si256();
      const __m512i word = _mm512_or_si512(_mm512_cvtepu16_epi32(l),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm512_mask_storeu_epi32(pairs.data() + u * rows + r, m, word);
    }
  }
}

// value_tile for bfloat16 rows of D a multiple of 32, widened by one VPUNPCKLWD / VPUNPCKHWD
// against zero per 32 values (instead of two zero-extensions and two shifts): each 32 columns'
// accumulators then hold D columns 8L + e (first) and 8L + 4 + e (second, L, e < 4), an order
// kept for the whole item and put back by unpermute_rows.
template <int NR>
inline void value_tile_bf16_paired(const c10::BFloat16* const* v, int64_t nt, const float* p,
                                   int64_t p_stride, float* acc, int64_t size) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t d = 0; d < size; d += 32) {
    __m512 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + r * size + d);
      a[r][1] = _mm512_loadu_ps(acc + r * size + d + 16);
    }
    for (int64_t t = 0; t < nt; ++t) {
      const __m512i x = _mm512_loadu_si512(v[t] + d);
      const __m512 x0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
      const __m512 x1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
      for (int r = 0; r < NR; ++r) {
        const __m512 pr = _mm512_set1_ps(p[t * p_stride + r]);
        a[r][0] = _mm512_fmadd_ps(pr, x0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(pr, x1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_ps(acc + r * size + d, a[r][0]);
      _mm512_storeu_ps(acc + r * size + d + 16, a[r][1]);
    }
  }
}

// value_tile_bf16_paired by VDPBF16PS on token pairs: the rows of keys 2u and 2u + 1 are
// interleaved by one VPUNPCKLWD / VPUNPCKHWD per 32 values (the columns in the same order as
// value_tile_bf16_paired's), and each lane adds p_2u v_2u[d] + p_2u+1 v_2u+1[d] with the
// probability pair broadcast (pairs[u * p_stride + r], pack_probability_pairs: P rounded to
// bfloat16, as a bfloat16 GEMM of P V rounds it; the sums stay float32). An odd last key pairs
// with a zero row and probability. Half the instructions of the FMAs for the same products
// where VDPBF16PS issues at the FMA's rate (AMD Zen 4: 0.71 against 0.74 TSC ticks,
// benchmarks/vector_score_steps.cpp); where it issues at a quarter of it, half the FMA's
// products (Intel Sapphire Rapids: 1.12 against 0.31), the FMAs win, so only the avx512_bf16
// build (no AMX) takes it.
template <int NR>
inline void value_tile_bf16_dot(const c10::BFloat16* const* v, int64_t nt, const uint32_t* pairs,
                                int64_t p_stride, float* acc, int64_t size) {
  const int64_t count = (nt + 1) / 2;
  for (int64_t d = 0; d < size; d += 32) {
    __m512 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + r * size + d);
      a[r][1] = _mm512_loadu_ps(acc + r * size + d + 16);
    }
    for (int64_t u = 0; u < count; ++u) {
      const __m512i x = _mm512_loadu_si512(v[2 * u] + d);
      const __m512i y = 2 * u + 1 < nt ? _mm512_loadu_si512(v[2 * u + 1] + d) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[u * p_stride + r]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], lo, pr);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], hi, pr);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_ps(acc + r * size + d, a[r][0]);
      _mm512_storeu_ps(acc + r * size + d + 16, a[r][1]);
    }
  }
}

// `size` floats (a multiple of 32) of src, in the order of a VPUNPCKLWD / VPUNPCKHWD pairing
// (per 32 columns, position i holds column 8 (i / 4 % 4) + i % 4, + 4 for i >= 16), into dst
// in D's order (dst may be src): two permutes per 32 columns.
inline void unpermute_row(const float* src, float* dst, int64_t size) {
  __m512i first, second;
  unpack_order(first, second);
  for (int64_t d = 0; d < size; d += 32) {
    const __m512 lo = _mm512_loadu_ps(src + d), hi = _mm512_loadu_ps(src + d + 16);
    _mm512_storeu_ps(dst + d, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(dst + d + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

constexpr bool kNativeBf16Dot = true;
#else
constexpr bool kNativeBf16Dot = false;
#endif

// acc[r] += sum_t p[t * p_stride + r] * v_t for NR accumulator rows (stride D) and `nt`
// token rows (pointers already at the KV head); two vectors of D per pass, kept in registers.
template <typename T, int NR>
inline void value_tile(const T* const* v, int64_t nt, const float* p, int64_t p_stride, float* acc,
                       int64_t size) {
  int64_t d = 0;
  for (; d + 2 * kLanes <= size; d += 2 * kLanes) {
    fVec a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = fVec::loadu(acc + r * size + d);
      a[r][1] = fVec::loadu(acc + r * size + d + kLanes);
    }
    for (int64_t t = 0; t < nt; ++t) {
      const fVec x0 = load_f<T>(v[t] + d), x1 = load_f<T>(v[t] + d + kLanes);
      for (int r = 0; r < NR; ++r) {
        const fVec pr(p[t * p_stride + r]);
        a[r][0] = at::vec::fmadd(pr, x0, a[r][0]);
        a[r][1] = at::vec::fmadd(pr, x1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      a[r][0].store(acc + r * size + d);
      a[r][1].store(acc + r * size + d + kLanes);
    }
  }
  for (; d < size; d += kLanes) {
    const int64_t rest = std::min<int64_t>(kLanes, size - d);
    fVec a[NR];
    for (int r = 0; r < NR; ++r) a[r] = fVec::loadu(acc + r * size + d, rest);
    for (int64_t t = 0; t < nt; ++t) {
      const fVec x = rest == kLanes ? load_f<T>(v[t] + d) : load_f<T>(v[t] + d, rest);
      for (int r = 0; r < NR; ++r) a[r] = at::vec::fmadd(fVec(p[t * p_stride + r]), x, a[r]);
    }
    for (int r = 0; r < NR; ++r) a[r].store(acc + r * size + d, rest);
  }
}

// A token row (H_kv heads of D values, head g at row + g * head_stride) as float32 [H_kv, D]:
// the row itself where it already is that (float32, heads adjacent), else a copy in `scratch`.
template <typename T>
inline const float* as_float(const T* row, int64_t kv_heads, int64_t size, int64_t head_stride,
                             float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    if (head_stride == size) return row;
  }
  for (int64_t g = 0; g < kv_heads; ++g) {
    if constexpr (std::is_same_v<T, float>) {
      std::copy(row + g * head_stride, row + g * head_stride + size, scratch + g * size);
    } else {
      convert_head<T>(row + g * head_stride, size, scratch + g * size);
    }
  }
  return scratch;
}

// Token rows touched ahead of use, one line per 4 KiB: a token row (H_kv * D values) is often
// a page of its own, and the hardware prefetchers stop at page boundaries, so each row would
// otherwise start with a full miss (measured: ~10-30% of a cold decode on the dev machine).
// Until 2026-12-07 GCC deleted these calls in the decode kernel (ATTN_DI_PREFETCH_HELPER in
// kernel.h says how); they now run where rows_span_pages says they pay.
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kPageBytes = 4096;

// A token row's heads ahead of use, every Step-th byte (by default one line per page; kernel.h's
// prefetch_lines): one span where the heads are adjacent, else each head.
template <int64_t Step = kPageBytes, int Locality = 3, typename T>
ATTN_DI_PREFETCH_HELPER void prefetch_row(const T* row, int64_t kv_heads, int64_t size, int64_t head_stride) {
  if (head_stride == size) {
    prefetch_lines<Step, Locality>(row, kv_heads * size * static_cast<int64_t>(sizeof(T)));
    return;
  }
  for (int64_t g = 0; g < kv_heads; ++g)
    prefetch_lines<Step, Locality>(row + g * head_stride, size * static_cast<int64_t>(sizeof(T)));
}

// Whether a cache's token rows are worth prefetch_row: their spans (a row, or a head's row
// where the heads are apart) are half a page or more. Shorter rows share their pages with the
// next tokens', which the hardware prefetchers stream; walking them ahead (a block-table lookup
// and a prefetch a row) measured slower: SmolLM2's decode (3 KV heads of 64) from 30 layers'
// caches, one thread, AMD EPYC, 0.74-0.77 ms against 0.69-0.72 ms a call in float32. B8 x
// 2048's rows (8 heads of 128: 2-4 KiB) gained: from 30 layers' caches, two threads, float32
// 0.68-0.75x of vLLM's op against 0.80-0.88x without.
template <typename T>
inline bool rows_span_pages(const CacheView<T>& view, int64_t kv_heads, int64_t size) {
  const int64_t bytes = size * static_cast<int64_t>(sizeof(T));
  return (view.head_stride == size ? kv_heads * bytes : bytes) >= kPageBytes / 2;
}

// Pass 1 fetches the value rows pass 2 will read into L2 (prefetch_row<64, 2>: every line,
// PREFETCHT1) while it streams the keys: two streams in flight where there was one, and pass 2
// then reads from L2. Only for items whose value rows fit in half this core's L2 (sysconf's
// size where glibc gives it, else 256 KiB), so that pass 1's own key stream does not evict them
// first: SmolLM2's decode on one core (560 x 3 x 64, 430 KB of float32), not B8 x 2048 at 8 x
// 128 (8 MB an item). Measured on an AMD EPYC (1 MB L2): SmolLM2's decode from 30 layers'
// caches 1.02-1.16x -> 0.80-0.94x of vLLM's op in float32, 1.19-1.25x -> 0.89-0.93x in
// bfloat16; with warm caches, and where the rows do not fit, within the spread.
inline int64_t l2_prefetch_budget() {
  static const int64_t budget = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long size = 0;
#endif
    return size > 0 ? static_cast<int64_t>(size) / 2 : int64_t{256} << 10;
  }();
  return budget;
}

// Query rows [i_lo, i_hi) (of q_len) may see key position `key`: causal and windowed.
inline void visible_rows(const Sequence& s, const Options& o, int64_t key, int64_t& i_lo, int64_t& i_hi) {
  const int64_t first_pos = s.seq_len - s.q_len;
  i_lo = std::max<int64_t>(0, key - first_pos);
  i_hi = o.window > 0 ? std::min<int64_t>(s.q_len, key - first_pos + o.window) : s.q_len;
}

// Whether every query row sees every key of [first, first + count): then no key in it is masked.
inline bool full_tile(const Sequence& s, const Options& o, int64_t first, int64_t count) {
  int64_t lo_first, hi_first, lo_last, hi_last;
  visible_rows(s, o, first, lo_first, hi_first);
  visible_rows(s, o, first + count - 1, lo_last, hi_last);
  return hi_first == s.q_len && lo_last == 0;
}

// Calls f(std::integral_constant<int, NR>{}, h) over the G query heads of one KV head in
// groups of NR = 4, then one group of the 1-3 left: every key or value vector loaded once
// serves the whole group (G = 3, 5, 6, 7 are common: SmolLM2 9/3, Qwen2.5 14/2).
template <typename F>
inline void for_head_groups(int64_t G, F&& f) {
  int64_t h = 0;
  for (; h + 4 <= G; h += 4) f(std::integral_constant<int, 4>{}, h);
  switch (G - h) {
    case 3: f(std::integral_constant<int, 3>{}, h); break;
    case 2: f(std::integral_constant<int, 2>{}, h); break;
    case 1: f(std::integral_constant<int, 1>{}, h); break;
    default: break;
  }
}


// A tile operand read from the cache: 16 key or value rows of KV head 0 at `base`, `head`
// elements to the next KV head's, `stride` bytes between keys (Kernel::row_tile).
struct TileOperand {
  const c10::BFloat16* base;
  int64_t head, stride;
};

// Per-thread scratch, kept by each thread of the pool across calls (a decode step's calls are
// short: allocating per call would cost as much as the work), grown as needed.
struct Scratch {
  LineVector<float> queries, scores, acc, key_row, value_row, pattern, row_max, row_sum, stage;
  LineVector<c10::BFloat16> raw_queries;  // bfloat16 queries as given, for score_tile_bf16
  LineVector<uint32_t> prob_pairs;  // an item's bfloat16 probability pairs (run_item_amx)
  const float* staged[kTile];  // rows of `stage`, as score_tile / value_tile take them
  // The AMX path (run_item_amx): queries as B tiles, probabilities as A tiles, one chunk of
  // value rows as B tiles, key rows gathered where a tile's 16 rows are not equally spaced,
  // and tiles stored back as float32.
  LineVector<uint32_t> query_tiles, prob_tiles;
  LineVector<c10::BFloat16> value_tiles, key_gather;
  // tile_values: the probabilities as A tiles, and the value rows of the 16-key groups not in
  // place (tile_in_place), gathered.
  LineVector<uint32_t> prob_words;
  LineVector<c10::BFloat16> value_gather;
  std::vector<TileOperand> value_operands;
  LineVector<float> tile_out, out_tiles;
  std::vector<int32_t> col_rows;
#if defined(ATTN_DI_AMX)
  // The tile configuration this thread loaded: C tiles `bytes` wide (configure_tiles), minus
  // the rows of configure_value_tiles, or 0: none.
  int tile_bytes = 0;

  // The tile configuration of C tiles `bytes` wide on this thread, loaded unless it is already.
  void use_tiles(int bytes) {
    if (tile_bytes != bytes) configure_tiles(bytes);
    tile_bytes = bytes;
  }

  // A configuration of tile_values (configure_value_tiles), unless it is loaded.
  void use_value_tiles(int rows, bool b_pairs) {
    const int key = -(rows + (b_pairs ? 32 : 0));
    if (tile_bytes != key) configure_value_tiles(rows, b_pairs);
    tile_bytes = key;
  }
#endif

  static Scratch& of_this_thread() {
    thread_local Scratch scratch;
    return scratch;
  }
};

// The running max of one lane of the pattern and a vector of scores: VMAXPS leaves out a NaN
// in x (it returns its second operand where either is NaN).
inline fVec lane_max(const fVec& x, const fVec& old) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(x, old);
#else
  return fVec::blendv(old, x, x > old);
#endif
}

// softmax_numerators' two sweeps over the first `full` scores (whole periods of P vectors),
// the pattern's P vectors of maxima (then shifts) and sums held in registers rather than
// reloaded and stored per vector: the sweeps are most of a decode item's softmax
// (SmolLM2's 9 heads: P = 9).
template <int P>
void max_sweep(const float* scores, int64_t full, float* lanes) {
  fVec m[P];
  for (int k = 0; k < P; ++k) m[k] = fVec::loadu(lanes + k * kLanes);
  for (int64_t c = 0; c < full; c += P * kLanes)
    for (int k = 0; k < P; ++k) m[k] = lane_max(fVec::loadu(scores + c + k * kLanes), m[k]);
  for (int k = 0; k < P; ++k) m[k].store(lanes + k * kLanes);
}

template <int P>
void exp_sweep(float* scores, int64_t full, const float* lanes, float* sums, float scale) {
  fVec shift[P], sum[P];
  const fVec factor(scale);
  for (int k = 0; k < P; ++k) {
    shift[k] = fVec::loadu(lanes + k * kLanes);
    sum[k] = fVec::loadu(sums + k * kLanes);
  }
  for (int64_t c = 0; c < full; c += P * kLanes)
    for (int k = 0; k < P; ++k) {
      float* at = scores + c + k * kLanes;
      const fVec e = softmax_exp((fVec::loadu(at) - shift[k]) * factor);
      e.store(at);
      sum[k] = sum[k] + e;
    }
  for (int k = 0; k < P; ++k) sum[k].store(sums + k * kLanes);
}

// Periods of at most this many vectors take the register sweeps (two arrays of P vectors
// beside softmax_exp's constants and temporaries: 32 registers of 512 bits, 16 of 256).
constexpr int64_t kRegisterPeriods = kLanes >= 16 ? 9 : 4;

// The sweep for a period of `vectors` vectors over `full` scores; false where no register
// sweep has that many (the per-vector loop in memory takes them).
template <int P = 1>
bool register_sweep(bool exp, float* scores, int64_t full, int64_t vectors, float* lanes,
                    float* sums, float scale) {
  if constexpr (P > kRegisterPeriods) {
    return false;
  } else {
    if (vectors != P) return register_sweep<P + 1>(exp, scores, full, vectors, lanes, sums, scale);
    if (exp) exp_sweep<P>(scores, full, lanes, sums, scale);
    else max_sweep<P>(scores, full, lanes);
    return true;
  }
}

// Softmax numerators of a token-major score block (scores[j * rows + r], n keys) in place:
// per row r its max over the keys into row_max[r], then e = exp(s - max) in place and its
// sum into row_sum[r] (row_max and row_sum start at -inf and 0). A row whose scores are all
// -inf is shifted by 0 and sums to 0; a NaN score makes its row's numerators and sum NaN (and
// merge_partials its output row NaN, as the reference's softmax gives): the max leaves NaN
// out (one VMAXPS per vector, no NaN-propagating compare and blend), softmax_exp keeps it.
//
// The block is swept as one flat array of full vectors. Element i belongs to row i % rows,
// so the rows of the lanes repeat with period P = lcm(rows, kLanes): one period's worth of
// running maxima / shifts / sums (`pattern`, 2P floats) serves every period. With rows a
// multiple of kLanes (32 heads) this is the row-major sweep; with 9 heads (SmolLM2) it
// avoids a scalar exp per score.
//
// `scale` (> 0) is a factor the scores still lack: e = exp((s - max) * scale) and row_max[r]
// holds the scaled max, as if the block had been scaled first (the max of the scaled scores is
// the scaled max: rounding is monotone). tile_scores leaves its scaling here, which saves a
// pass over the block.
inline void softmax_numerators(float* scores, int64_t n, int64_t rows, float* row_max,
                               float* row_sum, LineVector<float>& pattern, float scale = 1.f) {
  const int64_t total = n * rows;
  const int64_t period = std::lcm(rows, kLanes);
  const int64_t used = std::min(period, total);  // lanes of the pattern that hold a score
  pattern.assign(2 * period, kNegInf);
  float* lanes = pattern.data();       // running max, then the shift, per lane of a period
  float* sums = lanes + period;        // running sum per lane of a period
  // Whole periods in registers where the period is short enough; the rest (a partial last
  // period, or every period of a long one) by the loops below.
  int64_t swept = total / period * period;
  if (!register_sweep(false, scores, swept, period / kLanes, lanes, sums, scale)) swept = 0;
  // Periods start at multiples of `period`, the last one possibly partial: lane k of every
  // period belongs to row k % rows.
  for (int64_t c = swept; c < total; c += period) {
    const int64_t len = std::min(period, total - c);
    for (int64_t k = 0; k < len; k += kLanes) {
      const int64_t count = std::min(kLanes, len - k);
      const fVec old = fVec::loadu(lanes + k);
      const fVec peak = lane_max(fVec::loadu(scores + c + k, count), old);
      fVec::set(old, peak, count).store(lanes + k);
    }
  }
  // The pattern is `repeats` copies of the rows side by side (lane p = i * rows + r); the
  // first `filled` copies hold scores. Per row, its max over them, then every copy's lanes
  // get the row's shift (0 for a row of -inf) and a zero sum: vectors across the rows rather
  // than a scalar pass per lane (~700 TSC ticks of a 64-key item with SmolLM2's 9 rows).
  const int64_t repeats = period / rows, filled = used / rows;
  const fVec zero(0.f), neg_inf(kNegInf);
  for (int64_t r = 0; r < rows; r += kLanes) {
    const int64_t count = std::min(kLanes, rows - r);
    fVec peak = fVec::loadu(row_max + r, count);
    for (int64_t i = 0; i < filled; ++i) peak = lane_max(fVec::loadu(lanes + i * rows + r, count), peak);
    peak.store(row_max + r, count);
    const fVec shift = fVec::blendv(peak, zero, peak == neg_inf);
    for (int64_t i = 0; i < repeats; ++i) shift.store(lanes + i * rows + r, count);
  }
  std::fill(sums, sums + period, 0.f);
  if (swept > 0) register_sweep(true, scores, swept, period / kLanes, lanes, sums, scale);
  for (int64_t c = swept; c < total; c += period) {
    float* block = scores + c;
    const int64_t len = std::min(period, total - c);
    for (int64_t k = 0; k < len; k += kLanes) {
      const int64_t count = std::min(kLanes, len - k);
      const fVec x = (fVec::loadu(block + k, count) - fVec::loadu(lanes + k)) * fVec(scale);
      const fVec e = softmax_exp(x);
      e.store(block + k, count);
      (fVec::loadu(sums + k) + fVec::set(zero, e, count)).store(sums + k);
    }
  }
  for (int64_t r = 0; r < rows; r += kLanes) {  // in lane order, as a scalar pass would add
    const int64_t count = std::min(kLanes, rows - r);
    fVec total_sum = fVec::loadu(row_sum + r, count);
    for (int64_t i = 0; i < filled; ++i) total_sum = total_sum + fVec::loadu(sums + i * rows + r, count);
    total_sum.store(row_sum + r, count);
  }
  if (scale != 1.f)
    for (int64_t r = 0; r < rows; ++r) row_max[r] *= scale;
}

template <typename T>
struct Kernel {
  const T* query;
  int64_t q_stride0, q_stride1;
  CacheView<T> keys;    // key_cache
  CacheView<T> values;  // value_cache
  const int64_t* table;
  int64_t table_stride;
  T* out;
  int64_t out_stride0, out_stride1;
  Options o;
  const std::vector<Sequence>* seqs;
  float* partial_acc;  // [rows, D] per partial row
  float* partial_max;  // [rows]
  float* partial_sum;  // [rows]
  bool amx = false;    // bfloat16 items run on AMX tiles (run_item_amx)

  // One KV head's rows of a tile (D values each, `offset` into each token row) for the
  // register-blocked tiles: in place for float32; for bfloat16/float16 converted once into
  // one contiguous block of scratch, each row read once and in order (read in place, rows a
  // token row apart, a power of two bytes, fall into a few L1 sets, and value_tile reads each
  // several times, once per 32 values of D: measured 10-20% slower).
  const float* const* head_tile(const T* const* tile_rows, int64_t nt, int64_t offset,
                                int64_t size, Scratch& sc) const {
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t t = 0; t < nt; ++t) sc.staged[t] = tile_rows[t] + offset;
    } else {
      sc.stage.resize(kTile * size);
      for (int64_t t = 0; t < nt; ++t) {
        float* dst = sc.stage.data() + t * size;
        convert_head<T>(tile_rows[t] + offset, size, dst);
        sc.staged[t] = dst;
      }
    }
    return sc.staged;
  }

  // The token row of key `pos` of sequence `seq`. Block sizes are powers of two in practice
  // (vLLM's 16, 32, 128): a shift and a mask then, not a 64-bit division per key.
  __attribute__((always_inline)) const T* key_row(const CacheView<T>& view, const Sequence&, int64_t seq,
                                                 int64_t pos) const {
    const int64_t bs = o.block_size;
    if ((bs & (bs - 1)) == 0) {
      const int shift = __builtin_ctzll(static_cast<unsigned long long>(bs));
      return view.row(table[seq * table_stride + (pos >> shift)], pos & (bs - 1));
    }
    return view.row(table[seq * table_stride + pos / bs], pos % bs);
  }

  // The token rows of the item's keys [from, to) (counted from its start, clipped to its last
  // key), prefetched ahead of use by prefetch_row<Step, Locality>.
  template <int64_t Step = kPageBytes, int Locality = 3>
  ATTN_DI_PREFETCH_HELPER void touch_rows(const CacheView<T>& view, const Sequence& s, const Item& item,
                                          int64_t from, int64_t to) const {
    const int64_t stop = std::min(item.stop - item.start, to);
    for (int64_t t = from; t < stop; ++t)
      prefetch_row<Step, Locality>(key_row(view, s, item.seq, item.start + t), o.kv_heads, o.head_size,
                                   view.head_stride);
  }


  // The scores of keys [j0, j0 + nt) of the item (scores[j * rows + r], every pair computed
  // and scaled): -inf for the pairs a row may not see, then the soft cap and ALiBi on the
  // others. Every key of an item is a written slot some query row sees (its range starts at
  // the window's first visible key), so nothing masked is garbage, and it never reaches a
  // product after the softmax (probability 0).
  void mask_scores(const Sequence& s, const Item& item, float* scores, int64_t j0, int64_t nt) const {
    const int64_t H = o.heads, rows = s.q_len * H;
    const bool full = full_tile(s, o, item.start + j0, nt);
    if (full && o.soft_cap == 0.f && o.alibi == nullptr) return;
    for (int64_t t = 0; t < nt; ++t) {
      int64_t i_lo = 0, i_hi = s.q_len;
      if (!full) visible_rows(s, o, item.start + j0 + t, i_lo, i_hi);
      float* sj = scores + (j0 + t) * rows;
      const int64_t r_lo = i_lo * H, r_hi = std::max(i_lo, i_hi) * H;
      std::fill(sj, sj + r_lo, kNegInf);
      std::fill(sj + r_hi, sj + rows, kNegInf);
      if (r_lo < r_hi) modify_scores(s, item, sj, j0 + t, r_lo, r_hi);
    }
  }

#if defined(ATTN_DI_AMX)
  // Whether positions [pos, pos + nt) are 16 consecutive slots of one block: their rows of a
  // cache plane are then a tile operand in place (a token row apart).
  bool tile_in_place(int64_t pos, int64_t nt) const {
    return nt == 16 && pos / o.block_size == (pos + 15) / o.block_size;
  }

  // The rows of positions [pos, pos + 16) of the item in one cache plane (all KV heads) as a
  // tile operand: in place where they are one block's consecutive slots (tile_in_place), else
  // gathered into `gather` ([KV, 16, D]; zeros past the item's `nt` positions).
  TileOperand row_tile(const CacheView<T>& view, const Sequence& s, const Item& item, int64_t pos,
                       int64_t nt, c10::BFloat16* gather) const {
    const int64_t D = o.head_size, KV = o.kv_heads;
    if (tile_in_place(pos, nt)) return {key_row(view, s, item.seq, pos), view.head_stride, view.token_stride * 2};
    for (int64_t t = 0; t < 16; ++t) {
      const T* row = t < nt ? key_row(view, s, item.seq, pos + t) : nullptr;
      for (int64_t g = 0; g < KV; ++g) {
        c10::BFloat16* dst = gather + (g * 16 + t) * D;
        if (row) std::memcpy(dst, row + g * view.head_stride, D * 2);
        else std::memset(dst, 0, D * 2);
      }
    }
    return {gather, 16 * D, D * 2};
  }

  // The A operand of keys [pos, pos + 16) of the item (row_tile, gathered into sc.key_gather).
  TileOperand key_tile(const Sequence& s, const Item& item, int64_t pos, int64_t nt, Scratch& sc) const {
    sc.key_gather.resize(o.kv_heads * 16 * o.head_size);
    return row_tile(keys, s, item, pos, nt, sc.key_gather.data());
  }

  // The item's queries as B tiles: query_tiles[((g * chunks + c) * D/2 + p) * 16 + col] is
  // the pair (q[2p], q[2p + 1]) of KV head g's query row m = c * 16 + col (token m / G, head
  // g * G + m % G; zeros past its M = q_len x G rows, in chunks of 16): per 32 values of D, the
  // chunk's query rows transposed as 32-bit words.
  void pack_query_tiles(const Sequence& s, Scratch& sc) const {
    const int64_t G = o.group, D = o.head_size, KV = o.kv_heads;
    const int64_t M = s.q_len * G, chunks = (M + 15) / 16, words = D / 2 * 16;
    sc.query_tiles.resize(KV * chunks * words);
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t cols = std::min<int64_t>(16, M - c * 16);
        const T* src[16];
        for (int64_t col = 0; col < cols; ++col) {
          const int64_t m = c * 16 + col;
          src[col] = query + (s.first_query + m / G) * q_stride0 + (g * G + m % G) * q_stride1;
        }
        uint32_t* dst = sc.query_tiles.data() + (g * chunks + c) * words;
        for (int64_t kc = 0; kc < D / 32; ++kc) {
          __m512i r[16];
          for (int64_t col = 0; col < 16; ++col)
            r[col] = col < cols ? _mm512_loadu_si512(src[col] + kc * 32) : _mm512_setzero_si512();
          transpose_16x16(r);
          for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (kc * 16 + p) * 16, r[p]);
        }
      }
  }

  // Pass 1 of a one-token item (q_len 1, G <= 16 query heads per KV head: kTileScoresMaxGroup
  // picks the items) on AMX tiles, for
  // run_item's vector pass 2: per 16 keys and KV head g, S^T = K Q^T with the key rows as the
  // A operand (key_tile) and the G query rows of g as a B tile packed once (transposed pairs).
  // The C tiles are configured G columns wide (amx.h), so each stores its 16 keys' G scores
  // straight into the score block (rows g * G .. g * G + G - 1 of scores[j * H + r]); the
  // block is scaled once at the end (a tile store's data is not forwarded to vector loads:
  // reading it right away would wait on it), or by the softmax where scale_in_softmax(), and
  // then masked (mask_scores). `scores` holds (n + 15) x H floats: a partial last tile's extra
  // rows land past the item's keys.
  void tile_scores(const Item& item, const Sequence& s, Scratch& sc, float* scores) const {
    const int64_t H = o.heads, G = o.group, D = o.head_size, KV = o.kv_heads;
    const int64_t n = item.stop - item.start;
    const int64_t words = D / 2 * 16;  // a KV head's B tiles: D/32 tiles of 16 pair rows
    pack_query_tiles(s, sc);  // one chunk per KV head: its G query rows
    sc.use_tiles(static_cast<int>(G * 4));
    const int64_t out_stride = H * 4;  // bytes between keys in the score block
    const bool touch_keys = rows_span_pages(keys, KV, D);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t nt = std::min<int64_t>(16, n - j0);
      if (touch_keys) touch_rows(keys, s, item, j0 + kPrefetchRows, j0 + nt + kPrefetchRows);
      const TileOperand a = key_tile(s, item, item.start + j0, nt, sc);
      float* out_tile = scores + j0 * H;
      // KV heads four at a time (C tiles 0-3, multiply_c_tiles).
      for (int64_t g = 0; g < KV; g += 4) {
        const int64_t count = std::min<int64_t>(4, KV - g);
        multiply_c_tiles(
            count, D / 32, [&](int64_t h, int64_t kc) { return a.base + (g + h) * a.head + kc * 32; },
            a.stride, [&](int64_t h, int64_t kc) { return sc.query_tiles.data() + (g + h) * words + kc * 256; });
        _tile_stored(0, out_tile + g * G, out_stride);
        if (count > 1) _tile_stored(1, out_tile + (g + 1) * G, out_stride);
        if (count > 2) _tile_stored(2, out_tile + (g + 2) * G, out_stride);
        if (count > 3) _tile_stored(3, out_tile + (g + 3) * G, out_stride);
      }
    }
    if (!scale_in_softmax()) {
      const fVec scale(o.scale);
      const int64_t total = n * H;
      int64_t i = 0;
      for (; i + kLanes <= total; i += kLanes) (fVec::loadu(scores + i) * scale).store(scores + i);
      if (i < total) (fVec::loadu(scores + i, total - i) * scale).store(scores + i, total - i);
    }
    for (int64_t j0 = 0; j0 < n; j0 += 16) mask_scores(s, item, scores, j0, std::min<int64_t>(16, n - j0));
  }

  // Whether tile_scores leaves the scores unscaled for softmax_numerators to scale: where
  // nothing between the two needs them scaled (no soft cap, no ALiBi; the mask writes -inf
  // whatever the scale) and the scale is a positive finite number (so that the max commutes
  // with it). A pass over the score block fewer: ~2% of a SmolLM2 decode call.
  bool scale_in_softmax() const {
    return o.soft_cap == 0.f && o.alibi == nullptr && o.scale > 0.f && std::isfinite(o.scale);
  }

  // Pass 2 of a tile_scores item on AMX tiles: acc[r] = sum_j p[j, r] v_j, the value rows read
  // in place as B tiles (16 keys x 32 values of D, a token row apart; gathered where a group's
  // 16 keys are not one block's consecutive slots, or past the item). TDPBF16PS pairs adjacent
  // B columns (it adds A[m, 2k] B[k, 2n] + A[m, 2k + 1] B[k, 2n + 1] into C[m, n]), so with
  // the keys' value rows as B rows, A rows holding (p, 0) per key give D's even columns and
  // rows holding (0, p) its odd columns: no value packing. For G <= 8 query heads per KV head
  // both sets of rows share one A tile (one product per B tile), else two (two products). P is
  // rounded to bfloat16 (as vLLM's AMX kernel and run_item_amx round it); the sums are
  // float32. `probs` is the token-major numerator block (probs[j * H + r], n keys).
  //
  // A zero in the A tile still multiplies its B neighbour, and 0 x Inf is NaN: a value row
  // with an infinite or NaN element would spread NaN into the next column, which the
  // reference keeps finite. So the accumulators are checked for NaN afterwards, and an item
  // that has one (only ever on non-finite inputs) returns false to be redone on the vector
  // path, whose NaN is exactly the reference's.
  bool tile_values(const Item& item, const Sequence& s, Scratch& sc, const float* probs, float* acc) const {
    const int64_t H = o.heads, G = o.group, D = o.head_size, KV = o.kv_heads;
    const int64_t n = item.stop - item.start, groups = (n + 15) / 16;
    // B operands: a group's rows in place, or its slot of value_gather.
    int64_t gathered = 0;
    for (int64_t q = 0; q < groups; ++q)
      gathered += tile_in_place(item.start + q * 16, std::min<int64_t>(16, n - q * 16)) ? 0 : 1;
    sc.value_gather.resize(gathered * KV * 16 * D);
    sc.value_operands.resize(groups);
    TileOperand* bases = sc.value_operands.data();
    for (int64_t q = 0, slot = 0; q < groups; ++q) {
      const int64_t pos = item.start + q * 16, nt = std::min<int64_t>(16, n - q * 16);
      c10::BFloat16* gather = sc.value_gather.data() + slot * KV * 16 * D;
      bases[q] = row_tile(values, s, item, pos, nt, gather);
      if (bases[q].base == gather) ++slot;
    }
    // A operands: per KV head g and group q, G rows of (p, 0) words (query head g * G + m,
    // 16 keys), then G rows of (0, p); from the token-major block by 16 x 16 transposes of
    // 16 keys x 16 heads (zeros past the item's keys: the rows there are not probabilities).
    sc.prob_words.resize(groups * 2 * H * 16);
    uint32_t* words = sc.prob_words.data();
    auto word_row = [&](int64_t g, int64_t q, int64_t parity, int64_t m) {
      return words + (((g * groups + q) * 2 + parity) * G + m) * 16;
    };
    for (int64_t q = 0; q < groups; ++q) {
      const int64_t nt = std::min<int64_t>(16, n - q * 16);
      for (int64_t h0 = 0; h0 < H; h0 += 16) {
        const int64_t heads = std::min<int64_t>(16, H - h0);
        const __mmask16 in = static_cast<__mmask16>((1u << heads) - 1);
        __m512i r[16];
        for (int64_t t = 0; t < 16; ++t)
          r[t] = t < nt ? _mm512_castps_si512(_mm512_maskz_loadu_ps(in, probs + (q * 16 + t) * H + h0))
                        : _mm512_setzero_si512();
        transpose_16x16(r);
        for (int64_t h = 0; h < heads; ++h) {
          const __m512i even =
              _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[h])));
          const int64_t g = (h0 + h) / G, m = (h0 + h) % G;
          _mm512_storeu_si512(word_row(g, q, 0, m), even);
          _mm512_storeu_si512(word_row(g, q, 1, m), _mm512_slli_epi32(even, 16));
        }
      }
    }
    alignas(64) static const int32_t kLow[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    alignas(64) static const int32_t kHigh[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
    sc.out_tiles.resize(4 * 16 * 16);
    float* out = sc.out_tiles.data();
    // With 2G <= 16 rows both parities share one A tile (rows 0..G-1 (p, 0), G..2G-1 (0, p)):
    // one product per B tile then gives a C tile of the 32 columns' even half over its odd
    // half, where two A tiles take two products (one costs about the same for 2G rows as for G:
    // B8 x 2048 with 4 query heads per KV head went from 1.31 to 1.09x of vLLM's op, caches
    // cold). C tiles 0-3 hold 128 values of D per pass that way, else 64 (even, odd; even, odd).
    // With one A tile and D <= 64, tiles 2 and 3 are free: odd 16-key groups load their
    // operands into A 5 and B 2, 3 while the even group's products run (SmolLM2's shape, one
    // thread, in L2: 14.1-14.8 -> 13.7-14.1 us a 512-key call).
    const bool shared = 2 * G <= 16, pairs = shared && D <= 64;
    const int64_t chunks_per_pass = shared ? 4 : 2;  // 32 values of D each
    sc.use_value_tiles(static_cast<int>(shared ? 2 * G : G), pairs);
    for (int64_t g = 0; g < KV; ++g) {
      for (int64_t d = 0; d < D; d += chunks_per_pass * 32) {
        const int64_t chunks = std::min<int64_t>(chunks_per_pass, (D - d) / 32);
        const int64_t c_tiles = shared ? chunks : 2 * chunks;
        _tile_zero(0);
        if (c_tiles > 1) _tile_zero(1);
        if (c_tiles > 2) _tile_zero(2);
        if (c_tiles > 3) _tile_zero(3);
        for (int64_t q = 0; q < groups; ++q) {
          const TileOperand& b = bases[q];
          const c10::BFloat16* v = b.base + g * b.head + d;
          if (pairs && q % 2 == 1) {
            _tile_loadd(5, word_row(g, q, 0, 0), 64);
            _tile_loadd(2, v, b.stride);
            _tile_dpbf16ps(0, 5, 2);
            if (chunks > 1) {
              _tile_loadd(3, v + 32, b.stride);
              _tile_dpbf16ps(1, 5, 3);
            }
            continue;
          }
          _tile_loadd(4, word_row(g, q, 0, 0), 64);  // shared: both parities' 2G rows
          if (!shared) _tile_loadd(5, word_row(g, q, 1, 0), 64);
          _tile_loadd(6, v, b.stride);
          _tile_dpbf16ps(0, 4, 6);
          if (!shared) _tile_dpbf16ps(1, 5, 6);
          if (chunks > 1) {
            _tile_loadd(7, v + 32, b.stride);
            if (shared) {
              _tile_dpbf16ps(1, 4, 7);
            } else {
              _tile_dpbf16ps(2, 4, 7);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          if (chunks > 2) {
            _tile_loadd(6, v + 64, b.stride);
            _tile_dpbf16ps(2, 4, 6);
          }
          if (chunks > 3) {
            _tile_loadd(7, v + 96, b.stride);
            _tile_dpbf16ps(3, 4, 7);
          }
        }
        _tile_stored(0, out, 64);
        if (c_tiles > 1) _tile_stored(1, out + 256, 64);
        if (c_tiles > 2) _tile_stored(2, out + 512, 64);
        if (c_tiles > 3) _tile_stored(3, out + 768, 64);
        // Chunk c's even columns of query head m, and its odd ones `parity` floats further.
        const int64_t chunk_floats = shared ? 256 : 512, parity = shared ? G * 16 : 256;
        for (int64_t m = 0; m < G; ++m) {
          float* dst = acc + (g * G + m) * D + d;
          for (int64_t c = 0; c < chunks; ++c) {
            const float* even = out + c * chunk_floats + m * 16;
            const __m512 e = _mm512_loadu_ps(even), o = _mm512_loadu_ps(even + parity);
            _mm512_storeu_ps(dst + c * 32, _mm512_permutex2var_ps(e, low, o));
            _mm512_storeu_ps(dst + c * 32 + 16, _mm512_permutex2var_ps(e, high, o));
          }
        }
      }
    }
    __mmask16 nan = 0;
    for (int64_t i = 0; i < H * D; i += kLanes) {
      const __m512 x = _mm512_loadu_ps(acc + i);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    if (nan == 0) return true;
    std::fill(acc, acc + H * D, 0.f);
    return false;
  }

  // run_item on AMX tiles (bfloat16 caches, D a multiple of 32; see amx.h). The same two
  // passes and the same score layout as run_item, with the tiles in place of the dot products.
  // A job is one KV head g and one chunk of 16 of its M = q_len x G query rows (column m =
  // i * G + h: query token i, head h of the group).
  //  - pass 1, per 16 keys, four jobs at a time: S^T = K Q^T. The key rows are the A operand,
  //    loaded straight from the cache where the 16 rows are one block's consecutive slots
  //    (else gathered, zeros past the item); the jobs' query rows are B tiles packed once.
  //    Every (key, query row) pair of the item is computed, then the pairs a row may not see
  //    get -inf: every key of an item is a written slot some query row sees (its range starts
  //    at the window's first visible key), so nothing masked is garbage, and it never reaches
  //    a product after the softmax (probability 0).
  //  - pass 2, per 64 keys and job: O += P V. P (bfloat16, as pack_probability_pairs rounds
  //    it) is transposed into two A tiles; head g's 64 value rows are interleaved once into B
  //    tiles (zeros past the item); O lives in out_tiles, two C tiles of 16 columns of D at a
  //    time loaded, multiplied by both halves and stored back.
  // Accumulation is float32 as on every path (TDPBF16PS: exact bfloat16 products, float32 sums).
  void run_item_amx(const Item& item, Scratch& sc) const {
    const Sequence& s = (*seqs)[item.seq];
    const int64_t H = o.heads, G = o.group, D = o.head_size, KV = o.kv_heads;
    const int64_t rows = s.q_len * H;
    const int64_t n = item.stop - item.start;
    const int64_t M = s.q_len * G;           // query rows per KV head (tile columns)
    const int64_t chunks = (M + 15) / 16;    // of 16 columns
    const int64_t width = chunks * 16;       // columns of sc.tile_out in pass 1
    // Query row m of KV head g is row r = (m / G) * H + g * G + m % G of the item.
    auto row_of = [&](int64_t g, int64_t m) { return (m / G) * H + g * G + m % G; };
    sc.scores.resize(rows * n);
    sc.acc.resize(rows * D);  // every row written once, from out_tiles, at the end
    sc.row_max.assign(rows, kNegInf);
    sc.row_sum.assign(rows, 0.f);
    float* scores = sc.scores.data();
    float* acc = sc.acc.data();

    pack_query_tiles(s, sc);

    sc.use_tiles(64);
    sc.tile_out.resize(KV * 16 * width);
    float* tile_out = sc.tile_out.data();
    const int64_t jobs = KV * chunks;  // (KV head, column chunk) pairs, four C tiles at a time
    const int64_t words_per_chunk = D / 2 * 16;  // a chunk's B tiles (pack_query_tiles)
    const bool touch_keys = rows_span_pages(keys, KV, D);
    const bool touch_values = rows_span_pages(values, KV, D);
    // Pass 1: scores (scores[j * rows + r], scaled).
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t nt = std::min<int64_t>(16, n - j0);
      if (touch_keys) touch_rows(keys, s, item, j0 + kPrefetchRows, j0 + nt + kPrefetchRows);
      // The A operand of head g: its 16 key rows (key_tile).
      const TileOperand a = key_tile(s, item, item.start + j0, nt, sc);
      // Job J = g * chunks + c: C tile J % 4 (multiply_c_tiles).
      for (int64_t j = 0; j < jobs; j += 4) {
        const int64_t count = std::min<int64_t>(4, jobs - j);
        multiply_c_tiles(
            count, D / 32,
            [&](int64_t h, int64_t kc) { return a.base + ((j + h) / chunks) * a.head + kc * 32; },
            a.stride,
            [&](int64_t h, int64_t kc) { return sc.query_tiles.data() + (j + h) * words_per_chunk + kc * 256; });
        // tile_out[(g * 16 + t) * width + m]: head g's scores of key t, its M columns adjacent.
        auto out = [&](int64_t job) { return tile_out + (job / chunks) * 16 * width + (job % chunks) * 16; };
        const int64_t out_stride = width * 4;
        _tile_stored(0, out(j), out_stride);
        if (count > 1) _tile_stored(1, out(j + 1), out_stride);
        if (count > 2) _tile_stored(2, out(j + 2), out_stride);
        if (count > 3) _tile_stored(3, out(j + 3), out_stride);
      }
      // Columns i * G .. i * G + G - 1 of head g are the rows i * H + g * G .. of the scores.
      const fVec scale(o.scale);
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < KV; ++g)
          for (int64_t i = 0; i < s.q_len; ++i) {
            const float* src = tile_out + (g * 16 + t) * width + i * G;
            float* dst = scores + (j0 + t) * rows + i * H + g * G;
            for (int64_t h = 0; h < G; h += kLanes) {
              const int64_t left = std::min<int64_t>(kLanes, G - h);
              (fVec::loadu(src + h, left) * scale).store(dst + h, left);
            }
          }
      mask_scores(s, item, scores, j0, nt);
    }
    softmax_numerators(scores, n, rows, sc.row_max.data(), sc.row_sum.data(), sc.pattern);
    mark_only_neg_inf(s, item, sc);
    pack_probability_pairs(scores, n, rows, sc.prob_pairs);
    const int64_t npairs = (n + 1) / 2;
    const int64_t tiles_d = D / 16;  // C / B tiles across D
    const uint32_t* pairs = sc.prob_pairs.data();
    // O per job (KV head, column chunk), its columns of D in tile order (see below):
    // out_tiles[(job * 16 + col) * D + p], float32.
    sc.out_tiles.assign(jobs * 16 * D, 0.f);
    // One KV head's 64 value rows as B tiles: value_tiles[((half * tiles_d + q) * 16 + u) * 32
    // + 2e + b] is value row 32 half + 2u + b at the D column of tile position 16q + e (zeros
    // past the item).
    sc.value_tiles.resize(2 * tiles_d * 512);
    sc.prob_tiles.resize(2 * 256);
    uint32_t* prob_tiles = sc.prob_tiles.data();
    c10::BFloat16* value_tiles = sc.value_tiles.data();
    float* out_tiles = sc.out_tiles.data();
    // The jobs' query rows (row_of), for gathering their probability pairs.
    sc.col_rows.assign(jobs * 16, 0);
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t m = 0; m < M; ++m) sc.col_rows[(g * chunks + m / 16) * 16 + m % 16] = static_cast<int32_t>(row_of(g, m));
    // Pass 2: O += P V, 64 keys at a time; per KV head its 64 value rows interleaved once into
    // B tiles that stay in L1 (VPUNPCKLWD / VPUNPCKHWD: pairs (x[d], y[d]) of two rows within
    // 128-bit lanes, so a tile's 16 columns are D columns 8L + e and 8L + 4 + e; out_tiles
    // keeps that order until the item's end); per job, its two 32-key A tiles, and O two tiles
    // of 16 columns at a time, loaded, multiplied by both halves and stored back.
    for (int64_t k0 = 0; k0 < n; k0 += 64) {
      if (touch_values) touch_rows(values, s, item, k0 + 64, k0 + 128);
      const bool second_half = k0 + 32 < n;
      for (int64_t job = 0; job < jobs; ++job) {
        const int64_t g = job / chunks, c = job % chunks;
        if (c == 0)  // head g's 64 value rows, interleaved into L1-resident B tiles
          for (int64_t u = 0; u < 32; ++u) {  // pairs of keys: half u / 16, row u % 16
            const int64_t j = k0 + 2 * u;
            const T* x = j < n ? key_row(values, s, item.seq, item.start + j) + g * values.head_stride : nullptr;
            const T* y = j + 1 < n ? key_row(values, s, item.seq, item.start + j + 1) + g * values.head_stride : nullptr;
            c10::BFloat16* dst = value_tiles + ((u / 16) * tiles_d * 16 + u % 16) * 32;
            for (int64_t q = 0; q < tiles_d; q += 2) {
              const __m512i xv = x ? _mm512_loadu_si512(x + 16 * q) : _mm512_setzero_si512();
              const __m512i yv = y ? _mm512_loadu_si512(y + 16 * q) : _mm512_setzero_si512();
              _mm512_storeu_si512(dst + q * 512, _mm512_unpacklo_epi16(xv, yv));
              _mm512_storeu_si512(dst + (q + 1) * 512, _mm512_unpackhi_epi16(xv, yv));
            }
          }
        // The A tiles: column col's pairs of keys k0 .. k0 + 63 (a 16 x 16 transpose of the
        // pairs the chunk's query rows hold, per 32 keys).
        const int64_t cols = std::min<int64_t>(16, M - c * 16);
        const __mmask16 col_mask = static_cast<__mmask16>((1u << cols) - 1);
        const __m512i index = _mm512_loadu_si512(sc.col_rows.data() + job * 16);
        const int32_t first_row = sc.col_rows[job * 16];
        for (int64_t half = 0; half < 1 + second_half; ++half) {
          __m512i r[16];
          for (int64_t u = 0; u < 16; ++u) {
            const int64_t pair = k0 / 2 + half * 16 + u;
            const uint32_t* line = pairs + pair * rows;
            r[u] = pair >= npairs ? _mm512_setzero_si512()
                   : s.q_len == 1 ? _mm512_maskz_loadu_epi32(col_mask, line + first_row)  // adjacent rows
                                  : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), col_mask, index, line, 4);
          }
          transpose_16x16(r);
          for (int64_t col = 0; col < 16; ++col) _mm512_storeu_si512(prob_tiles + half * 256 + col * 16, r[col]);
        }
        _tile_loadd(2, prob_tiles, 64);
        if (second_half) _tile_loadd(3, prob_tiles + 256, 64);
        float* o_tiles = out_tiles + job * 16 * D;
        const c10::BFloat16* b0 = value_tiles;
        const c10::BFloat16* b1 = b0 + tiles_d * 512;
        const int64_t o_stride = D * 4;  // bytes
        for (int64_t q = 0; q < tiles_d; q += 2) {
          _tile_loadd(0, o_tiles + 16 * q, o_stride);
          _tile_loadd(1, o_tiles + 16 * (q + 1), o_stride);
          _tile_loadd(4, b0 + q * 512, 64);
          _tile_loadd(5, b0 + (q + 1) * 512, 64);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 2, 5);
          if (second_half) {
            _tile_loadd(6, b1 + q * 512, 64);
            _tile_loadd(7, b1 + (q + 1) * 512, 64);
            _tile_dpbf16ps(0, 3, 6);
            _tile_dpbf16ps(1, 3, 7);
          }
          _tile_stored(0, o_tiles + 16 * q, o_stride);
          _tile_stored(1, o_tiles + 16 * (q + 1), o_stride);
        }
      }
    }
    // The tiles' columns are in the unpack pairing's order: back in D's (unpermute_row).
    for (int64_t g = 0; g < KV; ++g)
      for (int64_t m = 0; m < M; ++m)
        unpermute_row(out_tiles + ((g * chunks + m / 16) * 16 + m % 16) * D, acc + row_of(g, m) * D, D);
    finish_item(item, s, rows, sc);
  }
#endif

  // Whether an item's key (or value) rows fit in the share of L2 a prefetch may fill
  // (l2_prefetch_budget).
  bool rows_fit_l2(const Item& item) const {
    return (item.stop - item.start) * o.kv_heads * o.head_size * static_cast<int64_t>(sizeof(T)) <=
           l2_prefetch_budget();
  }

  // How run_item computes an item: kVector, both passes on vector registers (pass 2 is the
  // one that fetches the next item's keys into L2); kTiles, the scores and P V on AMX tiles
  // (tile_scores, tile_values) with the softmax on vector registers; kAmx, run_item_amx.
  enum class Path { kVector, kTiles, kAmx };
  Path path_of(const Item& item) const {
#if defined(ATTN_DI_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const Sequence& s = (*seqs)[item.seq];
      if (amx && item.stop - item.start >= kAmxMinKeys) {
        if (s.q_len == 1 && o.group <= kTileScoresMaxGroup) return Path::kTiles;
        if (s.q_len * o.group * o.head_size >= kAmxMinRowWork) return Path::kAmx;
      }
    }
#endif
    return Path::kVector;
  }

  // `ahead`: the item this thread runs next, whose keys pass 2 fetches into L2, or nullptr
  // (given only for items of path_of kVector: the tile paths do not fetch them).
  void run_item(const Item& item, Scratch& sc, const Item* ahead = nullptr) const {
    const Sequence& s = (*seqs)[item.seq];
    const Path path = path_of(item);
#if defined(ATTN_DI_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (path == Path::kAmx) {
        run_item_amx(item, sc);
        g_item_counts[0].fetch_add(1, std::memory_order_relaxed);
        return;
      }
#endif
    const bool tiles = path == Path::kTiles;  // the softmax below, between tile_scores and tile_values
    g_item_counts[tiles ? 1 : 2].fetch_add(1, std::memory_order_relaxed);
    const int64_t H = o.heads, G = o.group, D = o.head_size, row_width = o.kv_heads * D;
    const int64_t rows = s.q_len * H;  // row r = i * H + h
    const int64_t n = item.stop - item.start;
    sc.queries.resize(rows * D);
    sc.scores.resize(rows * (n + (tiles ? 15 : 0)));
    sc.acc.assign(rows * D, 0.f);
    sc.key_row.resize(row_width);
    sc.value_row.resize(row_width);
    float* q = sc.queries.data();
    float* scores = sc.scores.data();
    float* acc = sc.acc.data();
#if defined(ATTN_DI_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (tiles) tile_scores(item, s, sc, scores);
#endif
    constexpr bool kBf16Dot = kNativeBf16Dot && std::is_same_v<T, c10::BFloat16>;
    const T* tile_rows[kTile];
    const bool touch_keys = rows_span_pages(keys, o.kv_heads, D);
    const bool touch_values = rows_span_pages(values, o.kv_heads, D);
    if (!tiles) {
      // Scaled float32 queries, [q_len, H, D] (and, for the bfloat16 dot products, the
      // queries as given, unscaled: scaling in bfloat16 would round them).
      if constexpr (kBf16Dot) sc.raw_queries.resize(rows * D);
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t h = 0; h < H; ++h) {
          const T* src = query + (s.first_query + i) * q_stride0 + h * q_stride1;
          float* dst = q + (i * H + h) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * o.scale;
          if constexpr (kBf16Dot) std::copy(src, src + D, sc.raw_queries.data() + (i * H + h) * D);
        }
      // Pass 1: scores, token-major (scores[j * rows + r]); the query rows that may see key j
      // are one contiguous range [r_lo, r_hi), the others hold -inf (never computed). Keys go
      // in tiles of kTile tokens; a tile every query row sees whole (always so in decode) takes
      // the register-blocked path.
      auto modify_scores = [&](int64_t j, int64_t r_lo, int64_t r_hi) {
        this->modify_scores(s, item, scores + j * rows, j, r_lo, r_hi);
      };
      const bool values_to_l2 = rows_fit_l2(item);
      for (int64_t j0 = 0; j0 < n; j0 += kTile) {
        const int64_t nt = std::min(kTile, n - j0);
        if (touch_keys) touch_rows(keys, s, item, j0 + kPrefetchRows, j0 + nt + kPrefetchRows);
        if (values_to_l2)
          touch_rows<64, 2>(values, s, item, j0, j0 + nt);
        if (full_tile(s, o, item.start + j0, nt)) {
          for (int64_t t = 0; t < nt; ++t) tile_rows[t] = key_row(keys, s, item.seq, item.start + j0 + t);
          for (int64_t g = 0; g < o.kv_heads; ++g) {
#if defined(ATTN_DI_AVX512_BF16)
            // The bfloat16 dot products have their own loop (as pass 2's bfloat16 rows do), not
            // a branch inside the float32 one's head-group lambda: that single-loop form measured
            // 0.85-0.98x of vLLM's op in bfloat16 decode B8 x 2048 against 0.75x for this one.
            if constexpr (kBf16Dot) {
              const T* heads[kTile];
              for (int64_t t = 0; t < nt; ++t) heads[t] = tile_rows[t] + g * keys.head_stride;
              for (int64_t i = 0; i < s.q_len; ++i) {
                const int64_t r0 = i * H + g * G;
                float* out = scores + j0 * rows + r0;
                for_head_groups(G, [&](auto nr, int64_t h) {
                  score_tile_bf16<decltype(nr)::value>(heads, nt, sc.raw_queries.data() + (r0 + h) * D,
                                                       D, o.scale, out + h, rows);
                });
              }
              continue;
            }
#endif
            const float* const* staged = head_tile(tile_rows, nt, g * keys.head_stride, D, sc);
            for (int64_t i = 0; i < s.q_len; ++i) {
              const int64_t r0 = i * H + g * G;
              float* out = scores + j0 * rows + r0;
              for_head_groups(G, [&](auto nr, int64_t h) {
                score_tile<float, decltype(nr)::value>(staged, nt, q + (r0 + h) * D, D, out + h, rows);
              });
            }
          }
          if (o.soft_cap > 0.f || o.alibi != nullptr)
            for (int64_t t = 0; t < nt; ++t) modify_scores(j0 + t, 0, rows);
          continue;
        }
        for (int64_t j = j0; j < j0 + nt; ++j) {
          const int64_t pos = item.start + j;
          int64_t i_lo, i_hi;
          visible_rows(s, o, pos, i_lo, i_hi);
          float* sj = scores + j * rows;
          const int64_t r_lo = i_lo * H, r_hi = std::max(i_lo, i_hi) * H;
          std::fill(sj, sj + r_lo, kNegInf);
          std::fill(sj + r_hi, sj + rows, kNegInf);
          if (r_lo >= r_hi) continue;
          const float* k = as_float<T>(key_row(keys, s, item.seq, pos), o.kv_heads, D,
                                       keys.head_stride, sc.key_row.data());
          for (int64_t i = i_lo; i < i_hi; ++i)
            for (int64_t g = 0; g < o.kv_heads; ++g) {
              const float* kg = k + g * D;
              const int64_t r0 = i * H + g * G;
              for_head_groups(G, [&](auto nr, int64_t h) {
                dot_rows<decltype(nr)::value>(kg, q + (r0 + h) * D, D, D, sj + r0 + h);
              });
            }
          modify_scores(j, r_lo, r_hi);
        }
      }
    }
    // Softmax numerators in place (a row without a visible key keeps max -inf and sum 0).
    sc.row_max.assign(rows, kNegInf);
    sc.row_sum.assign(rows, 0.f);
    LineVector<float>& row_max = sc.row_max;
    LineVector<float>& row_sum = sc.row_sum;
    float unapplied = 1.f;  // the scale tile_scores left to the softmax
#if defined(ATTN_DI_AMX)
    if (tiles && scale_in_softmax()) unapplied = o.scale;
#endif
    softmax_numerators(scores, n, rows, row_max.data(), row_sum.data(), sc.pattern, unapplied);
    mark_only_neg_inf(s, item, sc);
    // Pass 2: acc[r] += p[j, r] * v_j over the visible (row, key) pairs only. A one-token
    // bfloat16 item (every tile full) of D a multiple of 32 keeps its accumulators in
    // value_tile_bf16_paired's order until the end.
    bool values_done = false;  // by tile_values
#if defined(ATTN_DI_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (tiles) {
        values_done = tile_values(item, s, sc, scores, acc);
        if (!values_done) g_item_counts[3].fetch_add(1, std::memory_order_relaxed);
      }
#endif
    const bool paired = kBf16Dot && s.q_len == 1 && D % 32 == 0 && !values_done;
#if defined(ATTN_DI_AVX512_BF16) && !defined(ATTN_DI_AMX)
    // The item's probabilities as bfloat16 pairs, once (value_tile_bf16_dot reads them).
    if (paired) pack_probability_pairs(scores, n, rows, sc.prob_pairs);
#endif
    const int64_t ahead_n = ahead != nullptr ? ahead->stop - ahead->start : 0;
    for (int64_t j0 = 0; !values_done && j0 < n; j0 += kTile) {
      const int64_t nt = std::min(kTile, n - j0);
      if (touch_values) touch_rows(values, s, item, j0 + kPrefetchRows, j0 + nt + kPrefetchRows);
      if (ahead_n > 0)
        touch_rows<64, 2>(keys, (*seqs)[ahead->seq], *ahead, j0 * ahead_n / n,
                          j0 + nt == n ? ahead_n : (j0 + nt) * ahead_n / n);
      if (full_tile(s, o, item.start + j0, nt)) {
        for (int64_t t = 0; t < nt; ++t) tile_rows[t] = key_row(values, s, item.seq, item.start + j0 + t);
        for (int64_t g = 0; g < o.kv_heads; ++g) {
#if defined(ATTN_DI_AVX512_BF16)
          // bfloat16 value rows read in place. In the avx512_bf16 build (AMD Zen 4 and the
          // like, where VDPBF16PS issues at the FMA's rate) one-token items take VDPBF16PS on
          // token pairs (value_tile_bf16_dot): B8 x 2048, 32/8 heads of 128, 0.96-1.05x ->
          // 0.68-0.74x of vLLM's op; SmolLM2's decode 0.93-0.96x -> 0.79-0.82x (bench_vs_vllm,
          // AMD EPYC, two threads, alternating processes). Elsewhere, and in the amx build
          // (on Sapphire Rapids VDPBF16PS does half the FMA's products a cycle), the rows are
          // widened to float32 as they load and multiplied by the float32 probabilities with
          // FMAs: there 1.1-1.3x faster than VDPBF16PS on rows interleaved by VPERMT2W (one
          // thread, one sequence of 1024 keys, G = 3 of D = 64 and G = 4 of 128). Rows stay
          // L1-resident across the head group's passes.
          if constexpr (kBf16Dot) {
            const T* heads[kTile];
            for (int64_t t = 0; t < nt; ++t) heads[t] = tile_rows[t] + g * values.head_stride;
#if !defined(ATTN_DI_AMX)
            if (paired) {
              const uint32_t* pairs = sc.prob_pairs.data() + j0 / 2 * rows + g * G;
              for_head_groups(G, [&](auto nr, int64_t h) {
                value_tile_bf16_dot<decltype(nr)::value>(heads, nt, pairs + h, rows, acc + (g * G + h) * D, D);
              });
              continue;
            }
#endif
            for (int64_t i = 0; i < s.q_len; ++i) {
              const int64_t r0 = i * H + g * G;
              const float* pj = scores + j0 * rows + r0;
              for_head_groups(G, [&](auto nr, int64_t h) {
                if (paired)
                  value_tile_bf16_paired<decltype(nr)::value>(heads, nt, pj + h, rows, acc + (r0 + h) * D, D);
                else
                  value_tile<T, decltype(nr)::value>(heads, nt, pj + h, rows, acc + (r0 + h) * D, D);
              });
            }
            continue;
          }
#endif
          const float* const* staged = head_tile(tile_rows, nt, g * values.head_stride, D, sc);
          for (int64_t i = 0; i < s.q_len; ++i) {
            const int64_t r0 = i * H + g * G;
            const float* pj = scores + j0 * rows + r0;
            for_head_groups(G, [&](auto nr, int64_t h) {
              value_tile<float, decltype(nr)::value>(staged, nt, pj + h, rows, acc + (r0 + h) * D, D);
            });
          }
        }
        continue;
      }
      for (int64_t j = j0; j < j0 + nt; ++j) {
        const int64_t pos = item.start + j;
        int64_t i_lo, i_hi;
        visible_rows(s, o, pos, i_lo, i_hi);
        if (i_lo >= i_hi) continue;
        const float* v = as_float<T>(key_row(values, s, item.seq, pos), o.kv_heads, D,
                                     values.head_stride, sc.value_row.data());
        const float* pj = scores + j * rows;
        for (int64_t i = i_lo; i < i_hi; ++i)
          for (int64_t g = 0; g < o.kv_heads; ++g) {
            const float* vg = v + g * D;
            const int64_t r0 = i * H + g * G;
            for_head_groups(G, [&](auto nr, int64_t h) {
              axpy_rows<decltype(nr)::value>(vg, pj + r0 + h, acc + (r0 + h) * D, D, D);
            });
          }
      }
    }
#if defined(ATTN_DI_AVX512_BF16)
    if (paired)
      for (int64_t r = 0; r < rows; ++r) unpermute_row(acc + r * D, acc + r * D, D);
#endif
    finish_item(item, s, rows, sc);
  }

  // After the softmax: a row that sees keys of the item but whose scores were all -inf (an
  // infinite key or query; masking never leaves a row only -inf scores of keys it sees) gets
  // the sum kOnlyNegInfScores, so merge_partials writes NaN where no other part or sink has a
  // finite score (the reference's softmax: -inf - (-inf) = NaN). A row that also saw a NaN
  // score keeps its NaN sum (softmax_numerators leaves NaN out of the max).
  void mark_only_neg_inf(const Sequence& s, const Item& item, Scratch& sc) const {
    const int64_t H = o.heads, first_pos = s.seq_len - s.q_len;
    for (int64_t i = 0; i < s.q_len; ++i) {
      const int64_t pos = first_pos + i;
      const int64_t lo = std::max(item.start, o.window > 0 ? pos - o.window + 1 : int64_t{0});
      if (lo >= std::min(item.stop, pos + 1)) continue;  // no key of the item visible
      for (int64_t r = i * H; r < (i + 1) * H; ++r)
        if (sc.row_max[r] == kNegInf && sc.row_sum[r] == 0.f) sc.row_sum[r] = kOnlyNegInfScores;
    }
  }

  // The soft cap and ALiBi bias on the scores sj[r_lo, r_hi) of the item's key j (rows
  // r = i * H + h).
  void modify_scores(const Sequence& s, const Item& item, float* sj, int64_t j, int64_t r_lo,
                     int64_t r_hi) const {
    const int64_t H = o.heads;
    if (o.soft_cap > 0.f) {
      const fVec cap(o.soft_cap), inv(1.f / o.soft_cap);
      int64_t r = r_lo;
      for (; r + kLanes <= r_hi; r += kLanes) (cap * (fVec::loadu(sj + r) * inv).tanh()).store(sj + r);
      for (; r < r_hi; ++r) sj[r] = o.soft_cap * std::tanh(sj[r] / o.soft_cap);
    }
    if (o.alibi != nullptr)
      for (int64_t r = r_lo; r < r_hi; ++r) {
        const int64_t query_pos = s.seq_len - s.q_len + r / H;
        sj[r] += o.alibi[r % H] * static_cast<float>(item.start + j - query_pos);
      }
  }

  // An item's rows once both passes are done (sc.acc, sc.row_max, sc.row_sum): the output
  // rows of a sequence in one item, else its partial results for merge_sequence.
  void finish_item(const Item& item, const Sequence& s, int64_t rows, Scratch& sc) const {
    const int64_t D = o.head_size;
    const float* acc = sc.acc.data();
    if (s.num_items == 1) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row_acc = acc + r * D;
        finish_row(s, r, &sc.row_max[r], &sc.row_sum[r], &row_acc, 1);
      }
      return;
    }
    const int64_t base = s.partial_offset + item.part * rows;
    std::copy(acc, acc + rows * D, partial_acc + base * D);
    std::copy(sc.row_max.begin(), sc.row_max.end(), partial_max + base);
    std::copy(sc.row_sum.begin(), sc.row_sum.end(), partial_sum + base);
  }

  // Merge a sequence's partitions (log-sum-exp) and write its output rows.
  void merge_sequence(const Sequence& s, std::vector<float>& maxes, std::vector<float>& sums,
                      std::vector<const float*>& accs) const {
    const int64_t rows = s.q_len * o.heads;
    maxes.resize(s.num_items);
    sums.resize(s.num_items);
    accs.resize(s.num_items);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t part = 0; part < s.num_items; ++part) {
        const int64_t at = s.partial_offset + part * rows + r;
        maxes[part] = partial_max[at];
        sums[part] = partial_sum[at];
        accs[part] = partial_acc + at * o.head_size;
      }
      finish_row(s, r, maxes.data(), sums.data(), accs.data(), s.num_items);
    }
  }

  // One output row from its partitions' partial results (merge_partials).
  void finish_row(const Sequence& s, int64_t r, const float* maxes, const float* sums,
                  const float* const* accs, int64_t parts) const {
    const int64_t H = o.heads;
    const int64_t i = r / H, h = r % H;
    T* dst = out + (s.first_query + i) * out_stride0 + h * out_stride1;
    merge_partials(dst, o.head_size, o.sinks != nullptr ? o.sinks[h] : kNegInf, maxes, sums,
                   accs, parts);
  }
};

// -- argument checks (before any memory is touched) ---------------------------------------

// A tensor as its caller holds it: the ops take the Negative, Conjugate and ZeroTensor
// dispatch keys as fallthroughs (at the end of this file), so a negative or conjugate view, or
// a zero tensor, reaches them unresolved. They refuse it (a RuntimeError): torch's fallback
// would hand a read argument over as a resolved copy, whose memory checks would not see the
// caller's memory, and it cannot take an op that writes a resolved copy of an argument and
// returns nothing (an internal assert, then a crash, in torch 2.13). CPU_ATTN resolves such
// tensors before it calls an op (cpu_attn._resolved), or takes its checked path.
using NamedTensor = std::pair<const at::Tensor*, const char*>;  // (tensor or null, its name)

void check_no_math_bits(const char* op, std::initializer_list<NamedTensor> tensors) {
  for (const auto& [t, name] : tensors)
    TORCH_CHECK(t == nullptr || !t->defined() || (!t->is_neg() && !t->is_conj() && !t->_is_zerotensor()),
                "attn_di ", op, ": ", name, " is a negative or conjugate view or a zero tensor; pass it ",
                "resolved (resolve_neg(), resolve_conj(), clone())");
}

// An optional argument for check_no_math_bits.
const at::Tensor* given(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// A dense CPU tensor: what the ops read through raw pointers.
void check_dense_cpu(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "attn_di ", op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "attn_di ", op, ": ", name, " must be on the CPU, got ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "attn_di ", op, ": ", name,
              " must be a dense (strided) tensor, got layout ", t.layout());
}

// An integer index tensor ([rows] or [rows, cols]) read as int64 with rows `stride` apart: its
// own memory where it is int64 with contiguous rows, else a copy made here (no ATen op: a decode
// step's calls are short) of its first `rows_needed` rows and `cols_needed` columns (all when
// negative), so that an expanded table is never copied whole. `rows` and `cols` stay the
// tensor's own, for the callers' checks.
struct Indices {
  const int64_t* data = nullptr;
  int64_t rows = 0, cols = 1, stride = 1;
  std::vector<int64_t> copy;
};

Indices index_tensor(const char* op, const at::Tensor& t, const char* name, int64_t rank,
                     int64_t rows_needed = -1, int64_t cols_needed = -1) {
  check_dense_cpu(op, t, name);
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kLong || type == at::kInt || type == at::kShort || type == at::kChar ||
                  type == at::kByte,
              "attn_di ", op, ": ", name, " must be an int64 or int32 tensor (int16, int8 and uint8 "
              "are read too), got ", type);
  TORCH_CHECK(t.dim() == rank, "attn_di ", op, ": ", name, " must be ", rank, "-D, got shape ",
              t.sizes());
  Indices ix;
  ix.rows = t.size(0);
  ix.cols = rank == 2 ? t.size(1) : 1;
  const bool rows_contiguous = rank == 2 ? (ix.cols <= 1 || t.stride(1) == 1) : (ix.rows <= 1 || t.stride(0) == 1);
  if (type == at::kLong && rows_contiguous) {
    ix.data = t.const_data_ptr<int64_t>();
    ix.stride = rank == 2 ? t.stride(0) : 1;
    return ix;
  }
  const int64_t rows = rows_needed < 0 ? ix.rows : std::min(ix.rows, rows_needed);
  const int64_t cols = cols_needed < 0 ? ix.cols : std::min(ix.cols, cols_needed);
  ix.copy.resize(rows * cols);
  ix.stride = cols;
  const int64_t row_stride = t.stride(0), col_stride = rank == 2 ? t.stride(1) : 0;
  AT_DISPATCH_INTEGRAL_TYPES(type, "attn_di_indices", [&] {
    const scalar_t* src = t.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        ix.copy[i * cols + j] = static_cast<int64_t>(src[i * row_stride + j * col_stride]);
  });
  ix.data = ix.copy.data();
  return ix;
}

// Whether no two elements of `t` can share memory: with its axes of size > 1 sorted by stride,
// each stride is at least the span of the smaller ones (true of every permuted or sliced view
// of a dense buffer, and of an empty tensor; at::has_internal_overlap only sees a stride of 0).
bool non_overlapping(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  std::vector<std::pair<int64_t, int64_t>> axes;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) axes.emplace_back(t.stride(d), t.size(d));
  std::sort(axes.begin(), axes.end());
  int64_t span = 1;  // elements covered by the axes so far
  for (const auto& [stride, size] : axes) {
    if (stride < span) return false;
    span += stride * (size - 1);
  }
  return true;
}

// [first, last) bytes of memory `t`'s elements lie in (empty for none; strides are >= 0).
std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  const auto first = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  if (t.numel() == 0) return {first, first};
  int64_t span = 0;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  return {first, first + static_cast<uintptr_t>((span + 1) * t.element_size())};
}

// (byte stride, size) of `t`'s axes of size > 1, largest stride first, the element's own
// bytes as an axis of stride 1, adjacent axes merged where one continues the other.
std::vector<std::pair<int64_t, int64_t>> byte_axes(const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.element_size());
  std::vector<std::pair<int64_t, int64_t>> axes;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) axes.emplace_back(t.stride(d) * item, t.size(d));
  std::sort(axes.rbegin(), axes.rend());
  axes.emplace_back(1, item);
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& [stride, size] : axes) {
    if (!merged.empty() && merged.back().first == stride * size)
      merged.back() = {stride, size * merged.back().second};
    else
      merged.emplace_back(stride, size);
  }
  std::vector<std::pair<int64_t, int64_t>> kept;
  for (const auto& axis : merged)
    if (axis.second > 1) kept.push_back(axis);
  return kept;
}

// floor(a / b) for b > 0.
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

struct Term {
  int64_t stride, low, high;  // a coefficient c in [low, high] of stride
};

// Whether offset = sum(c_k * stride_k) over terms[from...] (largest stride first); `budget`
// counts down the nodes visited (false once it runs out).
bool solvable(int64_t offset, const std::vector<Term>& terms, size_t from, int64_t& budget) {
  if (--budget < 0) return false;
  if (from == terms.size()) return offset == 0;
  int64_t rest_low = 0, rest_high = 0;
  for (size_t k = from + 1; k < terms.size(); ++k) {
    rest_low += terms[k].stride * terms[k].low;
    rest_high += terms[k].stride * terms[k].high;
  }
  const Term& t = terms[from];
  const int64_t first = std::max(t.low, -floor_div(rest_high - offset, t.stride));
  const int64_t last = std::min(t.high, floor_div(offset - rest_low, t.stride));
  for (int64_t c = first; c <= last; ++c)
    if (solvable(offset - c * t.stride, terms, from + 1, budget)) return true;
  return false;
}

// Whether a byte of one tensor's elements may be a byte of the other's: exact for tensors
// that do not overlap themselves (the offset between them is a sum of index-times-stride terms
// of both, found by a short search), true when the byte ranges meet otherwise or when the
// search runs long (attn_di.backends._memory.shares_memory in Python).
bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  if (!(a0 < b1 && b0 < a1)) return false;
  if (!non_overlapping(a) || !non_overlapping(b)) return true;
  std::vector<Term> terms;
  auto add = [&terms](int64_t stride, int64_t low, int64_t high) {
    for (Term& t : terms)
      if (t.stride == stride) {
        t.low += low;
        t.high += high;
        return;
      }
    terms.push_back({stride, low, high});
  };
  for (const auto& [stride, size] : byte_axes(a)) add(stride, 0, size - 1);
  for (const auto& [stride, size] : byte_axes(b)) add(stride, -(size - 1), 0);
  std::sort(terms.begin(), terms.end(), [](const Term& x, const Term& y) { return x.stride > y.stride; });
  int64_t budget = 4096;
  const int64_t offset = static_cast<int64_t>(b0) - static_cast<int64_t>(a0);
  return solvable(offset, terms, 0, budget) || budget < 0;
}

// Refuse `written` (a tensor the op writes) sharing memory with `other`, which the op writes
// too (`other_written`) or reads.
void check_apart(const char* op, const at::Tensor& written, const char* written_name,
                 const at::Tensor& other, const char* other_name, bool other_written = false) {
  TORCH_CHECK(!shares_memory(written, other), "attn_di ", op, ": ", written_name,
              " shares memory with ", other_name, ", which the op ",
              other_written ? "writes too" : "reads while it writes ", other_written ? "" : written_name);
}

// key_cache and value_cache: [num_blocks, block_size, H_kv, D] views of one dtype, last dim
// contiguous, block_size > 0.
void check_caches(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_dense_cpu(op, key_cache, "key_cache");
  check_dense_cpu(op, value_cache, "value_cache");
  TORCH_CHECK(key_cache.dim() == 4, "attn_di ", op,
              ": key_cache must be [num_blocks, block_size, H_kv, D], got shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "attn_di ", op, ": value_cache shape ",
              value_cache.sizes(), " differs from key_cache shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "attn_di ", op,
              ": value_cache dtype ", value_cache.scalar_type(), " differs from key_cache dtype ",
              key_cache.scalar_type());
  TORCH_CHECK(key_cache.size(1) > 0, "attn_di ", op, ": key_cache's block size (axis 1) must be > 0, got ",
              key_cache.size(1));
  TORCH_CHECK(key_cache.size(2) > 0 && key_cache.size(3) > 0, "attn_di ", op,
              ": key_cache needs H_kv > 0 and D > 0, got shape ", key_cache.sizes());
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "attn_di ", op,
              ": key_cache and value_cache need a contiguous last dimension, got strides ",
              key_cache.strides(), " and ", value_cache.strides());
}

template <typename T>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const Indices& table, std::vector<Sequence>& seqs, std::vector<Item>& items,
         at::Tensor& out, const Options& o, int64_t partial_rows) {
  LineVector<float> partial_acc(partial_rows * o.head_size), partial_max(partial_rows),
      partial_sum(partial_rows);
  Kernel<T> kernel{query.const_data_ptr<T>(),
                   query.stride(0),
                   query.stride(1),
                   cache_view<T>(key_cache),
                   cache_view<T>(value_cache),
                   table.data,
                   table.stride,
                   out.mutable_data_ptr<T>(),
                   out.stride(0),
                   out.stride(1),
                   o,
                   &seqs,
                   partial_acc.data(),
                   partial_max.data(),
                   partial_sum.data()};
#if defined(ATTN_DI_AMX)
  // bfloat16 on AMX tiles where Linux grants them and D is whole tiles (a multiple of 32);
  // else AVX512_BF16 scores and float32 FMA P V (bf16_paths() says which runs).
  kernel.amx = std::is_same_v<T, c10::BFloat16> && amx_state().usable && o.head_size % 32 == 0;
#endif
  // Longest items first, each thread taking the next one left (and at most one more early,
  // below): ragged batches stay balanced.
  auto work = [&](int64_t i) { return (items[i].stop - items[i].start) * seqs[items[i].seq].q_len; };
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch& scratch = Scratch::of_this_thread();
    int64_t at = next.fetch_add(1);
    while (at < num_items) {
      // A thread takes its next item before it runs this one, so that pass 2, which reads its
      // values from L2 and leaves memory idle, fetches that item's keys into L2 (run_item's
      // `ahead`; only where pass 2 runs on vector registers: items on AMX tiles take theirs
      // one at a time, as they did when last measured on a Xeon): where this item's keys fit
      // (the next item's, of no more work, are no more where every query is one token), where
      // every other worker still finds an item left, and only an item of nearly this one's
      // work (>= 7/8), so that the item held costs a ragged batch's other threads at most an
      // eighth of one at the end. SmolLM2's decode from 30 layers' caches, AMD EPYC, four
      // alternating pairs, medians: bfloat16 0.93x -> 0.55x of vLLM's op on one thread,
      // 1.22x -> 0.83x on two; float32 0.82x -> 0.71x, 0.95x -> 0.83x (docs/benchmarks.md).
      // The item checked is the item taken: the claim fails if another thread took it first.
      int64_t ahead = num_items;
      int64_t peek = next.load(std::memory_order_relaxed);
      if (num_items - peek >= workers && kernel.path_of(items[order[at]]) == Kernel<T>::Path::kVector &&
          kernel.rows_fit_l2(items[order[at]]) &&
          8 * work(order[peek]) >= 7 * work(order[at]) && next.compare_exchange_strong(peek, peek + 1))
        ahead = peek;
      kernel.run_item(items[order[at]], scratch, ahead < num_items ? &items[order[ahead]] : nullptr);
      at = ahead < num_items ? ahead : next.fetch_add(1);
    }
#if defined(ATTN_DI_AMX)
    if (scratch.tile_bytes != 0) {  // the tile state back to its initial, unused state
      _tile_release();
      scratch.tile_bytes = 0;
    }
#endif
  });
  std::vector<int64_t> merged;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b)
    if (seqs[b].num_items > 1) merged.push_back(b);
  if (merged.empty()) return;
  // Merging is light (rows x partitions x D): a few sequences merge on this thread, without
  // waking the pool again.
  at::parallel_for(0, static_cast<int64_t>(merged.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> maxes, sums;
    std::vector<const float*> accs;
    for (int64_t m = begin; m < end; ++m) kernel.merge_sequence(seqs[merged[m]], maxes, sums, accs);
  });
}

// A per-head option ([H] floats: ALiBi slopes, sinks) as a contiguous float32 CPU tensor.
at::Tensor head_option(const std::optional<at::Tensor>& given, const char* name, int64_t heads) {
  check_dense_cpu("paged_attention", *given, name);
  TORCH_CHECK(!at::isComplexType(given->scalar_type()) && given->scalar_type() != at::kBool,
              "attn_di paged_attention: ", name, " must be real numbers, got ", given->scalar_type());
  TORCH_CHECK(given->numel() == heads, "attn_di paged_attention: ", name, " must be [H] = [",
              heads, "], got shape ", given->sizes());
  return given->to(at::kFloat).contiguous();
}

// Most keys an item of `rows` query rows takes: its share of the score budget.
inline int64_t score_cap(int64_t rows) { return std::max<int64_t>(16, kScoreBudget / rows); }

// How a sequence's `keys` visible keys split into items at `partition` (keys x query tokens
// per item) for its q_len query tokens and `rows` query rows: even parts of `step` keys, at
// most partition / q_len and score_cap(rows), aligned up to the block size when that stays
// within the cap; `parts` items in all.
struct Split {
  int64_t parts, step;
};
inline Split split_keys(int64_t keys, int64_t partition, int64_t q_len, int64_t rows,
                        int64_t block_size) {
  const int64_t cap = score_cap(rows);
  const int64_t width = std::min(std::max<int64_t>(1, partition / std::max<int64_t>(1, q_len)), cap);
  const int64_t wanted = std::max<int64_t>(1, (keys + width - 1) / width);
  int64_t step = std::max<int64_t>(1, (keys + wanted - 1) / wanted);
  const int64_t aligned = (step + block_size - 1) / block_size * block_size;
  if (aligned <= cap) step = aligned;
  return {std::max<int64_t>(1, (keys + step - 1) / step), step};
}

// The partition (keys x query tokens per item) for the decode kernel's sequences on `threads`
// threads: of the widths L / p (L: the longest sequence's work, p = 1, 2, 3, 4, 6, 8, ..., no
// narrower than kMinPartition), the one whose schedule is estimated to finish first. The
// estimate replays run()'s scheduler: items longest first, each to the first free thread
// (list scheduling), an item costing its keys x query tokens plus kItemCost, and each partial
// row of a split sequence its merge. A wider partition wins unless a narrower one finishes
// 1/32 sooner: equal sequences at least as many as the threads are never split (SmolLM2's
// B8 on 2 threads), one sequence on two threads splits in two, not three.
int64_t plan_partition(const std::vector<Sequence>& seqs, int64_t heads, int64_t block_size,
                       int64_t threads) {
  int64_t longest = 0, total = 0;
  for (const Sequence& s : seqs)
    if (!s.prefill && s.q_len > 0) {
      const int64_t work = (s.seq_len - s.lo) * s.q_len;
      longest = std::max(longest, work);
      total += work;
    }
  if (longest == 0) return kMinPartition;
  std::vector<int64_t> costs;
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> loads;
  int64_t best = longest, best_makespan = std::numeric_limits<int64_t>::max();
  for (int64_t p = 1;; p = p < 4 ? p + 1 : p + p / 2) {
    const int64_t partition = std::max(kMinPartition, (longest + p - 1) / p);
    costs.clear();
    for (const Sequence& s : seqs) {
      if (s.prefill || s.q_len == 0) continue;
      const int64_t rows = s.q_len * heads, keys = s.seq_len - s.lo, q = s.q_len;
      const Split split = split_keys(keys, partition, q, rows, block_size);
      const int64_t merge = split.parts > 1 ? kItemCost : 0;
      for (int64_t part = 0; part < split.parts; ++part) {
        const int64_t n = std::min(split.step, keys - part * split.step);
        costs.push_back(std::max<int64_t>(0, n) * q + kItemCost + merge);
      }
    }
    std::sort(costs.begin(), costs.end(), std::greater<int64_t>());
    loads = decltype(loads)();
    for (int64_t t = 0; t < threads; ++t) loads.push(0);
    int64_t makespan = 0;
    for (const int64_t c : costs) {
      const int64_t start = loads.top();
      loads.pop();
      loads.push(start + c);
      makespan = std::max(makespan, start + c);
    }
    if (makespan < best_makespan - best_makespan / 32) {
      best = partition;
      best_makespan = makespan;
    }
    // Nothing beats an even share of the work (total / threads and an item's fixed cost),
    // and no partition is narrower than kMinPartition.
    const int64_t bound = (total + threads - 1) / threads + kItemCost;
    if (partition == kMinPartition || best_makespan <= bound + bound / 32) break;
  }
  return best;
}

// The dtypes the kernels run.
void check_kernel_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "attn_di paged_attention: unsupported dtype ", dtype,
              " (float32, bfloat16 and float16 are)");
}

// paged_attention (below), `before_run` (if any) called after every check and before the
// kernels run: what a caller must do once the arguments are known good (write_and_attend's
// cache write).
void attend(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_table_in, const at::Tensor& seq_lens_in,
            const at::Tensor& query_start_loc_in, at::Tensor& out, double scale,
            int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& alibi_slopes_in,
            const std::optional<at::Tensor>& sinks_in, bool causal,
            const std::function<void()>& before_run = nullptr) {
  constexpr const char* op = "paged_attention";
  check_dense_cpu(op, query_in, "query");
  check_dense_cpu(op, out, "out");
  check_caches(op, key_cache, value_cache);
  TORCH_CHECK(query_in.dim() == 3, "attn_di paged_attention: query must be [N, H, D], got shape ",
              query_in.sizes());
  TORCH_CHECK(out.dim() == 3, "attn_di paged_attention: out must be [N, H, D], got shape ",
              out.sizes());
  TORCH_CHECK(query_in.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == key_cache.scalar_type(),
              "attn_di paged_attention: query (", query_in.scalar_type(), "), key_cache (",
              key_cache.scalar_type(), ") and out (", out.scalar_type(), ") must share one dtype");
  TORCH_CHECK(out.stride(2) == 1, "attn_di paged_attention: out's last dimension must be contiguous");
  TORCH_CHECK(non_overlapping(out),
              "attn_di paged_attention: out has elements that may share memory (strides ",
              out.strides(), " of shape ", out.sizes(), ")");
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  Options o;
  o.heads = query.size(1);
  o.head_size = query.size(2);
  o.num_blocks = key_cache.size(0);
  o.block_size = key_cache.size(1);
  o.kv_heads = key_cache.size(2);
  TORCH_CHECK(o.heads > 0 && o.head_size > 0, "attn_di paged_attention: query must have H > 0 and D > 0, got shape ",
              query.sizes());
  TORCH_CHECK(key_cache.size(3) == o.head_size, "attn_di paged_attention: key_cache head size ",
              key_cache.size(3), " differs from query's ", o.head_size);
  TORCH_CHECK(out.size(1) == o.heads && out.size(2) == o.head_size,
              "attn_di paged_attention: out shape ", out.sizes(), " should be [N, ", o.heads, ", ",
              o.head_size, "] like query");
  TORCH_CHECK(o.heads % o.kv_heads == 0, "attn_di paged_attention: query heads (", o.heads,
              ") must be a multiple of key_cache's KV heads (", o.kv_heads, ")");
  o.group = o.heads / o.kv_heads;
  o.scale = static_cast<float>(scale);
  TORCH_CHECK(std::isfinite(o.scale), "attn_di paged_attention: scale must be a finite float32, got ",
              scale);
  o.window = sliding_window > 0 ? sliding_window : 0;  // a window of every sequence: below
  // c * tanh(s / c) -> s as c grows: a cap beyond float32's range is none
  o.soft_cap = soft_cap > 0 && std::isfinite(static_cast<float>(soft_cap)) ? static_cast<float>(soft_cap) : 0.f;
  TORCH_CHECK(!std::isnan(soft_cap) && (!(soft_cap > 0) || std::isinf(static_cast<float>(soft_cap)) ||
                                        std::isnormal(o.soft_cap)),
              "attn_di paged_attention: soft_cap must be 0 (none) or a positive number at least "
              "float32's smallest normal (1.1754944e-38), got ", soft_cap);
  at::Tensor alibi, sinks;
  o.alibi = nullptr;
  o.sinks = nullptr;
  if (alibi_slopes_in.has_value()) {
    alibi = head_option(alibi_slopes_in, "alibi_slopes", o.heads);
    o.alibi = alibi.const_data_ptr<float>();
  }
  if (sinks_in.has_value()) {
    sinks = head_option(sinks_in, "sinks", o.heads);
    o.sinks = sinks.const_data_ptr<float>();
  }
  const Indices seq_lens = index_tensor(op, seq_lens_in, "seq_lens", 1);
  const Indices starts = index_tensor(op, query_start_loc_in, "query_start_loc", 1);
  const int64_t num_seqs = seq_lens.rows;
  // The table's columns any sequence can use (ceil(seq_len / block_size), without overflow),
  // and the longest sequence: a window at least that long hides nothing (and keeps the
  // visibility arithmetic below far from int64's limits).
  int64_t cols_needed = 0, longest = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len = std::max<int64_t>(0, seq_lens.data[b]);
    longest = std::max(longest, len);
    cols_needed = std::max(cols_needed, len / o.block_size + (len % o.block_size != 0));
  }
  if (o.window >= longest) o.window = 0;
  const Indices table = index_tensor(op, block_table_in, "block_table", 2, num_seqs, cols_needed);
  TORCH_CHECK(starts.rows == num_seqs + 1, "attn_di paged_attention: query_start_loc must be [B + 1] = [",
              num_seqs + 1, "] (B = seq_lens' length), got shape ", query_start_loc_in.sizes());
  TORCH_CHECK(table.rows == num_seqs, "attn_di paged_attention: block_table must be [B, max_blocks] with B = ",
              num_seqs, ", got shape ", block_table_in.sizes());
  const int64_t* lens = seq_lens.data;
  const int64_t* qsl = starts.data;
  const int64_t* blocks = table.data;
  const int64_t rows_in = std::min<int64_t>(query.size(0), out.size(0));
  TORCH_CHECK(num_seqs == 0 || (qsl[0] >= 0 && qsl[num_seqs] <= rows_in),
              "attn_di paged_attention: query_start_loc ", query_start_loc_in.sizes(), " must lie in [0, ",
              rows_in, "] (query has ", query.size(0), " rows, out ", out.size(0), "), got [",
              num_seqs ? qsl[0] : 0, ", ..., ", num_seqs ? qsl[num_seqs] : 0, "]");

  // Nothing the op reads may share memory with out: rows written early would be read later
  // (a query buffer shifted by a row), or indices changed after they were checked.
  check_apart(op, out, "out", query_in, "query");
  check_apart(op, out, "out", key_cache, "key_cache");
  check_apart(op, out, "out", value_cache, "value_cache");
  check_apart(op, out, "out", block_table_in, "block_table");
  check_apart(op, out, "out", seq_lens_in, "seq_lens");
  check_apart(op, out, "out", query_start_loc_in, "query_start_loc");
  if (alibi_slopes_in.has_value()) check_apart(op, out, "out", *alibi_slopes_in, "alibi_slopes");
  if (sinks_in.has_value()) check_apart(op, out, "out", *sinks_in, "sinks");

  // Plan: short causal queries (decode, chunked decode) go to the decode kernel below, each
  // sequence's visible key range cut into partitions; the others to the prefill kernel.
  std::vector<Sequence> seqs(num_seqs);
  std::vector<PrefillSeq> prefills;
  const int64_t max_blocks = table.cols, table_stride = table.stride;
  for (int64_t b = 0; b < num_seqs; ++b) {
    Sequence& s = seqs[b];
    s.first_query = qsl[b];
    s.q_len = qsl[b + 1] - qsl[b];
    s.seq_len = lens[b];
    TORCH_CHECK(s.q_len >= 0, "attn_di paged_attention: query_start_loc must not decrease, but entry ",
                b + 1, " (", qsl[b + 1], ") < entry ", b, " (", qsl[b], ")");
    TORCH_CHECK(s.seq_len >= s.q_len, "attn_di paged_attention: seq_lens[", b, "] = ", s.seq_len,
                " is shorter than its ", s.q_len, " query tokens");
    // ceil(seq_len / block_size) <= max_blocks, without overflow
    TORCH_CHECK(s.seq_len / o.block_size + (s.seq_len % o.block_size != 0) <= max_blocks,
                "attn_di paged_attention: block_table has ", max_blocks, " columns, too few for seq_lens[",
                b, "] = ", s.seq_len, " with block size ", o.block_size);
    const int64_t first_pos = s.seq_len - s.q_len;
    s.lo = o.window > 0 ? std::max<int64_t>(0, first_pos - o.window + 1) : 0;
    if (s.q_len == 0) s.lo = s.seq_len;
    s.prefill = s.q_len > kDecodeMaxQuery || (!causal && s.q_len > 1);
    if (s.prefill) prefills.push_back({b, s.first_query, s.q_len, s.seq_len});
    for (int64_t c = s.lo / o.block_size; c * o.block_size < s.seq_len; ++c) {
      const int64_t block = blocks[b * table_stride + c];
      TORCH_CHECK(block >= 0 && block < o.num_blocks, "attn_di paged_attention: block_table[", b, ", ", c,
                  "] = ", block, " is outside the cache's blocks [0, ", o.num_blocks, ")");
    }
  }
  const auto dtype = key_cache.scalar_type();
  check_kernel_dtype(dtype);
  if (before_run) before_run();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t partition = plan_partition(seqs, o.heads, o.block_size, threads);
  std::vector<Item> items;
  int64_t partial_rows = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    Sequence& s = seqs[b];
    s.first_item = static_cast<int64_t>(items.size());
    const int64_t rows = s.q_len * o.heads;
    if (rows == 0 || s.prefill) {
      s.num_items = 0;
      continue;
    }
    const int64_t step = split_keys(s.seq_len - s.lo, partition, s.q_len, rows, o.block_size).step;
    s.num_items = 0;
    for (int64_t start = s.lo; start < s.seq_len || s.num_items == 0; start += step) {
      items.push_back({b, start, std::min(s.seq_len, start + step), s.num_items});
      ++s.num_items;
      if (start + step >= s.seq_len) break;
    }
    s.partial_offset = partial_rows;
    if (s.num_items > 1) partial_rows += s.num_items * rows;
  }
  if (!items.empty()) {
    if (dtype == at::kFloat) {
      run<float>(query, key_cache, value_cache, table, seqs, items, out, o, partial_rows);
    } else if (dtype == at::kBFloat16) {
      run<c10::BFloat16>(query, key_cache, value_cache, table, seqs, items, out, o, partial_rows);
    } else {
      run<c10::Half>(query, key_cache, value_cache, table, seqs, items, out, o, partial_rows);
    }
  }
  run_prefill(query, key_cache, value_cache, blocks, table_stride, out, o, causal, prefills);
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, at::Tensor& out, double scale,
                     int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& alibi_slopes,
                     const std::optional<at::Tensor>& sinks, bool causal) {
  check_no_math_bits("paged_attention", {{&query, "query"}, {&key_cache, "key_cache"},
                                          {&value_cache, "value_cache"}, {&block_table, "block_table"},
                                          {&seq_lens, "seq_lens"}, {&query_start_loc, "query_start_loc"},
                                          {&out, "out"}, {given(alibi_slopes), "alibi_slopes"},
                                          {given(sinks), "sinks"}});
  attend(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale, sliding_window,
         soft_cap, alibi_slopes, sinks, causal);
}

// key_cache rows <- key rows, value_cache rows <- value rows, each token's at its slot
// (slot = block * block_size + offset, vLLM's reshape_and_cache); a negative slot (padding) is
// skipped. Every argument and slot is checked before anything is written.
// write_kv_cache's checks, every one of them (nothing written): the slots, read as int64.
Indices check_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping_in) {
  constexpr const char* op = "write_kv_cache";
  check_dense_cpu(op, key, "key");
  check_dense_cpu(op, value, "value");
  check_caches(op, key_cache, value_cache);
  TORCH_CHECK(key.dim() == 3, "attn_di write_kv_cache: key must be [N, H_kv, D], got shape ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "attn_di write_kv_cache: value shape ", value.sizes(),
              " differs from key shape ", key.sizes());
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "attn_di write_kv_cache: key is [N, ", key.size(1), ", ", key.size(2),
              "] but key_cache rows are [", key_cache.size(2), ", ", key_cache.size(3), "]");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type(),
              "attn_di write_kv_cache: key (", key.scalar_type(), "), value (", value.scalar_type(),
              ") and the caches (", key_cache.scalar_type(), ") must share one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "attn_di write_kv_cache: key and value need a contiguous last dimension");
  TORCH_CHECK(non_overlapping(key_cache) && non_overlapping(value_cache),
              "attn_di write_kv_cache: a cache has slots that may share memory (key_cache strides ",
              key_cache.strides(), ", value_cache strides ", value_cache.strides(), " of shape ",
              key_cache.sizes(), ")");
  const int64_t n = key.size(0);
  Indices slots = index_tensor(op, slot_mapping_in, "slot_mapping", 1);
  TORCH_CHECK(slots.rows >= n, "attn_di write_kv_cache: slot_mapping has ", slots.rows,
              " entries for ", n, " tokens (one slot per token)");
  // The two caches are written; the rows copied and the slots may lie in neither.
  check_apart(op, key_cache, "key_cache", value_cache, "value_cache", true);
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    const char* cache_name = cache == &key_cache ? "key_cache" : "value_cache";
    check_apart(op, *cache, cache_name, key, "key");
    check_apart(op, *cache, cache_name, value, "value");
    check_apart(op, *cache, cache_name, slot_mapping_in, "slot_mapping");
  }
  const int64_t* slot = slots.data;
  const int64_t block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] < num_slots, "attn_di write_kv_cache: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", num_slots, " slots");
  return slots;
}

// write_kv_cache's copies, after check_write passed (`slot`: its slots).
void copy_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
               at::Tensor& value_cache, const int64_t* slot) {
  const int64_t n = key.size(0), heads = key.size(1), size = key.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t item = static_cast<int64_t>(key_cache.element_size());
  const int64_t head_bytes = size * item;
  char* keys = static_cast<char*>(key_cache.data_ptr());
  char* values = static_cast<char*>(value_cache.data_ptr());
  const char* key_data = static_cast<const char*>(key.const_data_ptr());
  const char* value_data = static_cast<const char*>(value.const_data_ptr());
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t k_at = block * key_cache.stride(0) + offset * key_cache.stride(1) + h * key_cache.stride(2);
        const int64_t v_at = block * value_cache.stride(0) + offset * value_cache.stride(1) + h * value_cache.stride(2);
        std::memcpy(keys + k_at * item, key_data + (t * key.stride(0) + h * key.stride(1)) * item, head_bytes);
        std::memcpy(values + v_at * item, value_data + (t * value.stride(0) + h * value.stride(1)) * item,
                    head_bytes);
      }
    }
  });
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_no_math_bits("write_kv_cache", {{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"},
                                         {&value_cache, "value_cache"}, {&slot_mapping, "slot_mapping"}});
  const Indices slots = check_write(key, value, key_cache, value_cache, slot_mapping);
  copy_rows(key, value, key_cache, value_cache, slots.data);
}

// write_kv_cache of the first `written` rows of key and value into kv_cache ([2,
// num_blocks, block_size, H_kv, D]: kv_cache[0] the keys, kv_cache[1] the values, the planes
// CPU_ATTN's checked path hands the two ops), then paged_attention into `output` ([N, heads *
// head_size], viewed as [N, heads, head_size]): one call for a decoder layer's step, every
// check of both ops (and that the caches share no memory with what the attention reads, nor
// output with what the write reads) made once, before anything is written (the write is
// attend's before_run), so a refused call changes nothing. query [N, heads, head_size], key
// and value [N, kv_heads, head_size]: the layer's own head counts and size.
void write_and_attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t written,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, at::Tensor& output, double scale,
                      int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& alibi_slopes,
                      const std::optional<at::Tensor>& sinks, bool causal, int64_t heads, int64_t kv_heads,
                      int64_t head_size) {
  constexpr const char* op = "write_and_attend";
  check_no_math_bits(op, {{&query, "query"}, {&key, "key"}, {&value, "value"}, {&kv_cache, "kv_cache"},
                         {&slot_mapping, "slot_mapping"}, {&block_table, "block_table"},
                         {&seq_lens, "seq_lens"}, {&query_start_loc, "query_start_loc"},
                         {&output, "output"}, {given(alibi_slopes), "alibi_slopes"},
                         {given(sinks), "sinks"}});
  check_dense_cpu(op, query, "query");
  check_dense_cpu(op, key, "key");
  check_dense_cpu(op, value, "value");
  check_dense_cpu(op, output, "output");
  check_dense_cpu(op, kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "attn_di write_and_attend: kv_cache must be [2, num_blocks, block_size, H_kv, D], got shape ",
              kv_cache.sizes());
  // The planes, and the step's rows, as views made below autograd (no view tracking: they
  // never leave this call).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  const int64_t n = query.dim() == 3 ? query.size(0) : -1;
  TORCH_CHECK(query.dim() == 3 && query.size(1) == heads && query.size(2) == head_size,
              "attn_di write_and_attend: query must be [N, ", heads, ", ", head_size, "], got shape ",
              query.sizes());
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == kv_heads && t->size(2) == head_size,
                "attn_di write_and_attend: key and value must be [", n, ", ", kv_heads, ", ", head_size,
                "], got shapes ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(written >= 0 && written <= n, "attn_di write_and_attend: ", written,
              " rows to write of ", n);
  TORCH_CHECK(output.dim() == 2 && output.size(0) == n && output.size(1) == heads * head_size &&
                  output.stride(1) == 1,
              "attn_di write_and_attend: output must be [", n, ", ", heads * head_size,
              "] with a contiguous last dimension, got shape ", output.sizes(), " strides ",
              output.strides());
  check_kernel_dtype(query.scalar_type());
  at::Tensor out = output.view({n, heads, head_size});
  const at::Tensor keys = key.narrow(0, 0, written), values = value.narrow(0, 0, written);
  const Indices slots = check_write(keys, values, key_cache, value_cache, slot_mapping);
  attend(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale, sliding_window,
         soft_cap, alibi_slopes, sinks, causal, [&] {
           // What the attention reads must not change under the write, nor what the write
           // reads under the output (the two ops check only their own pairs; attend has
           // already refused the output sharing memory with a cache).
           for (const at::Tensor* cache : {&key_cache, &value_cache}) {
             const char* name = cache == &key_cache ? "key_cache" : "value_cache";
             check_apart(op, *cache, name, key, "key");  // all of its rows, the unwritten ones too
             check_apart(op, *cache, name, value, "value");
             check_apart(op, *cache, name, query, "query");
             check_apart(op, *cache, name, block_table, "block_table");
             check_apart(op, *cache, name, seq_lens, "seq_lens");
             check_apart(op, *cache, name, query_start_loc, "query_start_loc");
             if (alibi_slopes.has_value()) check_apart(op, *cache, name, *alibi_slopes, "alibi_slopes");
             if (sinks.has_value()) check_apart(op, *cache, name, *sinks, "sinks");
           }
           check_apart(op, output, "output", key, "key");
           check_apart(op, output, "output", value, "value");
           check_apart(op, output, "output", slot_mapping, "slot_mapping");
           copy_rows(keys, values, key_cache, value_cache, slots.data);
         });
}

}  // namespace

std::string isa() { return ATTN_DI_STRINGIFY(ATTN_DI_KERNEL_ISA); }

// The decode kernel's items run so far in this process: [on AMX tiles, scores and P V on AMX
// tiles, on vector registers, P V of the second kind redone on vector registers].
std::vector<int64_t> decode_items() { return load_counts(g_item_counts); }

// How this build computes bfloat16 attention on this CPU, for kernel_status().
std::string bf16_paths() {
#if defined(ATTN_DI_AMX)
  std::string decode = amx_state().usable
                           ? "decode (D a multiple of 32): one-token queries of <= 16 heads per KV "
                             "head run both products on AMX tiles with the value rows in place, "
                             "other queries of query rows per KV head x D >= 512 run on AMX tiles, "
                             "AVX512_BF16 scores and float32 FMA P V elsewhere"
                           : "decode: AVX512_BF16 scores, float32 FMA P V (no AMX: " + amx_state().why + ")";
#else
  std::string decode = kNativeBf16Dot ? "decode: AVX512_BF16 scores, AVX512_BF16 P V for one-token "
                                        "queries of D a multiple of 32 (probabilities rounded to "
                                        "bfloat16), float32 FMA P V elsewhere"
                                      : "decode: float32 FMA on converted rows";
#endif
#if defined(ATTN_DI_AMX)
  const bool own_tiles = amx_state().usable;
#else
  const bool own_tiles = false;
#endif
  std::string prefill = own_tiles ? "prefill: AMX tile GEMMs (D a multiple of 32, oneDNN's elsewhere)"
                        : native_bf16_gemm() ? "prefill: AMX tile GEMMs (oneDNN)"
                                             : "prefill: float32 GEMMs on converted tiles";
  return decode + "; " + prefill;
}

}  // namespace attn_di_kernel

TORCH_LIBRARY(attn_di, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor(a!) out, float scale, int sliding_window, "
      "float soft_cap, Tensor? alibi_slopes=None, Tensor? sinks=None, bool causal=True) -> ()");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "write_and_attend(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, int written, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor(c!) output, float scale, int sliding_window, float soft_cap, "
      "Tensor? alibi_slopes, Tensor? sinks, bool causal, int heads, int kv_heads, int head_size) -> ()");
  m.def("isa() -> str", &attn_di_kernel::isa);
  m.def("bf16_paths() -> str", &attn_di_kernel::bf16_paths);
  m.def("decode_items() -> int[]", &attn_di_kernel::decode_items);
  m.def("prefill_items() -> int[]", &attn_di_kernel::prefill_items);
}

TORCH_LIBRARY_IMPL(attn_di, CPU, m) {
  m.impl("paged_attention", &attn_di_kernel::paged_attention);
  m.impl("write_kv_cache", &attn_di_kernel::write_kv_cache);
  m.impl("write_and_attend", &attn_di_kernel::write_and_attend);
}

// The ops see math bits themselves (check_no_math_bits), not torch's resolved copies.
namespace {
constexpr const char* kTensorOps[] = {"paged_attention", "write_kv_cache", "write_and_attend"};

void fall_through(torch::Library& m) {
  for (const char* name : kTensorOps) m.impl(name, torch::CppFunction::makeFallthrough());
}
}  // namespace

TORCH_LIBRARY_IMPL(attn_di, Negative, m) { fall_through(m); }
TORCH_LIBRARY_IMPL(attn_di, Conjugate, m) { fall_through(m); }
TORCH_LIBRARY_IMPL(attn_di, ZeroTensor, m) { fall_through(m); }
