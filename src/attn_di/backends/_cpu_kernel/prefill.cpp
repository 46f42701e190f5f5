// CPU_ATTN's compiled prefill kernel: flash attention of long queries (prefills, chunked
// prefills, the long sequences of mixed batches, encoder attention) over the paged KV cache,
// read in place through the block table. paged_attention() (paged_attention.cpp) checks the
// arguments and hands this kernel every sequence its decode kernel does not take.
//
// softmax(q . k * scale [soft cap] [+ ALiBi] [mask]) . v (Vaswani et al. 2017), tiled as flash
// attention (Dao et al. 2022): a work item is one sequence x one KV head x a chunk of its query
// tokens (the G query heads of the KV head folded in: row r = token * G + head) x a range of
// keys. Its query rows are packed once; its keys are visited in tiles of kKeyTile tokens, each
// tile's K (transposed) and V packed once and used by every block of kRowBlock query rows that
// sees it. Per row block and key tile: S = Q K^T (a GEMM), the soft cap, ALiBi bias and mask
// on S, the online softmax update in float32 (running max and sum per row, Milakov &
// Gimelshein 2018), O += P V (a GEMM). Tiles no row of the block may see (above the causal
// diagonal, before the sliding window) are skipped; only the diagonal tiles are masked.
//
// The GEMMs are ATen's batch-reduce GEMM (at::native::cpublas::brgemm, oneDNN's JIT micro-
// kernels from torch itself: AVX-512 / AVX2 FMA for float32, AMX tiles for bfloat16 / float16
// where the CPU has them): on the machines measured the float32 ones reach the FMA roof at
// these tile shapes (docs/benchmarks.md). The exception is bfloat16 in the amx build (D a
// multiple of 32), whose GEMMs run on tiles written here (tile_scores, tile_values: 32 rows x
// 32 columns a step, B packed straight into tile order by pack_tiles): oneDNN's took ~60% of
// a bfloat16 prefill there, in 6 calls per row block and key tile of 64 columns each (a
// lookup per call, O read back through the call), and the diagonal tiles can stop at 32 keys
// instead of 64 (docs/benchmarks.md). Without AMX, bfloat16/float16 caches are converted to
// float32 while being packed and go through the float32 GEMMs; accumulation is float32
// everywhere.
//
// Only key slots of positions a query of the item may see are loaded (the visible range of
// its chunk, inside the sequence), so garbage (NaN/Inf) anywhere else in the cache never
// reaches the output; the padding of a partial tile is zeros, never cache memory.
//
// Work split: items are sized so that every thread of torch's intra-op pool gets several
// (query chunks, and key ranges when a batch has few long rows); items are handed out
// dynamically, longest first; a sequence's key ranges are merged through their (max, sum)
// pairs afterwards (log-sum-exp), as the decode kernel merges its partitions.

#include "kernel.h"
#include "amx.h"

#include <ATen/native/CPUBlas.h>

#include <atomic>
#include <numeric>

namespace attn_di_kernel {
namespace {

namespace blas = at::native::cpublas;

// Keys per tile (the N of S = Q K^T, in panels of kPanel when VNNI-packed, and the K of
// O += P V). Longer tiles mean fewer GEMM calls (each reads and writes its C) per flop; the
// lengths that measured fastest here (docs/benchmarks.md): 128 keys for float32, 256 for
// bfloat16 / float16 on AMX.
template <typename C>
constexpr int64_t kKeyTile = std::is_same_v<C, float> ? 128 : 256;
// Query rows per GEMM (M): S and P of a block stay in L1/L2.
template <typename C>
constexpr int64_t kRowBlock = std::is_same_v<C, float> ? 64 : 128;
// Most query rows per work item (its packed Q and float32 O, ~1 MiB at D = 128): every key
// tile it packs serves them all, so items are as large as the work split allows.
constexpr int64_t kMaxItemRows = 2048;
// Fewest keys in a key range of its own (a split item); below this the merge dominates.
constexpr int64_t kMinKeysPerPart = 512;
// Columns per VNNI-packed panel (oneDNN's packed B takes a leading dimension <= 64).
constexpr int64_t kPanel = 64;
// Rows ahead of use whose memory is prefetched: query rows while packing, output rows while
// writing (each a few hundred bytes, a page apart, which the hardware prefetchers miss).
constexpr int64_t kRowsAhead = 4;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Items run in this process, by their GEMMs (prefill_items()).
std::atomic<int64_t> g_prefill_counts[3] = {0, 0, 0};

// A work item: query tokens [i0, i1) of sequence `seq` (an index into the seqs list), KV head
// g, keys [k_lo, k_hi); part `part` of `parts` key ranges of that (seq, g, i0) group, whose
// partial state lives at row `partial` of the partial buffers when parts > 1.
struct Item {
  int64_t seq, g, i0, i1, k_lo, k_hi, part, parts, partial;
};

// Per-thread buffers, grown as needed and reused across items.
template <typename C>
struct Scratch {
  LineVector<C> q, k_rows, k_plain, k_pack, v_plain, v_pack, p;
  LineVector<uint32_t> k_tiles, v_tiles;  // the tile GEMMs' B operands (Prefill::tiles)
  LineVector<float> o, m, l, s, line, rmax, rescale, shift;
  std::vector<char> started;  // per row block: its O holds a value
  std::vector<char> saw;      // per row: it saw a key of the item (kOnlyNegInfScores)
  int64_t head_size = -1;     // the D the tile buffers are laid out (and zero-padded) for
};

// The largest of n scores (n a multiple of kLanes), NaN left out: a NaN score reaches the
// output through its row's sum (softmax_exp keeps it), so the maximum need not carry it, and
// the reduction is one VMAXPS per vector (which returns its second operand, the running peak,
// where the score is NaN) instead of a NaN-propagating maximum's compare, mask and OR.
inline float tile_max(const float* scores, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 peak = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; j += kLanes) peak = _mm512_max_ps(_mm512_loadu_ps(scores + j), peak);
  return _mm512_reduce_max_ps(peak);
#else
  const auto larger = [](const fVec& peak, const fVec& x) { return fVec::blendv(peak, x, x > peak); };
  fVec peak(kNegInf);
  for (int64_t j = 0; j < n; j += kLanes) peak = larger(peak, fVec::loadu(scores + j));
  return at::vec::vec_reduce_all<float>([&](fVec& a, fVec& b) { return larger(a, b); }, peak);
#endif
}

// Whether bfloat16 / float16 GEMMs run natively (AMX tiles, VNNI-packed B) on this CPU.
template <typename T>
bool native_reduced_gemm() {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    return blas::could_pack(c10::CppTypeToScalarType<T>::value);
  }
}

