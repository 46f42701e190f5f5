// The score pass of CPU_ATTN's vector decode (score_tile / score_tile_bf16 in
// src/attn_di/backends/_cpu_kernel/paged_attention.cpp), alone, against the same products over
// key layouts the cache does not have: what the token-major rows cost the vector paths.
//
// Shape: one SmolLM2-135M decode sequence (3 KV heads, 3 query heads each, D = 64) of `keys`
// keys on pages of 32 tokens, pages in shuffled order, `seqs` such sequences taken in turn (1
// keeps them in the L2, 32 or more spill it). The kernel's step is 4 tokens x 3 query rows:
// 12 accumulators of 16 lanes (D / 16 FMAs, or D / 32 VDPBF16PS, each), then one shuffle tree
// (store_sums) for the 12 horizontal sums, stored into the token-major score block. Variants:
//   f32 rows             the kernel's float32 step (attn_di's layout: a token's row of a head is
//                        D contiguous values)
//   f32 rows, no sums    the same products, lane 0 stored instead of the sum: the tree's share
//   f32 rows, q held     the kernel's step for <= 3 rows of 64 (score_step_held): the KV
//                        head's query rows in registers across its keys, not loaded per step
//   f32 D-major          keys [D][32] per page and head (vLLM's vec layout for its key half):
//                        16 keys in the lanes, q broadcast, no sums, scores row by row
//   bf16 rows            the avx512_bf16 build's step (VDPBF16PS over 32 pairs of D)
//   bf16 rows, no sums   the same, lane 0 stored
//   bf16 rows widened    the rows widened in registers (VPSLLD / VPANDD), float32 FMAs against
//                        queries split in even and odd halves, then the tree
//   bf16 pairs           keys [D/2][32][2] per page and head: VDPBF16PS with 16 keys in the
//                        lanes, a query pair broadcast, no sums
//   bf16 D-major         keys [D][32]: 16 keys' values widened (VPMOVZXWD, VPSLLD), FMAs
// Then the issue rate of the instructions these loops are made of (12 independent chains).
//
// Build and run (Linux, a CPU with AVX512_BF16; no -march=native):
//   c++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -o /tmp/vector_score_steps benchmarks/vector_score_steps.cpp
//   /tmp/vector_score_steps [keys=560] [seqs=1]
// Prints the CPU model and flags, then per variant the median of 7 sweeps in TSC ticks per
// key and KV head (3 query rows each). docs/benchmarks.md has the numbers and what they mean.

#include "_machine.h"

#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

