// The P V pass of CPU_ATTN's vector decode for bfloat16 value rows (paged_attention.cpp), alone:
// the two steps the kernel has, on the same rows and probabilities.
//   fma   value_tile_bf16_paired: each row widened to float32 by one VPUNPCKLWD / VPUNPCKHWD
//         against zero per 32 values, times each query row's float32 probability by FMA
//         (the `amx` build's vector path)
//   dot   value_tile_bf16_dot: the rows of keys 2u and 2u + 1 interleaved by one VPUNPCKLWD /
//         VPUNPCKHWD per 32 values, VDPBF16PS against the broadcast pair of their bfloat16
//         probabilities (the `avx512_bf16` build's one-token items)
// Both keep 2 x NR float32 accumulators per 32 values of D, as the kernel does, and walk an
// item's keys in tiles of 16, KV head by KV head, with the accumulators stored between tiles.
//
// Shapes: SmolLM2-135M's decode (3 KV heads of D = 64, 3 query rows each) over 560 and 64 keys,
// and 8 KV heads of D = 128 with 4 query rows each over 2048 keys.
//
// Build and run (Linux, a CPU with AVX512_BF16; no -march=native):
//   c++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -o /tmp/vector_value_steps benchmarks/vector_value_steps.cpp
//   /tmp/vector_value_steps
// Prints the CPU model and flags, then per shape the best of the sweeps in TSC ticks per key
// and KV head. docs/benchmarks.md has the numbers and what they mean.

#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "_machine.h"

namespace {

template <int NR>
__attribute__((noinline)) void fma_tile(const uint16_t* const* v, int nt, const float* p, int p_stride,
                                        float* acc, int size) {
  const __m512i zero = _mm512_setzero_si512();
  for (int d = 0; d < size; d += 32) {
    __m512 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + r * size + d);
      a[r][1] = _mm512_loadu_ps(acc + r * size + d + 16);
    }
    for (int t = 0; t < nt; ++t) {
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

template <int NR>
__attribute__((noinline)) void dot_tile(const uint16_t* const* v, int nt, const uint32_t* pairs, int p_stride,
                                        float* acc, int size) {
  const int count = (nt + 1) / 2;
  for (int d = 0; d < size; d += 32) {
    __m512 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + r * size + d);
      a[r][1] = _mm512_loadu_ps(acc + r * size + d + 16);
    }
    for (int u = 0; u < count; ++u) {
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

// One item of `keys` keys (token-major rows of kv_heads x d values), NR query rows per KV head:
// the best of `sweeps` runs of each step, alternating, in ticks per key and KV head.
template <int NR>
void run(int d, int kv_heads, int keys, int sweeps) {
  const int rows = NR * kv_heads;
  std::vector<uint16_t> cache(static_cast<size_t>(keys) * kv_heads * d);
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<uint16_t>(0x3f80 + (i * 37 % 127));
  const std::vector<float> p(static_cast<size_t>(keys) * rows, 1.0f / 512);
  const std::vector<uint32_t> pairs(static_cast<size_t>(keys) / 2 * rows, 0x3b003b00u);  // bf16 1/512
  std::vector<float> acc(static_cast<size_t>(rows) * d, 0.f);
  double best[2] = {1e30, 1e30};
  for (int sweep = 0; sweep < sweeps; ++sweep)
    for (int which = 0; which < 2; ++which) {
      const uint64_t start = __rdtsc();
      for (int j0 = 0; j0 < keys; j0 += 16) {
        const uint16_t* tile[16];
        for (int g = 0; g < kv_heads; ++g) {
          for (int t = 0; t < 16; ++t) tile[t] = cache.data() + (static_cast<size_t>(j0 + t) * kv_heads + g) * d;
          float* out = acc.data() + static_cast<size_t>(g) * NR * d;
          if (which == 0)
            fma_tile<NR>(tile, 16, p.data() + j0 * rows + g * NR, rows, out, d);
          else
            dot_tile<NR>(tile, 16, pairs.data() + j0 / 2 * rows + g * NR, rows, out, d);
        }
      }
      const double ticks = static_cast<double>(__rdtsc() - start) / keys / kv_heads;
      best[which] = std::min(best[which], ticks);
    }
  std::printf("%2d KV heads of D = %3d, %d rows each, %4d keys   fma %6.2f   dot %6.2f   (checksum %g)\n", kv_heads,
              d, NR, keys, best[0], best[1], static_cast<double>(acc[0]));
}

}  // namespace

int main() {
  if (!bench_machine::announce("avx512_bf16")) return 1;
  std::printf("P V, TSC ticks per key and KV head (best of the sweeps)\n");
  run<3>(64, 3, 560, 200);
  run<3>(64, 3, 64, 2000);
  run<4>(128, 8, 2048, 20);
  return 0;
}