// `n` values of `src` times `factor` into `dst` (of type C), as float32 arithmetic.
template <typename T, typename C>
inline void scale_into(const T* src, int64_t n, float factor, C* dst, float* line) {
  convert_head<T>(src, n, line);
  int64_t d = 0;
  const fVec f(factor);
  if constexpr (std::is_same_v<C, float>) {
    for (; d + kLanes <= n; d += kLanes) (fVec::loadu(line + d) * f).store(dst + d);
    for (; d < n; ++d) dst[d] = line[d] * factor;
  } else {
    for (; d < n; ++d) dst[d] = static_cast<C>(line[d] * factor);
  }
}

template <typename T, typename C>
struct Prefill {
  const T* query;
  int64_t q_stride0, q_stride1;
  CacheView<T> keys, values;
  const int64_t* table;
  int64_t table_stride;
  T* out;
  int64_t out_stride0, out_stride1;
  Options o;
  bool causal;
  const std::vector<PrefillSeq>* seqs;
  float* partial_o;  // [rows, dv] per partial row
  float* partial_m;
  float* partial_l;
  int64_t dq;  // the K of S = Q K^T: D (float32) or D rounded up to 16 (packed)
  int64_t dv;  // columns of O: as dq
  // bfloat16 GEMMs on AMX tiles written here (amx build, D a multiple of 32; pack_tiles,
  // tile_scores, tile_values) instead of oneDNN's: no per-call lookup, B packed straight into
  // tile order, O accumulated in place.
  bool tiles = false;

  static constexpr bool kPacked = !std::is_same_v<C, float>;
  static constexpr int64_t kKeyTile = attn_di_kernel::kKeyTile<C>;
  static constexpr int64_t kRowBlock = attn_di_kernel::kRowBlock<C>;
  // Granularity of the keys multiplied on the diagonal: whole VNNI panels, or 16 keys (32 on
  // the tile GEMMs, two key groups at a time).
  static constexpr int64_t kWidthStep = kPacked ? kPanel : 16;

  // The row of key position `pos` of sequence `seq` in one plane, at KV head g.
  const T* kv_row(const CacheView<T>& view, int64_t seq, int64_t pos, int64_t g) const {
    return view.row(table[seq * table_stride + pos / o.block_size], pos % o.block_size) +
           g * view.head_stride;
  }

  // Keys [first, last) of query token positions [p_lo, p_hi] that some of them may see.
  void visible_keys(int64_t seq_len, int64_t p_lo, int64_t p_hi, int64_t& first, int64_t& last) const {
    first = 0;
    last = causal ? std::min(seq_len, p_hi + 1) : seq_len;
    if (o.window > 0) {
      first = std::max<int64_t>(0, p_lo - o.window + 1);
      if (!causal) last = std::min(seq_len, p_hi + o.window);
    }
  }