namespace {

constexpr int kKvHeads = 3, kRows = 3, kHeads = kKvHeads * kRows, kD = 64, kBlock = 32;
constexpr int kUnroll = 4;  // tokens a step (kScoreUnroll<3>)

// One sequence's pages: page p of head g holds its 32 keys in the variant's layout; block
// b of the sequence is page table[b]. Elements are float or uint16_t (bfloat16 bits).
template <typename E>
struct Pages {
  std::vector<int> table;
  E* data = nullptr;
  // The token-major row of key j, head g (attn_di's layout: a token's heads side by side).
  const E* row(int j, int g) const {
    return data + (static_cast<size_t>(table[j / kBlock]) * kBlock + j % kBlock) * kKvHeads * kD +
           static_cast<size_t>(g) * kD;
  }
  // The page of block b, head g, in a head-major layout ([kBlock * kD] elements per page).
  const E* page(int b, int g) const {
    return data + (static_cast<size_t>(table[b]) * kKvHeads + g) * kBlock * kD;
  }
};

template <typename E>
Pages<E> make_pages(int keys, int seed, E value) {
  Pages<E> p;
  const int blocks = (keys + kBlock - 1) / kBlock;
  p.table.resize(blocks);
  for (int b = 0; b < blocks; ++b) p.table[b] = b;
  std::shuffle(p.table.begin(), p.table.end(), std::mt19937(seed));
  const size_t count = static_cast<size_t>(blocks) * kBlock * kKvHeads * kD;
  p.data = static_cast<E*>(std::aligned_alloc(64, count * sizeof(E)));
  std::fill(p.data, p.data + count, value);
  return p;
}

// The 12 horizontal sums of a step (token u, row r at a[u * kRows + r]) into out[u * stride +
// r]: two unpack levels within 128-bit lanes, two lane shuffles across them (as store_sums).
inline void tree_sums(const __m512* a, float* out, int64_t stride) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 v[kUnroll];
  for (int u = 0; u < kUnroll; ++u) {
    const __m512 r0 = a[u * kRows], r1 = a[u * kRows + 1], r2 = a[u * kRows + 2];
    const __m512 lo = _mm512_add_ps(_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
    const __m512 hi = _mm512_add_ps(_mm512_unpacklo_ps(r2, zero), _mm512_unpackhi_ps(r2, zero));
    const __m512d l = _mm512_castps_pd(lo), h = _mm512_castps_pd(hi);
    v[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(l, h)), _mm512_castpd_ps(_mm512_unpackhi_pd(l, h)));
  }
  auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  };
  const __m512 sums = fold(fold(v[0], v[1]), fold(v[2], v[3]));
  const __m128 lanes[kUnroll] = {_mm512_extractf32x4_ps(sums, 0), _mm512_extractf32x4_ps(sums, 1),
                                 _mm512_extractf32x4_ps(sums, 2), _mm512_extractf32x4_ps(sums, 3)};
  for (int u = 0; u < kUnroll; ++u) _mm_mask_storeu_ps(out + u * stride, 0x7, lanes[u]);
}

// Lane 0 of each accumulator instead of its sum.
inline void lane_sums(const __m512* a, float* out, int64_t stride) {
  for (int u = 0; u < kUnroll; ++u)
    for (int r = 0; r < kRows; ++r) out[u * stride + r] = _mm512_cvtss_f32(a[u * kRows + r]);
}

// A row step: `product(acc, u, d)` adds token u's products over D chunk d into the step's
// accumulators; then the sums. Over all keys and KV heads of one sequence.
template <typename E, typename Step>
void row_pass(const Pages<E>& p, int keys, float* scores, Step&& step) {
  for (int j0 = 0; j0 + kUnroll <= keys; j0 += kUnroll)
    for (int g = 0; g < kKvHeads; ++g) {
      const E* k[kUnroll];
      for (int u = 0; u < kUnroll; ++u) k[u] = p.row(j0 + u, g);
      step(k, g, scores + static_cast<size_t>(j0) * kHeads + g * kRows);
    }
}

// The kernel's row steps, by element type: float32 rows by FMA (16 values of D a product),
// bfloat16 rows by VDPBF16PS (32 values, in pairs).
struct F32Rows {
  using E = float;
  using X = __m512;
  static constexpr int kChunk = 16;
  static X load(const float* p) { return _mm512_load_ps(p); }
  static __m512 product(__m512 acc, X q, X k) { return _mm512_fmadd_ps(q, k, acc); }
};
struct Bf16Rows {
  using E = uint16_t;
  using X = __m512bh;
  static constexpr int kChunk = 32;
  static X load(const uint16_t* p) { return (__m512bh)_mm512_load_si512(p); }
  static __m512 product(__m512 acc, X q, X k) { return _mm512_dpbf16_ps(acc, q, k); }
};

template <typename R, bool kSums>
void rows_step(const Pages<typename R::E>& p, int keys, const typename R::E* q, float* scores) {
  using E = typename R::E;
  row_pass(p, keys, scores, [&](const E* const* k, int g, float* out) {
    __m512 a[kUnroll * kRows];
    for (auto& x : a) x = _mm512_setzero_ps();
    for (int d = 0; d < kD; d += R::kChunk) {
      typename R::X x[kUnroll];
      for (int u = 0; u < kUnroll; ++u) x[u] = R::load(k[u] + d);
      for (int r = 0; r < kRows; ++r) {
        const typename R::X qv = R::load(q + (g * kRows + r) * kD + d);
        for (int u = 0; u < kUnroll; ++u) a[u * kRows + r] = R::product(a[u * kRows + r], qv, x[u]);
      }
    }
    kSums ? tree_sums(a, out, kHeads) : lane_sums(a, out, kHeads);
  });
}

