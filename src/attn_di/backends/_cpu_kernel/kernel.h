// Shared by CPU_ATTN's compiled kernels (paged_attention.cpp: the op, its checks and the
// decode kernel; prefill.cpp: the prefill kernel): options, strided cache views, conversions.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#ifndef ATTN_DI_KERNEL_ISA
#define ATTN_DI_KERNEL_ISA default
#endif
#define ATTN_DI_STRINGIFY_(x) #x
#define ATTN_DI_STRINGIFY(x) ATTN_DI_STRINGIFY_(x)

namespace attn_di_kernel {

// Scratch storage aligned to a cache line (64 bytes): a tile row or vector of 64 bytes then
// spans one line, not two. std::vector's own allocator aligns to 16 bytes, and glibc places
// a block of 128 KiB or more (an mmap) 16 bytes past a page, so without this every row of a
// large scratch buffer is split across two lines (measured: bfloat16 prefill P V at ~55
// cycles per AMX product instead of ~16, docs/benchmarks.md).
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, kLine); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept { return true; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for the softmax numerators (x <= 0 after the shift; -inf gives 0, NaN stays NaN: a
// NaN score, from a NaN query, key or an infinite difference, must reach the output as
// NaN, as the reference's does, never a probability of 0). On AVX-512:
// 2^t = 2^n * 2^f, t = x log2(e), n = round(t), |f| <= 1/2, 2^f by its degree-5 Taylor
// polynomial (relative error < 3e-6 there, as ATen's exp_u20), scaled by 2^n with vscalefps;
// 12 instructions, NaN carried through them (no blend after). Elsewhere ATen's exp_u20.
inline fVec softmax_exp(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 raw = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  // Below 2^-125 (and -inf) the result is 0: no denormal ever computed (they are slow). A NaN
  // passes both: the unordered compare is true for it, and VMAXPS returns its second operand
  // where either is NaN, so t, n, f, p and the result are NaN.
  const __mmask16 normal = _mm512_cmp_ps_mask(raw, _mm512_set1_ps(-125.f), _CMP_NLE_UQ);
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-125.f), raw);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 120.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  return fVec::blendv(x.exp_u20(), x, x.isnan());  // exp_u20 clamps NaN to ~0
#endif
}

// The sum a partial result gives a row that saw keys whose scores were all -inf (max -inf):
// merge_partials then writes NaN unless another part or the sink has a finite score (an
// ordinary row that saw no key has max -inf and sum 0).
constexpr float kOnlyNegInfScores = -1.f;

// One layer's options, fixed for a call.
struct Options {
  int64_t heads, kv_heads, group, head_size, block_size, num_blocks;
  float scale;
  int64_t window;     // 0: none
  float soft_cap;     // 0: none
  const float* alibi; // [H] or nullptr
  const float* sinks; // [H] or nullptr
};

// One strided cache plane ([num_blocks, block_size, H_kv, D], last dim contiguous).
template <typename T>
struct CacheView {
  const T* base;
  int64_t block_stride, token_stride, head_stride;

  // The token row of position `offset` in block `block` (its KV head 0).
  const T* row(int64_t block, int64_t offset) const {
    return base + block * block_stride + offset * token_stride;
  }
};