  void run_item(const Item& it, Scratch<C>& sc) const {
    const PrefillSeq& s = (*seqs)[it.seq];
    const int64_t G = o.group;
    const int64_t first_pos = s.seq_len - s.q_len;
    const int64_t rows = (it.i1 - it.i0) * G;
    const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
    prepare(sc, rows, blocks);
    // Row blocks at fixed offsets: each packs its queries before its first tile, keeps its
    // O from then on, and (a whole key range) writes its output rows after its last tile,
    // so reading Q and writing the output overlap the other blocks' GEMMs.
    for (int64_t k0 = it.k_lo; k0 < it.k_hi; k0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, it.k_hi - k0);
      // The query tokens [ta, tb) that see some key of the tile.
      int64_t ta = it.i0, tb = it.i1;
      if (causal) ta = std::max(ta, k0 - first_pos);
      if (o.window > 0) {
        tb = std::min(tb, k0 + n - 1 + o.window - first_pos);
        if (!causal) ta = std::max(ta, k0 - o.window + 1 - first_pos);
      }
      if (ta >= tb) continue;
      pack_tile(sc, s.seq, it.g, k0, n);
      for (int64_t b = (ta - it.i0) * G / kRowBlock; b * kRowBlock < (tb - it.i0) * G; ++b) {
        const int64_t r0 = b * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
        if (!sc.started[b]) pack_queries(sc, s, it, r0, r1);
        block(sc, it, first_pos, k0, n, r0, r1, b);
        if (it.parts == 1 && last_key(s, it, r1) < k0 + n) finish_block(sc, s, it, r0, r1);
      }
    }
    if (it.parts == 1) {  // a block no tile reached (no key visible): zeros, or its sinks' share
      for (int64_t b = 0; b < blocks; ++b)
        if (!sc.started[b]) finish_block(sc, s, it, b * kRowBlock, std::min(rows, (b + 1) * kRowBlock));
      return;
    }
    mark_only_neg_inf(sc, 0, rows);
    const int64_t base = it.partial + it.part * rows;
    for (int64_t r = 0; r < rows; ++r) {  // a block no tile reached keeps m = -inf: O unused
      if (sc.m[r] != kNegInf)
        std::copy(sc.o.data() + r * dv, sc.o.data() + (r + 1) * dv, partial_o + (base + r) * dv);
    }
    std::copy(sc.m.begin(), sc.m.begin() + rows, partial_m + base);
    std::copy(sc.l.begin(), sc.l.begin() + rows, partial_l + base);
  }

  // The last key position that rows [.., r1) of the item may see (in its key range).
  int64_t last_key(const PrefillSeq& s, const Item& it, int64_t r1) const {
    const int64_t p_hi = s.seq_len - s.q_len + it.i0 + (r1 - 1) / o.group;
    int64_t last = it.k_hi - 1;
    if (causal) last = std::min(last, p_hi);
    else if (o.window > 0) last = std::min(last, p_hi + o.window - 1);
    return last;
  }

  // Packed, scaled query rows [r0, r1) of the item ([rows, dq], zero past D).
  void pack_queries(Scratch<C>& sc, const PrefillSeq& s, const Item& it, int64_t r0, int64_t r1) const {
    const int64_t G = o.group, D = o.head_size;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = it.i0 + r / G, h = it.g * G + r % G;
      if (r % G == 0 && r + kRowsAhead * G < r1)  // the G heads of a later token, one span
        prefetch_lines(query + (s.first_query + i + kRowsAhead) * q_stride0 + it.g * G * q_stride1,
                       ((G - 1) * q_stride1 + D) * static_cast<int64_t>(sizeof(T)));
      C* dst = sc.q.data() + r * dq;
      scale_into<T, C>(query + (s.first_query + i) * q_stride0 + h * q_stride1, D, o.scale, dst,
                       sc.line.data());
      std::fill(dst + D, dst + dq, C(0.f));
    }
  }

  // Rows [r0, r1) that saw keys whose scores were all -inf (an infinite key or query) get the
  // sum kOnlyNegInfScores (a row that also saw a NaN score keeps its NaN sum: tile_max leaves
  // NaN out of m): merge_partials writes NaN for them where no other key range or
  // sink has a finite score, as the reference's softmax (-inf - (-inf)) does.
  void mark_only_neg_inf(Scratch<C>& sc, int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < r1; ++r)
      if (sc.saw[r] && sc.m[r] == kNegInf && sc.l[r] == 0.f) sc.l[r] = kOnlyNegInfScores;
  }

  // Output rows [r0, r1) of a whole-range item from its running state.
  void finish_block(Scratch<C>& sc, const PrefillSeq& s, const Item& it, int64_t r0, int64_t r1) const {
    const int64_t G = o.group;
    mark_only_neg_inf(sc, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      if (r % G == 0 && r + kRowsAhead * G < r1) prefetch_out(s, it, r / G + kRowsAhead);
      const float* acc = sc.o.data() + r * dv;
      finish_row(s, it, r, &sc.m[r], &sc.l[r], &acc, 1);
    }
  }

  // The output rows of the item's query token i0 + i (its G heads), ahead of their writes
  // (always inlined, as kernel.h's prefetch helpers: else GCC deletes the calls).
  ATTN_DI_PREFETCH_HELPER void prefetch_out(const PrefillSeq& s, const Item& it, int64_t i) const {
    prefetch_lines<64, 3, true>(out + (s.first_query + it.i0 + i) * out_stride0 + it.g * o.group * out_stride1,
                         ((o.group - 1) * out_stride1 + o.head_size) * static_cast<int64_t>(sizeof(T)));
  }

  // Size the buffers for an item of `rows` query rows. The tile buffers' padding (past D,
  // past a partial tile's keys) is zeroed where it is written, never read as cache memory.
  void prepare(Scratch<C>& sc, int64_t rows, int64_t blocks) const {
    const int64_t D = o.head_size;
    sc.line.resize(std::max(D, kKeyTile));
    // Rows padded to 32 for the tile GEMMs (two row tiles at a time; the padding rows are
    // multiplied, never read back).
    const int64_t padded = round_up(rows, 32);
    sc.q.resize(padded * dq);
    sc.o.resize(padded * dv);  // each row block's O is written by its first tile (add_C off)
    sc.m.assign(rows, kNegInf);
    sc.l.assign(rows, 0.f);
    sc.started.assign(blocks, 0);
    sc.saw.assign(rows, 0);
    sc.s.resize(kRowBlock * kKeyTile);
    sc.rmax.resize(kRowBlock);
    sc.rescale.resize(kRowBlock);
    sc.shift.resize(kRowBlock);
    if (sc.head_size != D || sc.k_plain.size() != static_cast<size_t>(dq * kKeyTile)) {
      // the padding past D is zero for this head size and tile (kept across calls)
      sc.head_size = D;
      sc.k_rows.assign(kKeyTile * D, C(0.f));
      sc.k_plain.assign(dq * kKeyTile, C(0.f));
      sc.v_plain.assign(kKeyTile * dv, C(0.f));
    }
    if constexpr (kPacked) {
      sc.p.resize(kRowBlock * kKeyTile);
      if (tiles) {
        sc.k_tiles.resize(kKeyTile * dq / 2);
        sc.v_tiles.resize(kKeyTile * dv / 2);
      } else {
        sc.k_pack.resize(dq * kKeyTile);
        sc.v_pack.resize(kKeyTile * dv);
      }
    }
  }

  // K^T of keys [k0, k0 + n) as the B of S ([dq, kKeyTile]) and V as the B of O += P V
  // ([kKeyTile, dv]), zero past n keys and past D, VNNI-packed for reduced GEMMs.
  void pack_tile(Scratch<C>& sc, int64_t seq, int64_t g, int64_t k0, int64_t n) const {
    const int64_t D = o.head_size;
    C* kr = sc.k_rows.data();  // [kKeyTile, D]: the tile's key rows, gathered
    C* kp = sc.k_plain.data();
    C* vp = sc.v_plain.data();
    if (n < kKeyTile) {  // a partial tile: zero what an earlier tile left past its keys
      std::fill(kr + n * D, kr + kKeyTile * D, C(0.f));
      std::fill(vp + n * dv, vp + kKeyTile * dv, C(0.f));
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* k = kv_row(keys, seq, k0 + j, g);
      const T* v = kv_row(values, seq, k0 + j, g);
      if constexpr (std::is_same_v<C, T>) {
        std::copy(k, k + D, kr + j * D);
        std::copy(v, v + D, vp + j * dv);
      } else {  // float32 GEMMs on a reduced-precision cache
        convert_head<T>(k, D, kr + j * D);
        convert_head<T>(v, D, vp + j * dv);
      }
    }
#if defined(ATTN_DI_AMX)
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      if (tiles) {
        pack_tiles(sc);
        return;
      }
    }