// The f32 rows step with the KV head's query rows held in registers (KV head outer, as the
// kernel's score_tile_held holds them for a 16-key tile).
void f32_rows_held(const Pages<float>& p, int keys, const float* q, float* scores) {
  for (int g = 0; g < kKvHeads; ++g) {
    __m512 qv[kRows][kD / 16];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kD / 16; ++c) qv[r][c] = _mm512_load_ps(q + (g * kRows + r) * kD + c * 16);
    for (int j0 = 0; j0 + kUnroll <= keys; j0 += kUnroll) {
      const float* k[kUnroll];
      for (int u = 0; u < kUnroll; ++u) k[u] = p.row(j0 + u, g);
      __m512 a[kUnroll * kRows];
      for (auto& x : a) x = _mm512_setzero_ps();
      for (int c = 0; c < kD / 16; ++c) {
        __m512 x[kUnroll];
        for (int u = 0; u < kUnroll; ++u) x[u] = _mm512_load_ps(k[u] + c * 16);
        for (int r = 0; r < kRows; ++r)
          for (int u = 0; u < kUnroll; ++u) a[u * kRows + r] = _mm512_fmadd_ps(qv[r][c], x[u], a[u * kRows + r]);
      }
      tree_sums(a, scores + static_cast<size_t>(j0) * kHeads + g * kRows, kHeads);
    }
  }
}

// q_split: per query row and 32 values of D, the 16 at even offsets then the 16 at odd ones.
void bf16_rows_widened(const Pages<uint16_t>& p, int keys, const float* q_split, float* scores) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  row_pass(p, keys, scores, [&](const uint16_t* const* k, int g, float* out) {
    __m512 a[kUnroll * kRows];
    for (auto& x : a) x = _mm512_setzero_ps();
    for (int d = 0; d < kD; d += 32) {
      __m512 even[kUnroll], odd[kUnroll];
      for (int u = 0; u < kUnroll; ++u) {
        const __m512i x = _mm512_load_si512(k[u] + d);
        even[u] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        odd[u] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      }
      for (int r = 0; r < kRows; ++r) {
        const float* qr = q_split + (g * kRows + r) * kD + d;
        const __m512 qe = _mm512_load_ps(qr), qo = _mm512_load_ps(qr + 16);
        for (int u = 0; u < kUnroll; ++u)
          a[u * kRows + r] = _mm512_fmadd_ps(qo, odd[u], _mm512_fmadd_ps(qe, even[u], a[u * kRows + r]));
      }
    }
    tree_sums(a, out, kHeads);
  });
}

// Lane steps: 16 keys of one head in the lanes, each query row's scores one vector per 16
// keys, stored row by row (scores[(g * kRows + r) * keys + j]). `column(page, c, i)` gives 16
// keys' values of column i (a value of D, or a pair) from the page's key half at 16-key group
// c; `query(row, i)` the query's column i broadcast; R::product adds their products. A page's
// two groups share each broadcast, and two partial sums per (group, row) (columns i % 2) keep
// 12 product chains in flight.
template <typename R, int kGroups, typename E, typename Column, typename Query>
void lane_step(const E* page, int g, int columns, int keys, int j0, float* scores, Column& column, Query& query) {
  __m512 a[2][kGroups][kRows];
  for (auto& part : a)
    for (auto& group : part)
      for (auto& x : group) x = _mm512_setzero_ps();
  for (int i = 0; i < columns; i += 2)
    for (int k = 0; k < 2; ++k) {
      typename R::X x[kGroups];
      for (int c = 0; c < kGroups; ++c) {
        x[c] = column(page, c, i + k);
        asm("" : "+v"(x[c]));  // one load per column and group, not one per product
      }
      for (int r = 0; r < kRows; ++r) {
        const typename R::X qv = query(g * kRows + r, i + k);
        for (int c = 0; c < kGroups; ++c) a[k][c][r] = R::product(a[k][c][r], qv, x[c]);
      }
    }
  for (int c = 0; c < kGroups; ++c)
    for (int r = 0; r < kRows; ++r)
      _mm512_storeu_ps(scores + (g * kRows + r) * keys + j0 + 16 * c, _mm512_add_ps(a[0][c][r], a[1][c][r]));
}