template <typename T>
CacheView<T> cache_view(const at::Tensor& cache) {
  return {cache.const_data_ptr<T>(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

// The prefetch helpers are always inlined: GCC's local-pure-const pass finds a function made
// only of __builtin_prefetch calls "looping const" (the builtin has no side effect GCC models),
// and then deletes every call whose caller did not inline it before that pass. GCC 12 -O3
// dropped that way the key and value prefetches of most kernel instantiations (an
// avx512_bf16 build held 5 PREFETCHT0 and 3 PREFETCHT1 where the sources ask for dozens).
#define ATTN_DI_PREFETCH_HELPER __attribute__((always_inline)) inline

// Every Step-th byte of [start, start + bytes) ahead of use (by default every cache line), for
// reading (or writing), at __builtin_prefetch's Locality (3: PREFETCHT0, into L1; 2:
// PREFETCHT1, into L2).
template <int64_t Step = 64, int Locality = 3, bool kWrite = false>
ATTN_DI_PREFETCH_HELPER void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += Step) __builtin_prefetch(p + off, kWrite ? 1 : 0, Locality);
}

#if defined(CPU_CAPABILITY_AVX512)
// The 32 16-bit columns of two rows a and b, after lo = VPUNPCKLWD(a, b) and hi =
// VPUNPCKHWD(a, b), sit per 128-bit lane (32-bit positions: lo 4L + e holds column 8L + e, hi
// 4L + e column 8L + 4 + e, L, e < 4): VPERMT2D / VPERMT2PS (lo, first, hi) gives columns
// 0-15 in order and (lo, second, hi) columns 16-31. Also the order of the float32 pairs an
// unpack against zero widens into (paged_attention.cpp, unpermute_row).
inline void unpack_order(__m512i& first, __m512i& second) {
  first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}
#endif

// The current values of a set of counters (decode_items(), prefill_items()).
template <size_t N>
std::vector<int64_t> load_counts(const std::atomic<int64_t> (&counts)[N]) {
  std::vector<int64_t> values;
  for (const auto& count : counts) values.push_back(count.load(std::memory_order_relaxed));
  return values;
}

// n values as float32 into `dst`.
template <typename T>
inline void convert_head(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    using bVec = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto converted = at::vec::convert_to_float<T>(bVec::loadu(src + i));
      std::get<0>(converted).store(dst + i);
      std::get<1>(converted).store(dst + i + kLanes);
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// `n` float32 values times `factor` into `dst` of type C (a copy for float and factor 1).
template <typename C>
inline void store_as(const float* src, int64_t n, C* dst, float factor = 1.f) {
  if constexpr (std::is_same_v<C, float>) {
    if (factor == 1.f) {
      std::copy(src, src + n, dst);
      return;
    }
  }
  const fVec f(factor);
  int64_t j = 0;
  if constexpr (std::is_same_v<C, float>) {
    for (; j + kLanes <= n; j += kLanes) (fVec::loadu(src + j) * f).store(dst + j);
  } else {
    for (; j + 2 * kLanes <= n; j += 2 * kLanes)
      at::vec::convert_from_float<C>(fVec::loadu(src + j) * f, fVec::loadu(src + j + kLanes) * f).store(dst + j);
  }
  for (; j < n; ++j) dst[j] = static_cast<C>(src[j] * factor);
}

// One output row from the partial results of `parts` key ranges (each its running max m_p,
// sum l_p and unnormalised accumulator acc_p, D floats) and the head's sink (-inf: none):
// row = sum_p acc_p e^(m_p - M) / (sum_p l_p e^(m_p - M) + e^(sink - M)), M the largest of
// the m_p and the sink (the log-sum-exp merge of FlashAttention's split-KV, Dao et al. 2023).
// Nothing visible and no sink gives zeros, like an empty sum; keys visible whose scores are all
// -inf (an infinite key or query), with no sink, give NaN (a part marks that with the sum
// kOnlyNegInfScores), as the reference's softmax does; a NaN anywhere in the maxima,
// sums or sink (a NaN or an infinite score: the softmax keeps NaN) gives a NaN row, as the
// reference's softmax does, never zeros or a finite row that left the NaN key out.
template <typename T>
inline void merge_partials(T* dst, int64_t D, float sink, const float* maxes, const float* sums,
                           const float* const* accs, int64_t parts) {
  // One part with a finite max and sum, no sink (most rows): M = m_0 and the row is acc_0 / l_0,
  // the same products as the general path below (whose weight is e^0 / l_0 = 1 / l_0).
  if (parts == 1 && sink == kNegInf && std::isfinite(maxes[0]) && std::isfinite(sums[0]) && sums[0] > 0.f) {
    const float weight = 1.f / sums[0];
    store_as<T>(accs[0], D, dst, weight);
    return;
  }
  // std::max drops a NaN in its second argument: NaN is checked for on its own.
  bool nan = std::isnan(sink), only_neg_inf = false;
  float peak = sink;
  for (int64_t part = 0; part < parts; ++part) {
    nan = nan || std::isnan(maxes[part]) || std::isnan(sums[part]);
    only_neg_inf = only_neg_inf || (maxes[part] == kNegInf && sums[part] == kOnlyNegInfScores);
    peak = std::max(peak, maxes[part]);
  }
  // Keys seen, every score -inf, no sink: the reference's softmax gives -inf - (-inf) = NaN.
  nan = nan || (peak == kNegInf && only_neg_inf);
  float denom = 0.f;
  if (peak != kNegInf) {
    for (int64_t part = 0; part < parts; ++part)
      if (maxes[part] != kNegInf) denom += sums[part] * std::exp(maxes[part] - peak);
    if (sink != kNegInf) denom += std::exp(sink - peak);
  }
  if (nan || std::isnan(denom)) {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (!(denom > 0.f)) {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(0.f);
    return;
  }
  float line[1024];
  std::vector<float> heap;
  float* merged = line;
  if (D > 1024) {
    heap.resize(D);
    merged = heap.data();
  }
  std::fill(merged, merged + D, 0.f);
  for (int64_t part = 0; part < parts; ++part) {
    if (maxes[part] == kNegInf) continue;  // an empty key range adds nothing
    const float weight = std::exp(maxes[part] - peak) / denom;
    const fVec w(weight);
    const float* a = accs[part];
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) (fVec::loadu(merged + d) + w * fVec::loadu(a + d)).store(merged + d);
    for (; d < D; ++d) merged[d] += weight * a[d];
  }
  store_as<T>(merged, D, dst);
}

// A sequence the prefill kernel attends: its queries are query[first_query, first_query +
// q_len), the last q_len of its seq_len positions.
struct PrefillSeq {
  int64_t seq, first_query, q_len, seq_len;
};

// Attention of `seqs` (every query row of each, all heads) into `out`; prefill.cpp. Arguments
// are the op's, already checked by paged_attention().
void run_prefill(const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const int64_t* table, int64_t table_stride,
                 at::Tensor& out, const Options& o, bool causal,
                 const std::vector<PrefillSeq>& seqs);

// Whether the prefill kernel's bfloat16 GEMMs run natively here (AMX tiles through oneDNN's
// batch-reduce GEMM, VNNI-packed B); prefill.cpp.
bool native_bf16_gemm();

// The prefill kernel's work items run so far in this process, by the GEMMs they ran: [AMX
// tiles of the amx build (bfloat16, D a multiple of 32), oneDNN's reduced-precision GEMMs,
// float32 GEMMs]; prefill.cpp.
std::vector<int64_t> prefill_items();

}  // namespace attn_di_kernel