#endif
    transpose(kr, kp);
    if constexpr (kPacked) {
      const auto dtype = c10::CppTypeToScalarType<C>::value;
      for (int64_t c = 0; c < kKeyTile; c += kPanel)
        blas::pack(dq, kPanel, kKeyTile, kPanel, dtype, dtype, kp + c, sc.k_pack.data() + c * dq);
      for (int64_t c = 0; c < dv; c += kPanel) {
        const int64_t width = std::min(kPanel, dv - c);
        blas::pack(kKeyTile, width, dv, width, dtype, dtype, vp + c, sc.v_pack.data() + c * kKeyTile);
      }
    }
  }

#if defined(ATTN_DI_AMX)
  // The tile's B operands for tile_scores and tile_values, from its gathered key and value
  // rows (zeros past its keys; D a multiple of 32):
  //  - k_tiles[((n * D/32 + kc) * 16 + pr) * 16 + j]: the pair (k[2pr], k[2pr + 1]) of values
  //    kc * 32 .. of key 16n + j (K^T in VNNI pairs): a 16 x 16 transpose of 32-bit words per
  //    16 keys and 32 values;
  //  - v_tiles[((kk * dv/16 + nd) * 16 + i) * 16 + c]: the pair (v_{32kk + 2i}[16nd + c],
  //    v_{32kk + 2i + 1}[16nd + c]): two value rows interleaved per 32 values (VPUNPCKLWD /
  //    VPUNPCKHWD, then the lanes put in column order).
  void pack_tiles(Scratch<C>& sc) const {
    const int64_t D = o.head_size, chunks = D / 32, groups = dv / 16;
    const C* kr = sc.k_rows.data();
    const C* vp = sc.v_plain.data();
    uint32_t* kt = sc.k_tiles.data();
    uint32_t* vt = sc.v_tiles.data();
    for (int64_t n = 0; n < kKeyTile / 16; ++n)
      for (int64_t kc = 0; kc < chunks; ++kc) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kr + (n * 16 + j) * D + kc * 32);
        transpose_16x16(r);
        uint32_t* dst = kt + (n * chunks + kc) * 256;
        for (int64_t pr = 0; pr < 16; ++pr) _mm512_storeu_si512(dst + pr * 16, r[pr]);
      }
    __m512i first, second;
    unpack_order(first, second);
    for (int64_t kk = 0; kk < kKeyTile / 32; ++kk)
      for (int64_t i = 0; i < 16; ++i) {
        const C* r0 = vp + (kk * 32 + 2 * i) * dv;
        const C* r1 = r0 + dv;
        for (int64_t d = 0; d < dv; d += 32) {
          const __m512i a = _mm512_loadu_si512(r0 + d), b = _mm512_loadu_si512(r1 + d);
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
          uint32_t* dst = vt + ((kk * groups + d / 16) * 16 + i) * 16;
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(lo, first, hi));
          _mm512_storeu_si512(dst + 256, _mm512_permutex2var_epi32(lo, second, hi));
        }
      }
  }

  // S[0 .. Mp, 0 .. width) = Q K^T for the padded rows Mp (a multiple of 32) from row r0 and
  // `width` keys (a multiple of 32): per 32 rows x 32 keys, C tiles 0-3 = A (tiles 4, 5: two
  // row tiles of Q) x B (tiles 6, 7: two key groups of k_tiles), over D in chunks of 32.
  void tile_scores(const Scratch<C>& sc, int64_t r0, int64_t Mp, int64_t width, float* S) const {
    const int64_t chunks = o.head_size / 32;
    const C* q = sc.q.data() + r0 * dq;
    const uint32_t* kt = sc.k_tiles.data();
    const int64_t a_stride = dq * 2, s_stride = kKeyTile * 4;
    for (int64_t i = 0; i < Mp; i += 32)
      for (int64_t n = 0; n < width; n += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < chunks; ++kc) {
          _tile_loadd(4, q + i * dq + kc * 32, a_stride);
          _tile_loadd(5, q + (i + 16) * dq + kc * 32, a_stride);
          _tile_loadd(6, kt + ((n / 16) * chunks + kc) * 256, 64);
          _tile_loadd(7, kt + ((n / 16 + 1) * chunks + kc) * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* out = S + i * kKeyTile + n;
        _tile_stored(0, out, s_stride);
        _tile_stored(1, out + 16, s_stride);
        _tile_stored(2, out + 16 * kKeyTile, s_stride);
        _tile_stored(3, out + 16 * kKeyTile + 16, s_stride);
      }
  }

  // O[0 .. Mp) (+)= P V over `width` keys (a multiple of 32): per 32 rows x 32 columns of O,
  // C tiles 0-3 loaded from O (or zeroed), A = P (tiles 4, 5), B = v_tiles (6, 7), stored back.
  void tile_values(const Scratch<C>& sc, int64_t Mp, int64_t width, bool add, float* O) const {
    const int64_t groups = dv / 16;
    const C* p = sc.p.data();
    const uint32_t* vt = sc.v_tiles.data();
    const int64_t a_stride = kKeyTile * 2, o_stride = dv * 4;
    for (int64_t i = 0; i < Mp; i += 32)
      for (int64_t nd = 0; nd < groups; nd += 2) {
        float* out = O + i * dv + nd * 16;
        if (add) {
          _tile_loadd(0, out, o_stride);
          _tile_loadd(1, out + 16, o_stride);
          _tile_loadd(2, out + 16 * dv, o_stride);
          _tile_loadd(3, out + 16 * dv + 16, o_stride);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kk = 0; kk < width / 32; ++kk) {
          _tile_loadd(4, p + i * kKeyTile + kk * 32, a_stride);
          _tile_loadd(5, p + (i + 16) * kKeyTile + kk * 32, a_stride);
          _tile_loadd(6, vt + (kk * groups + nd) * 256, 64);
          _tile_loadd(7, vt + (kk * groups + nd + 1) * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out, o_stride);
        _tile_stored(1, out + 16, o_stride);
        _tile_stored(2, out + 16 * dv, o_stride);
        _tile_stored(3, out + 16 * dv + 16, o_stride);
      }
  }
#endif

  // kp[d, j] = kr[j, d] for the tile's kKeyTile key rows of D values (rows past D stay 0).
  void transpose(const C* kr, C* kp) const {
    const int64_t D = o.head_size;
    if constexpr (std::is_same_v<C, float>) {
      at::vec::transpose_mxn<float>(kr, D, kp, kKeyTile, kKeyTile, static_cast<int>(D));
    } else {  // ATen's reduced-precision transposes take blocks of at most 32 x 32
      for (int64_t j = 0; j < kKeyTile; j += 32)
        for (int64_t d = 0; d < D; d += 32)
          at::vec::transpose_mxn<C>(kr + j * D + d, D, kp + d * kKeyTile + j, kKeyTile, 32,
                                    static_cast<int>(std::min<int64_t>(32, D - d)));
    }
  }

  // Whether every row of [r0, r1) sees every key of [k0, k0 + width): no score to mask.
  bool unmasked(int64_t first_pos, const Item& it, int64_t k0, int64_t n, int64_t width, int64_t r0,
                int64_t r1) const {
    if (n < width) return false;
    const int64_t p_lo = first_pos + it.i0 + r0 / o.group, p_hi = first_pos + it.i0 + (r1 - 1) / o.group;
    if (causal && k0 + width - 1 > p_lo) return false;
    if (o.window > 0) {
      if (k0 <= p_hi - o.window) return false;
      if (!causal && k0 + width - 1 >= p_lo + o.window) return false;
    }
    return true;
  }

  // Query rows [r0, r1) (row block b) of the item against keys [k0, k0 + n): S, the softmax
  // update, O += P V.
  void block(Scratch<C>& sc, const Item& it, int64_t first_pos, int64_t k0, int64_t n, int64_t r0,
             int64_t r1, int64_t b) const {
    const int64_t G = o.group, M = r1 - r0;
    // The keys any row of the block may see, in whole panels: past the causal diagonal of the
    // block's last row, the tile is neither multiplied nor weighed.
    int64_t width = std::min(n, causal ? first_pos + it.i0 + (r1 - 1) / G - k0 + 1 : n);
    width = std::min(kKeyTile, round_up(width, tiles ? 32 : kWidthStep));  // tiles: 32 keys a step
    float* S = sc.s.data();
    if (tiles) {
#if defined(ATTN_DI_AMX)
      if constexpr (std::is_same_v<C, c10::BFloat16>) tile_scores(sc, r0, round_up(M, 32), width, S);
#endif
    } else if constexpr (kPacked) {
      for (int64_t c = 0; c < width; c += kPanel)
        blas::brgemm(M, kPanel, dq, dq, kPanel, kKeyTile, false, sc.q.data() + r0 * dq,
                     sc.k_pack.data() + c * dq, S + c, true);
    } else {
      blas::brgemm(M, width, dq, dq, kKeyTile, kKeyTile, false, sc.q.data() + r0 * dq,
                   sc.k_plain.data(), S, false);
    }
    // Pass 1: score modifiers, mask, each row's largest score.
    const bool plain = unmasked(first_pos, it, k0, n, width, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      float* sr = S + (r - r0) * kKeyTile;
      if (o.soft_cap > 0.f) {
        const fVec cap(o.soft_cap), inv(1.f / o.soft_cap);
        for (int64_t j = 0; j < width; j += kLanes) (cap * (fVec::loadu(sr + j) * inv).tanh()).store(sr + j);
      }
      if (!plain || o.alibi != nullptr) {
        const int64_t pos = first_pos + it.i0 + r / G;
        int64_t j_lo = 0, j_hi = n;  // the keys of the tile this row sees
        if (causal) j_hi = std::min(j_hi, pos - k0 + 1);
        if (o.window > 0) {
          j_lo = std::max<int64_t>(j_lo, pos - o.window + 1 - k0);
          if (!causal) j_hi = std::min(j_hi, pos + o.window - k0);
        }
        j_lo = std::clamp<int64_t>(j_lo, 0, width);
        j_hi = std::clamp<int64_t>(j_hi, j_lo, width);
        if (o.alibi != nullptr) {
          const float slope = o.alibi[it.g * G + r % G];
          for (int64_t j = j_lo; j < j_hi; ++j) sr[j] += slope * static_cast<float>(k0 + j - pos);
        }
        std::fill(sr, sr + j_lo, kNegInf);
        std::fill(sr + j_hi, sr + width, kNegInf);
        if (j_lo < j_hi) sc.saw[r] = 1;
      } else {
        sc.saw[r] = 1;  // every key of the tile
      }
      sc.rmax[r - r0] = tile_max(sr, width);
    }
    // Pass 2, across rows: the new running maxima, the rescale of what each row holds, the
    // shift of its exponentials (0 for a row that has seen nothing, whose scores are -inf).
    const fVec neg_inf(kNegInf), one(1.f), zero(0.f);
    for (int64_t r = 0; r < M; r += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, M - r);
      const fVec old_peak = fVec::loadu(sc.m.data() + r0 + r, count);
      const fVec peak = at::vec::maximum(old_peak, fVec::loadu(sc.rmax.data() + r, count));
      fVec::blendv((old_peak - peak).exp_u20(), one, old_peak == neg_inf).store(sc.rescale.data() + r, count);
      fVec::blendv(peak, zero, peak == neg_inf).store(sc.shift.data() + r, count);
      peak.store(sc.m.data() + r0 + r, count);
    }
    // Pass 3: P = exp(S - shift), the running sums, O rescaled.
    const bool started = sc.started[b] != 0;
    for (int64_t r = r0; r < r1; ++r) {
      float* sr = S + (r - r0) * kKeyTile;
      const fVec shift(sc.shift[r - r0]);
      fVec total(0.f);
      if constexpr (kPacked) {  // P straight from the exponentials (width: whole panels)
        C* pr = sc.p.data() + (r - r0) * kKeyTile;
        for (int64_t j = 0; j < width; j += 2 * kLanes) {
          const fVec e0 = softmax_exp(fVec::loadu(sr + j) - shift);
          const fVec e1 = softmax_exp(fVec::loadu(sr + j + kLanes) - shift);
          total = total + e0 + e1;
#if defined(ATTN_DI_AVX512_BF16)
          // one VCVTNE2PS2BF16 (round to nearest even, as ATen's ~10-instruction conversion;
          // it reads denormals as 0, and softmax_exp gives none)
          if constexpr (std::is_same_v<C, c10::BFloat16>) {
            _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            continue;
          }
#endif
          at::vec::convert_from_float<C>(e0, e1).store(pr + j);
        }
      } else {  // P is S itself
        for (int64_t j = 0; j < width; j += kLanes) {
          const fVec e = softmax_exp(fVec::loadu(sr + j) - shift);
          e.store(sr + j);
          total = total + e;
        }
      }
      const float rescale = sc.rescale[r - r0];
      sc.l[r] = sc.l[r] * rescale + at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, total);
      if (started && rescale != 1.f) {
        float* acc = sc.o.data() + r * dv;
        const fVec f(rescale);
        for (int64_t d = 0; d < dv; d += kLanes) {
          const int64_t count = std::min<int64_t>(kLanes, dv - d);
          (fVec::loadu(acc + d, count) * f).store(acc + d, count);
        }
      }
    }
    float* O = sc.o.data() + r0 * dv;
    if (tiles) {
#if defined(ATTN_DI_AMX)
      if constexpr (std::is_same_v<C, c10::BFloat16>) tile_values(sc, round_up(M, 32), width, started, O);
#endif
    } else if constexpr (kPacked) {
      for (int64_t c = 0; c < dv; c += kPanel) {
        const int64_t panel = std::min(kPanel, dv - c);
        blas::brgemm(M, panel, width, kKeyTile, panel, dv, started, sc.p.data(),
                     sc.v_pack.data() + c * kKeyTile, O + c, true);
      }
    } else {  // P is S itself, exponentiated in place
      blas::brgemm(M, dv, width, kKeyTile, dv, dv, started, S, sc.v_plain.data(), O, false);
    }
    sc.started[b] = 1;
  }

  // One output row from its key ranges' partial results (merge_partials).
  void finish_row(const PrefillSeq& s, const Item& it, int64_t r, const float* maxes,
                  const float* sums, const float* const* accs, int64_t parts) const {
    const int64_t G = o.group;
    const int64_t i = it.i0 + r / G, h = it.g * G + r % G;
    T* dst = out + (s.first_query + i) * out_stride0 + h * out_stride1;
    merge_partials(dst, o.head_size, o.sinks != nullptr ? o.sinks[h] : kNegInf, maxes, sums,
                   accs, parts);
  }

  // Merge the key ranges of the group whose first part is `it` and write its output rows.
  void merge(const Item& it) const {
    const PrefillSeq& s = (*seqs)[it.seq];
    const int64_t rows = (it.i1 - it.i0) * o.group;
    std::vector<float> maxes(it.parts), sums(it.parts);
    std::vector<const float*> accs(it.parts);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t part = 0; part < it.parts; ++part) {
        const int64_t at = it.partial + part * rows + r;
        maxes[part] = partial_m[at];
        sums[part] = partial_l[at];
        accs[part] = partial_o + at * dv;
      }
      finish_row(s, it, r, maxes.data(), sums.data(), accs.data(), it.parts);
    }
  }
};