template <typename R, typename E, typename Column, typename Query>
void lane_pass(const Pages<E>& p, int keys, int columns, float* scores, Column&& column, Query&& query) {
  for (int j0 = 0; j0 < keys; j0 += kBlock)
    for (int g = 0; g < kKvHeads; ++g) {
      const E* page = p.page(j0 / kBlock, g);
      if (j0 + kBlock <= keys)
        lane_step<R, 2>(page, g, columns, keys, j0, scores, column, query);
      else
        lane_step<R, 1>(page, g, columns, keys, j0, scores, column, query);
    }
}

void f32_dmajor(const Pages<float>& p, int keys, const float* q, float* scores) {
  lane_pass<F32Rows>(
      p, keys, kD, scores,
      [](const float* page, int c, int i) { return _mm512_load_ps(page + i * kBlock + c * 16); },
      [&](int row, int i) { return _mm512_set1_ps(q[row * kD + i]); });
}

void bf16_pairs(const Pages<uint16_t>& p, int keys, const uint32_t* q_pairs, float* scores) {
  lane_pass<Bf16Rows>(
      p, keys, kD / 2, scores,
      [](const uint16_t* page, int c, int i) { return (__m512bh)_mm512_load_si512(page + (i * kBlock + c * 16) * 2); },
      [&](int row, int i) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[row * kD / 2 + i])); });
}

// The keys widened to float32 as they load, then float32 products.
void bf16_dmajor(const Pages<uint16_t>& p, int keys, const float* q, float* scores) {
  lane_pass<F32Rows>(
      p, keys, kD, scores,
      [](const uint16_t* page, int c, int i) {
        const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(page + i * kBlock + c * 16));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
      },
      [&](int row, int i) { return _mm512_set1_ps(q[row * kD + i]); });
}

// Median TSC ticks per key and KV head of `pass` over all sequences, 7 sweeps.
double ticks_per_key(int keys, int seqs, const std::function<void(int)>& pass) {
  for (int s = 0; s < seqs; ++s) pass(s);
  const int reps = std::max(1, 20'000'000 / (keys * seqs * kKvHeads));
  std::vector<double> sweeps;
  for (int sweep = 0; sweep < 7; ++sweep) {
    const uint64_t t0 = __rdtsc();
    for (int r = 0; r < reps; ++r)
      for (int s = 0; s < seqs; ++s) pass(s);
    sweeps.push_back(static_cast<double>(__rdtsc() - t0) / (static_cast<double>(reps) * seqs * keys * kKvHeads));
  }
  std::nth_element(sweeps.begin(), sweeps.begin() + 3, sweeps.end());
  return sweeps[3];
}

// TSC ticks per instruction of `op` over 12 independent chains (enough to cover a 4-6 cycle
// latency at two a cycle), the chains pinned in registers after each round.
template <typename Op>
double issue_ticks(Op op) {
  __m512 a0 = _mm512_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0;
  const __m512 b = _mm512_set1_ps(1.0f);
  constexpr long kLoops = 10'000'000;
  const uint64_t t0 = __rdtsc();
  for (long n = 0; n < kLoops; ++n) {
    a0 = op(a0, b), a1 = op(a1, b), a2 = op(a2, b), a3 = op(a3, b), a4 = op(a4, b), a5 = op(a5, b);
    a6 = op(a6, b), a7 = op(a7, b), a8 = op(a8, b), a9 = op(a9, b), a10 = op(a10, b), a11 = op(a11, b);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                 "+v"(a9), "+v"(a10), "+v"(a11));
  }
  return static_cast<double>(__rdtsc() - t0) / (kLoops * 12.0);
}

}  // namespace