template <typename T, typename C>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const int64_t* table, int64_t table_stride, at::Tensor& out, const Options& o,
         bool causal, const std::vector<PrefillSeq>& seqs) {
  constexpr bool packed = !std::is_same_v<C, float>;
  const int64_t G = o.group, D = o.head_size;
  Prefill<T, C> kernel{query.const_data_ptr<T>(), query.stride(0), query.stride(1),
                       cache_view<T>(key_cache), cache_view<T>(value_cache), table, table_stride,
                       out.mutable_data_ptr<T>(), out.stride(0), out.stride(1), o, causal, &seqs,
                       nullptr, nullptr, nullptr, packed ? round_up(D, 16) : D,
                       packed ? round_up(D, 16) : D};
#if defined(ATTN_DI_AMX)
  if constexpr (std::is_same_v<C, c10::BFloat16>) kernel.tiles = D % 32 == 0 && amx_state().usable;
#endif
  // Groups: (sequence, KV head, chunk of query tokens), with the keys their queries see. A
  // chunk is as long as the work split allows (each key tile is packed once per group), and
  // short enough that there are several groups per thread where the batch has them.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t wanted = 4 * threads;
  const int64_t pairs = static_cast<int64_t>(seqs.size()) * o.kv_heads;
  const int64_t chunks_per_pair = (wanted + pairs - 1) / pairs;
  std::vector<Item> groups;
  int64_t work = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const PrefillSeq& s = seqs[b];
    const int64_t first_pos = s.seq_len - s.q_len;
    int64_t chunk = (s.q_len + chunks_per_pair - 1) / chunks_per_pair;
    chunk = std::clamp<int64_t>(chunk, (kRowBlock<C> + G - 1) / G, std::max<int64_t>(1, kMaxItemRows / G));
    for (int64_t g = 0; g < o.kv_heads; ++g)
      for (int64_t i0 = 0; i0 < s.q_len; i0 += chunk) {
        const int64_t i1 = std::min(s.q_len, i0 + chunk);
        int64_t lo, hi;
        kernel.visible_keys(s.seq_len, first_pos + i0, first_pos + i1 - 1, lo, hi);
        groups.push_back({b, g, i0, i1, lo, std::max(lo, hi), 0, 1, 0});
        work += (std::max(lo, hi) - lo) * (i1 - i0);
      }
  }
  // Split key ranges where there are too few groups to keep every thread busy.
  std::vector<Item> items;
  int64_t partial_rows = 0;
  for (const Item& group : groups) {
    const int64_t keys = group.k_hi - group.k_lo;
    int64_t parts = 1;
    if (static_cast<int64_t>(groups.size()) < wanted && work > 0) {
      const int64_t share = keys * (group.i1 - group.i0) * wanted / work;  // items it deserves
      parts = std::clamp<int64_t>(share, 1, std::max<int64_t>(1, keys / kMinKeysPerPart));
    }
    const int64_t step = round_up((keys + parts - 1) / parts, kKeyTile<C>);
    parts = std::max<int64_t>(1, (keys + step - 1) / step);
    const int64_t rows = (group.i1 - group.i0) * G;
    for (int64_t part = 0; part < parts; ++part) {
      Item item = group;
      item.k_lo = group.k_lo + part * step;
      item.k_hi = std::min(group.k_hi, item.k_lo + step);
      item.part = part;
      item.parts = parts;
      item.partial = partial_rows;
      items.push_back(item);
    }
    if (parts > 1) partial_rows += parts * rows;
  }
  LineVector<float> partial_o(partial_rows * kernel.dv), partial_m(partial_rows),
      partial_l(partial_rows);
  kernel.partial_o = partial_o.data();
  kernel.partial_m = partial_m.data();
  kernel.partial_l = partial_l.data();
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return (items[a].k_hi - items[a].k_lo) * (items[a].i1 - items[a].i0) >
           (items[b].k_hi - items[b].k_lo) * (items[b].i1 - items[b].i0);
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min(threads, num_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch<C> scratch;  // kept by each thread of the pool across calls
#if defined(ATTN_DI_AMX)
    if (kernel.tiles) configure_tiles();  // every tile 16 rows of 64 bytes, for this call
#endif
    const int path = kernel.tiles ? 0 : packed ? 1 : 2;
    for (int64_t at = next.fetch_add(1); at < num_items; at = next.fetch_add(1)) {
      kernel.run_item(items[order[at]], scratch);
      g_prefill_counts[path].fetch_add(1, std::memory_order_relaxed);
    }
#if defined(ATTN_DI_AMX)
    if (kernel.tiles) {
      _tile_release();
      return;
    }
#endif
    if constexpr (packed) blas::brgemm_release(true);
  });
  std::vector<int64_t> merged;
  for (int64_t i = 0; i < num_items; ++i)
    if (items[i].parts > 1 && items[i].part == 0) merged.push_back(i);
  // Merging is light (rows x partitions x D): a few sequences merge on this thread, without
  // waking the pool again.
  at::parallel_for(0, static_cast<int64_t>(merged.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) kernel.merge(items[merged[m]]);
  });
}

template <typename T>
void dispatch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const int64_t* table, int64_t table_stride, at::Tensor& out, const Options& o,
              bool causal, const std::vector<PrefillSeq>& seqs) {
  if constexpr (!std::is_same_v<T, float>) {
    if (native_reduced_gemm<T>()) {
      run<T, T>(query, key_cache, value_cache, table, table_stride, out, o, causal, seqs);
      return;
    }
  }
  run<T, float>(query, key_cache, value_cache, table, table_stride, out, o, causal, seqs);
}

}  // namespace

void run_prefill(const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const int64_t* table, int64_t table_stride,
                 at::Tensor& out, const Options& o, bool causal,
                 const std::vector<PrefillSeq>& seqs) {
  if (seqs.empty()) return;
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      dispatch<float>(query, key_cache, value_cache, table, table_stride, out, o, causal, seqs);
      break;
    case at::kBFloat16:
      dispatch<c10::BFloat16>(query, key_cache, value_cache, table, table_stride, out, o, causal, seqs);
      break;
    case at::kHalf:
      dispatch<c10::Half>(query, key_cache, value_cache, table, table_stride, out, o, causal, seqs);
      break;
    default:
      TORCH_CHECK(false, "attn_di paged_attention: unsupported dtype ", key_cache.scalar_type());
  }
}

bool native_bf16_gemm() { return native_reduced_gemm<c10::BFloat16>(); }

std::vector<int64_t> prefill_items() { return load_counts(g_prefill_counts); }

}  // namespace attn_di_kernel