int main(int argc, char** argv) {
  const int keys = argc > 1 ? std::atoi(argv[1]) : 560;
  const int seqs = argc > 2 ? std::atoi(argv[2]) : 1;
  if (keys < 16 || keys % 16 != 0 || seqs < 1) {
    std::fprintf(stderr, "keys must be a positive multiple of 16 and seqs >= 1\n");
    return 2;
  }
  if (!bench_machine::announce("avx512_bf16")) return 1;
  std::printf("%d keys x %d KV heads of D = %d, %d query rows each, %d sequence(s) in turn\n", keys, kKvHeads,
              kD, kRows, seqs);
  std::vector<Pages<float>> f32;
  std::vector<Pages<uint16_t>> bf16;
  for (int s = 0; s < seqs; ++s) {
    f32.push_back(make_pages<float>(keys, s, 1.0f / 64));
    bf16.push_back(make_pages<uint16_t>(keys, s, 0x3c80));  // bfloat16 1/64
  }
  alignas(64) static float q[kHeads * kD], q_split[kHeads * kD];
  alignas(64) static uint16_t q_bf16[kHeads * kD];
  alignas(64) static uint32_t q_pairs[kHeads * kD / 2];
  for (int i = 0; i < kHeads * kD; ++i) {
    q[i] = q_split[i] = 0.5f;
    q_bf16[i] = 0x3f00;  // bfloat16 0.5
  }
  for (int i = 0; i < kHeads * kD / 2; ++i) q_pairs[i] = 0x3f003f00u;
  std::vector<float> scores(static_cast<size_t>(keys) * kHeads + 16);
  float* out = scores.data();

  struct Variant {
    const char* name;
    std::function<void(int)> pass;
  };
  const Variant variants[] = {
      {"f32 rows", [&](int s) { rows_step<F32Rows, true>(f32[s], keys, q, out); }},
      {"f32 rows, no sums", [&](int s) { rows_step<F32Rows, false>(f32[s], keys, q, out); }},
      {"f32 rows, q held", [&](int s) { f32_rows_held(f32[s], keys, q, out); }},
      {"f32 D-major", [&](int s) { f32_dmajor(f32[s], keys, q, out); }},
      {"bf16 rows", [&](int s) { rows_step<Bf16Rows, true>(bf16[s], keys, q_bf16, out); }},
      {"bf16 rows, no sums", [&](int s) { rows_step<Bf16Rows, false>(bf16[s], keys, q_bf16, out); }},
      {"bf16 rows widened", [&](int s) { bf16_rows_widened(bf16[s], keys, q_split, out); }},
      {"bf16 pairs", [&](int s) { bf16_pairs(bf16[s], keys, q_pairs, out); }},
      {"bf16 D-major", [&](int s) { bf16_dmajor(bf16[s], keys, q, out); }},
  };
  std::printf("%-20s %s\n", "variant", "ticks per key and KV head");
  for (const Variant& v : variants) std::printf("%-20s %6.2f\n", v.name, ticks_per_key(keys, seqs, v.pass));

  std::printf("\nissue rate, ticks per instruction (12 independent chains)\n");
  std::printf("%-20s %6.3f\n", "VFMADD231PS zmm", issue_ticks([](__m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, b); }));
  std::printf("%-20s %6.3f\n", "VDPBF16PS zmm",
              issue_ticks([](__m512 a, __m512 b) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)b); }));
  std::printf("%-20s %6.3f\n", "VUNPCKLPS zmm", issue_ticks([](__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }));
  std::printf("%-20s %6.3f\n", "VADDPS zmm", issue_ticks([](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
  return 0;
}
