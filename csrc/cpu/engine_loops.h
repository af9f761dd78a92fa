// The CPU engine's loops, written once. Included (with no include guard) by each of
// engine_baseline.cpp, engine_avx2.cpp and engine_avx512.cpp after their target is set,
// inside namespace lossagg::cpu::LOSSAGG_ISA; LOSSAGG_ISA_LEVEL is 0, 1 (AVX2) or 2
// (AVX-512). Each unit defines its table `kEngine` (engine.h).
//
// Every build adds in the same order (the order is a function of the input only), and no
// build fuses a multiply and an add (-ffp-contract=off in CMakeLists.txt: the AVX-512
// target has FMA, and a fused multiply-add rounds once where the others round twice).
//
// This file includes nothing: engine_deps.h, included before the target is set, brings
// every header, so their inline functions stay baseline code.

namespace lossagg::cpu::LOSSAGG_ISA {
namespace {

constexpr int kBlock = 64;  // tokens converted per step
constexpr int kLanes = 32;  // independent accumulators (two AVX-512 or four AVX2 registers)

// Masked sum of v[lo, hi), hi - lo >= kBlock. Tokens are converted a block at a time
// into a small buffer (a loop without a reduction, which vectorises), then added into
// kLanes fixed lanes: lane l takes tokens lo+l, lo+l+kLanes, ...; the tail goes to lane 0;
// lanes are combined in a fixed order. The order depends only on (lo, hi).
template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum_lanes(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  acc_t lane[kLanes] = {};
  int64_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    acc_t t[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      t[j] = masked_term(static_cast<acc_t>(v[i + j]), m[i + j]);
    }
    for (int j = 0; j < kBlock; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lane[l] += t[j + l];
      }
    }
  }
  for (; i < hi; ++i) {
    lane[0] += masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      lane[l] += lane[l + width];
    }
  }
  return lane[0];
}

#if LOSSAGG_ISA_LEVEL >= 1
// float32 values with a bool or float32 mask, the usual case, written with intrinsics: the
// same lanes, block order, tail and combine as masked_sum_lanes, so the same bits. Lanes
// 0..31 live in four 8-float registers (AVX2) or two 16-float ones (AVX-512); lane l
// takes tokens lo+l, lo+l+32, ... as there.
static_assert(kLanes == 32 && kBlock == 64, "the float32 paths hard-code 32 lanes and 64-token blocks");

// The lanes combined pairwise (l with l + 16, then l + 8, 4, 2, 1), lane 0 of a0 replaced by
// l0 (the lane with the tail added).
inline float combine_lanes_f32(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float l0) {
  a0 = _mm256_blend_ps(a0, _mm256_castps128_ps256(_mm_set_ss(l0)), 1);
  const __m256 w16a = _mm256_add_ps(a0, a2);  // lanes 0..7 (+ 16..23)
  const __m256 w16b = _mm256_add_ps(a1, a3);  // lanes 8..15 (+ 24..31)
  const __m256 w8 = _mm256_add_ps(w16a, w16b);
  const __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
  const __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
  const __m128 w1 = _mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1));
  return _mm_cvtss_f32(w1);
}

// The end of masked_sum_lanes from lanes 0..7, 8..15, 16..23, 24..31: the tail tokens
// [i, hi) added to lane 0 in token order, then the lanes combined. The tail's terms are
// computed first, independently, so that what must be sequential is one addition per token;
// the combine stays in registers.
template <typename mask_t>
inline float finish_lanes_f32(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* v, const mask_t* m, int64_t i, int64_t hi) {
  const int n = static_cast<int>(hi - i);
  float t[kBlock];
  for (int j = 0; j < n; ++j) {
    t[j] = masked_term(v[i + j], m[i + j]);
  }
  float l0 = _mm256_cvtss_f32(a0);
  for (int j = 0; j < n; ++j) {
    l0 += t[j];
  }
  return combine_lanes_f32(a0, a1, a2, a3, l0);
}

template <typename mask_t>
inline __m256 keep_f32_avx2(const float* v, const mask_t* m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    const __m256i keep = _mm256_cmpgt_epi32(bytes, _mm256_setzero_si256());  // bytes are 0..255: non-zero is > 0
    return _mm256_and_ps(_mm256_loadu_ps(v), _mm256_castsi256_ps(keep));
  } else {
    const __m256 w = _mm256_loadu_ps(m);
    const __m256 keep = _mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_NEQ_UQ);  // w != 0, true for NaN as in select_if
    return _mm256_mul_ps(_mm256_and_ps(_mm256_loadu_ps(v), keep), w);
  }
}

template <typename mask_t>
float masked_sum_f32_avx2(const float* v, const mask_t* m, int64_t lo, int64_t hi) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int64_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    acc0 = _mm256_add_ps(acc0, keep_f32_avx2(v + i, m + i));
    acc1 = _mm256_add_ps(acc1, keep_f32_avx2(v + i + 8, m + i + 8));
    acc2 = _mm256_add_ps(acc2, keep_f32_avx2(v + i + 16, m + i + 16));
    acc3 = _mm256_add_ps(acc3, keep_f32_avx2(v + i + 24, m + i + 24));
    acc0 = _mm256_add_ps(acc0, keep_f32_avx2(v + i + 32, m + i + 32));
    acc1 = _mm256_add_ps(acc1, keep_f32_avx2(v + i + 40, m + i + 40));
    acc2 = _mm256_add_ps(acc2, keep_f32_avx2(v + i + 48, m + i + 48));
    acc3 = _mm256_add_ps(acc3, keep_f32_avx2(v + i + 56, m + i + 56));
  }
  return finish_lanes_f32(acc0, acc1, acc2, acc3, v, m, i, hi);
}
#endif

#if LOSSAGG_ISA_LEVEL >= 2
// The same sum with AVX-512: a 16-token mask of kept tokens (a byte compare for a bool
// mask, w != 0 for a float32 one) drives a zeroing masked load, which is the select of
// masked_term in one instruction (masked-out tokens read as +0.0, never their value). Lanes
// 0..15 and 16..31 are two registers; the additions are those of masked_sum_lanes. With
// kCount, *kept receives the kept tokens, counted from the same compare masks.
// Lanes 8..15 of a 16-float register (AVX-512F has no float32 extract of 256 bits).
inline __m256 high_half(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }

// The cache lines of [p + kPrefetchTokens, + bytes) asked for ahead of their use (a hint: it
// never faults, the address is not dereferenced). Each block asks for the lines it will read
// kPrefetchTokens tokens later: segments are short streams (an RL sample is a few KiB), which
// the hardware's stream detectors pick up late, and one long segment's sum is a chain of
// additions that keeps few loads in flight; either way the next lines would arrive late.
// Measured on the benchmark's batches (docs/benchmarks.md); at 1024 tokens the values are
// 4 KiB ahead.
constexpr int64_t kPrefetchTokens = 1024;

template <typename T>
inline void prefetch_ahead(const T* p, int bytes) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + kPrefetchTokens * sizeof(T);
  for (int b = 0; b < bytes; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
  }
}

// One block of 64 tokens at v + i into acc0 (tokens 0..15 and 32..47) and acc1 (16..31 and
// 48..63), in that order; returns its kept tokens when kCount.
template <bool kCount, typename mask_t>
inline int64_t masked_block_f32_avx512(const float* v, const mask_t* m, int64_t i, __m512& acc0, __m512& acc1) {
  __m512 x[4];
  int64_t n = 0;
  if constexpr (is_binary_mask_v<mask_t>) {
    prefetch_ahead(v + i, 4 * kBlock);
    prefetch_ahead(m + i, kBlock);
    const __m512i bytes = _mm512_loadu_si512(m + i);
    const uint64_t keep = _mm512_test_epi8_mask(bytes, bytes);
    for (int q = 0; q < 4; ++q) {
      x[q] = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> (16 * q)), v + i + 16 * q);
    }
    if constexpr (kCount) {
      n = _mm_popcnt_u64(keep);
    }
  } else {
    for (int q = 0; q < 4; ++q) {
      const __m512 w = _mm512_loadu_ps(m + i + 16 * q);
      const __mmask16 keep = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // w != 0, true for NaN
      x[q] = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, v + i + 16 * q), w);
      if constexpr (kCount) {
        n += _mm_popcnt_u32(keep);
      }
    }
  }
  acc0 = _mm512_add_ps(acc0, x[0]);
  acc1 = _mm512_add_ps(acc1, x[1]);
  acc0 = _mm512_add_ps(acc0, x[2]);
  acc1 = _mm512_add_ps(acc1, x[3]);
  return n;
}

// The kept tokens of the tail m[i, hi) (fewer than kBlock).
template <typename mask_t>
inline int64_t tail_kept_avx512(const mask_t* m, int64_t i, int64_t hi) {
  if constexpr (is_binary_mask_v<mask_t>) {  // one masked load and compare
    const __mmask64 tail = _cvtu64_mask64((hi - i) >= 64 ? ~uint64_t{0} : (uint64_t{1} << (hi - i)) - 1);
    const __m512i bytes = _mm512_maskz_loadu_epi8(tail, m + i);
    return _mm_popcnt_u64(_mm512_test_epi8_mask(bytes, bytes));
  } else {
    int64_t n = 0;
    for (int64_t j = i; j < hi; ++j) {
      n += is_kept(m[j]);
    }
    return n;
  }
}

template <bool kCount, typename mask_t>
float masked_sum_f32_avx512(const float* v, const mask_t* m, int64_t lo, int64_t hi, int64_t* kept) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t n = 0;
  int64_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    n += masked_block_f32_avx512<kCount>(v, m, i, acc0, acc1);
  }
  if constexpr (kCount) {
    *kept = n + tail_kept_avx512(m, i, hi);
  }
  return finish_lanes_f32(_mm512_castps512_ps256(acc0), high_half(acc0), _mm512_castps512_ps256(acc1), high_half(acc1), v, m, i, hi);
}

// The masked terms of the tail v[i, hi) (fewer than kBlock tokens) into t[0, kBlock), +0.0
// past it: masked_term's values (a zeroing masked load where the mask is non-zero, times the
// weight for a float mask).
template <typename mask_t>
inline void tail_terms_f32_avx512(const float* v, const mask_t* m, int64_t i, int64_t hi, float* t) {
  const int64_t n = hi - i;
  const uint64_t in_tail = n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  if constexpr (is_binary_mask_v<mask_t>) {
    const __m512i bytes = _mm512_maskz_loadu_epi8(_cvtu64_mask64(in_tail), m + i);
    const uint64_t keep = _mm512_test_epi8_mask(bytes, bytes);
    for (int q = 0; q < 4; ++q) {
      _mm512_storeu_ps(t + 16 * q, _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> (16 * q)), v + i + 16 * q));
    }
  } else {
    for (int q = 0; q < 4; ++q) {
      const __mmask16 part = static_cast<__mmask16>(in_tail >> (16 * q));
      const __m512 w = _mm512_maskz_loadu_ps(part, m + i + 16 * q);
      const __mmask16 keep = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // +0.0 past the tail: not kept
      _mm512_storeu_ps(t + 16 * q, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, v + i + 16 * q), w));
    }
  }
}

// The ends of up to kTailBatch segments' sums, done together. A segment of kBlock tokens or
// more leaves its 32 lanes and its tail; what remains is a chain of one addition per tail
// token into lane 0, then the combine. One segment's chain waits on the adder's latency at
// every token; here lane g of one register is segment g's lane 0, so one vector addition
// advances up to kTailBatch chains. The tails' terms are transposed 16 x 16 at a time (token
// j of every segment into one register), and every segment adds its terms in token order,
// then +0.0 up to the longest tail of the batch, which leaves it as it is (a lane 0 is never
// -0.0: it starts at +0.0). So each segment keeps its bits.
constexpr int kTailBatch = 16;

// r[j] = column j of the 16 x 16 block whose row g is r[g] (the usual four rounds of
// shuffles: pairs of floats, then of pairs, then 128-bit quarters twice).
inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int g = 0; g < 16; g += 2) {
    t[g] = _mm512_unpacklo_ps(r[g], r[g + 1]);
    t[g + 1] = _mm512_unpackhi_ps(r[g], r[g + 1]);
  }
  for (int g = 0; g < 16; g += 4) {
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]), c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int g = 0; g < 4; ++g) {
    t[g] = _mm512_shuffle_f32x4(r[g], r[g + 4], 0x88);
    t[g + 4] = _mm512_shuffle_f32x4(r[g], r[g + 4], 0xdd);
    t[g + 8] = _mm512_shuffle_f32x4(r[g + 8], r[g + 12], 0x88);
    t[g + 12] = _mm512_shuffle_f32x4(r[g + 8], r[g + 12], 0xdd);
  }
  for (int g = 0; g < 8; ++g) {
    r[g] = _mm512_shuffle_f32x4(t[g], t[g + 8], 0x88);
    r[g + 8] = _mm512_shuffle_f32x4(t[g], t[g + 8], 0xdd);
  }
}

// Segments whose blocks are summed and whose tails wait: add() stages one (its lanes, its
// tail's terms, where its sum goes), flush() finishes every staged one. A batch belongs to
// one thread's task and is flushed before the task ends.
class TailBatch {
 public:
  // The lanes acc0 (0..15) and acc1 (16..31) of a segment whose tail is v[i, hi) (fewer than
  // kBlock tokens); its sum goes to *dst.
  template <typename mask_t>
  void add(__m512 acc0, __m512 acc1, const float* v, const mask_t* m, int64_t i, int64_t hi, float* dst) {
    _mm512_store_ps(lanes_[n_], acc0);
    _mm512_store_ps(lanes_[n_] + 16, acc1);
    tail_terms_f32_avx512(v, m, i, hi, terms_[n_]);
    longest_ = std::max(longest_, hi - i);
    out_[n_] = dst;
    if (++n_ == kTailBatch) {
      flush();
    }
  }

  void flush() {
    if (n_ == 0) {
      return;
    }
    alignas(64) float l0[kTailBatch];
    for (int g = 0; g < kTailBatch; ++g) {
      if (g < n_) {
        l0[g] = lanes_[g][0];
      } else {  // rows of no segment: +0.0, their lanes unused
        l0[g] = 0.0f;
        for (int q = 0; q < kBlock / 16; ++q) {
          _mm512_store_ps(terms_[g] + 16 * q, _mm512_setzero_ps());
        }
      }
    }
    __m512 chains = _mm512_load_ps(l0);
    for (int64_t q = 0; 16 * q < longest_; ++q) {  // tokens 16q .. 16q+15 of every tail
      __m512 r[16];
      for (int g = 0; g < 16; ++g) {
        r[g] = _mm512_load_ps(terms_[g] + 16 * q);
      }
      transpose_16x16(r);
      for (int j = 0; j < 16; ++j) {  // past a tail (and the longest) the terms are +0.0
        chains = _mm512_add_ps(chains, r[j]);
      }
    }
    _mm512_store_ps(l0, chains);
    for (int g = 0; g < n_; ++g) {
      const float* a = lanes_[g];
      *out_[g] = combine_lanes_f32(_mm256_load_ps(a), _mm256_load_ps(a + 8), _mm256_load_ps(a + 16), _mm256_load_ps(a + 24), l0[g]);
    }
    n_ = 0;
    longest_ = 0;
  }

 private:
  alignas(64) float terms_[kTailBatch][kBlock];
  alignas(64) float lanes_[kTailBatch][kLanes];
  float* out_[kTailBatch];
  int n_ = 0;
  int64_t longest_ = 0;
};

// The blocks of kSegments (1 or kGroup) consecutive segments of kBlock tokens or more at once
// (segment s + g, and kept[g] with kCount), each with its own bits; their tails go to the
// batch. A lane's additions form a chain (two per block, in the fixed order), so one
// segment's blocks wait on the adder's latency; here the blocks of the group's segments
// alternate, so their chains advance together. With the tails in the batch, two at a time
// measured at least as fast as one or four on cache-sized batches, with fewer streams of
// lines at once (docs/benchmarks.md).
constexpr int kGroup = 2;

template <int kSegments, bool kCount, typename mask_t>
void masked_sums_f32_avx512_group(const float* v, const mask_t* m, const Segments& seg, int64_t s, float* out, int64_t* kept, TailBatch& tails) {
  __m512 acc0[kSegments], acc1[kSegments];
  int64_t i[kSegments], hi[kSegments], n[kSegments];
  int64_t common = std::numeric_limits<int64_t>::max();
  for (int g = 0; g < kSegments; ++g) {
    acc0[g] = _mm512_setzero_ps();
    acc1[g] = _mm512_setzero_ps();
    i[g] = seg.begin(s + g);
    hi[g] = seg.end(s + g);
    n[g] = 0;
    common = std::min(common, (hi[g] - i[g]) / kBlock);
  }
  auto block = [&](int g) {
    n[g] += masked_block_f32_avx512<kCount>(v, m, i[g], acc0[g], acc1[g]);
    i[g] += kBlock;
  };
  for (int64_t b = 0; b < common; ++b) {
    for (int g = 0; g < kSegments; ++g) {
      block(g);
    }
  }
  for (bool more = true; more;) {  // the longer segments' remaining blocks, still side by side
    more = false;
    for (int g = 0; g < kSegments; ++g) {
      if (i[g] + kBlock <= hi[g]) {
        block(g);
        more = true;
      }
    }
  }
  for (int g = 0; g < kSegments; ++g) {
    if constexpr (kCount) {
      kept[g] = n[g] + tail_kept_avx512(m, i[g], hi[g]);
    }
    if (i[g] == hi[g]) {  // no tail: lane 0 is done
      out[g] = combine_lanes_f32(
          _mm512_castps512_ps256(acc0[g]), high_half(acc0[g]), _mm512_castps512_ps256(acc1[g]), high_half(acc1[g]), _mm512_cvtss_f32(acc0[g]));
    } else {
      tails.add(acc0[g], acc1[g], v, m, i[g], hi[g], out + g);
    }
  }
}
#endif

// The masked sum of a short run (fewer than kBlock tokens, more than kWindow):
// masked_sum_lanes sends all of them to lane 0 in token order, and adding the other
// lanes' +0.0 changes nothing (a sum started at +0.0 is never -0.0), so this plain loop
// gives the same bits.
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum_short(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t total = acc_t(0);
  for (int64_t i = lo; i < hi; ++i) {
    total += masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return total;
}

// Segments of at most kWindow tokens are summed as a fixed tree over a window of
// kWindow terms, the terms past the segment being +0.0: t[j] + t[j + 8] (j < 8), then the
// 8 results pairwise (j with j + 4, then j + 2, then j + 1), then +0.0 added (so the sum is
// never -0.0, as for every other segment). The padding terms are +0.0, so a window of 8
// gives the same bits as one of 16 for a segment of at most 8 tokens. The tree is written
// once as scalar code (window_tree) and once with SSE2 (x86-64's baseline); both do the
// same additions in the same order.
template <typename acc_t>
inline acc_t window_tree(const acc_t* t) {
  acc_t u[8];
  for (int j = 0; j < 8; ++j) {
    u[j] = t[j] + t[j + 8];
  }
  const acc_t a0 = u[0] + u[4], a1 = u[1] + u[5], a2 = u[2] + u[6], a3 = u[3] + u[7];
  return acc_t(0) + ((a0 + a2) + (a1 + a3));
}

// The window sum of a segment's terms, read from a buffer of terms: buf[0, len) are the
// segment's, and buf may be read up to buf + kWindow (what lies past len is ignored).
template <typename acc_t>
inline acc_t window_sum(const acc_t* buf, int64_t len) {
  acc_t t[kWindow];
  for (int j = 0; j < kWindow; ++j) {
    t[j] = j < len ? buf[j] : acc_t(0);
  }
  return window_tree(t);
}

#if defined(__SSE2__)
template <>
inline float window_sum<float>(const float* buf, int64_t len) {
  const __m128i n = _mm_set1_epi32(static_cast<int32_t>(len));
  auto part = [&](int j) {  // terms j .. j+3, +0.0 past len
    const __m128i keep = _mm_cmplt_epi32(_mm_setr_epi32(j, j + 1, j + 2, j + 3), n);
    return _mm_and_ps(_mm_loadu_ps(buf + j), _mm_castsi128_ps(keep));
  };
  __m128 a;  // a_j = u_j + u_{j+4}, u_j = t_j + t_{j+8}
  if (len <= 8) {
    a = _mm_add_ps(part(0), part(4));  // t_{j+8} = +0.0: u_j + 0 only changes a -0.0, which the last +0.0 clears
  } else {
    a = _mm_add_ps(_mm_add_ps(part(0), part(8)), _mm_add_ps(part(4), part(12)));
  }
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));      // b0 = a0 + a2, b1 = a1 + a3
  const __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));  // b0 + b1
  return 0.0f + _mm_cvtss_f32(c);
}
#endif

// The window sum of v[lo, hi) read directly (for segments met outside the batched path).
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum_window(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t t[kWindow] = {};
  for (int64_t i = lo; i < hi; ++i) {
    t[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return window_tree(t);
}

// Tokens of m[lo, hi) whose mask is non-zero, counted in 32-bit lanes over chunks (so
// the loop vectorises) and added up in 64 bits.
constexpr int64_t kCountChunk = int64_t(1) << 20;

template <typename mask_t>
int64_t count_kept_range(const mask_t* __restrict m, int64_t lo, int64_t hi) {
#if LOSSAGG_ISA_LEVEL >= 1
  if constexpr (sizeof(mask_t) == 1) {
    // one-byte masks: 32 bytes compared with 0 at a time, the kept ones counted from the
    // compare's bit mask
    const auto* p = reinterpret_cast<const uint8_t*>(m);
    int64_t total = 0;
    int64_t i = lo;
    const __m256i zero = _mm256_setzero_si256();
    for (; i + 32 <= hi; i += 32) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      const uint32_t zeros = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, zero)));
      total += 32 - __builtin_popcount(zeros);
    }
    for (; i < hi; ++i) {
      total += p[i] != 0;
    }
    return total;
  }
#endif
  int64_t total = 0;
  for (int64_t c = lo; c < hi; c += kCountChunk) {
    const int64_t e = std::min(hi, c + kCountChunk);
    uint32_t n = 0;
    for (int64_t t = c; t < e; ++t) {
      n += static_cast<uint32_t>(is_kept(m[t]));
    }
    total += n;
  }
  return total;
}

// The masked sum of v[lo, hi) and, when kept is not null, its kept tokens (*kept; an
// integer, so counted in any order).
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi, int64_t* kept = nullptr) {
#if LOSSAGG_ISA_LEVEL >= 2
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
    if (hi - lo >= kBlock) {
      return kept ? masked_sum_f32_avx512<true>(v, m, lo, hi, kept) : masked_sum_f32_avx512<false>(v, m, lo, hi, kept);
    }
  }
#endif
  if (kept) {
    *kept = count_kept_range(m, lo, hi);  // the mask of [lo, hi) is read again from the cache
  }
  if (hi - lo <= kWindow) {
    return masked_sum_window<acc_t>(v, m, lo, hi);
  }
  if (hi - lo < kBlock) {
    return masked_sum_short<acc_t>(v, m, lo, hi);
  }
#if LOSSAGG_ISA_LEVEL == 1
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
    return masked_sum_f32_avx2(v, m, lo, hi);
  }
#endif
  return masked_sum_lanes<acc_t>(v, m, lo, hi);
}

// buf[t - lo] = the masked term of token t, for t in [lo, hi): elementwise.
template <typename acc_t, typename scalar_t, typename mask_t>
void masked_terms(acc_t* __restrict buf, const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    buf[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
}

// o[t] = mask_weight(m[t]) * c for t in [lo, hi) (0 where the mask is 0), in the values
// dtype. Elementwise.
template <typename scalar_t, typename acc_t, typename mask_t>
void masked_fill(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    o[i] = static_cast<scalar_t>(masked_term(c, m[i]));
  }
}

// masked_fill with a coefficient per token: o[t] = mask_weight(m[t]) * c[t - lo].
template <typename scalar_t, typename acc_t, typename mask_t>
void masked_scale(scalar_t* __restrict o, const mask_t* __restrict m, const acc_t* __restrict c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    o[i] = static_cast<scalar_t>(masked_term(c[i - lo], m[i]));
  }
}

// out[k * B + s]: the masked sums; with counts not null (and K >= 1), also counts[s]: the
// kept tokens of segment s, counted as its mask is read (for metric 0).
template <typename acc_t, typename scalar_t, typename mask_t>
void segment_sums(const scalar_t* v, const mask_t* m, const TokenLayout& layout, const Segments& seg, acc_t* out, int64_t* counts) {
  const int64_t num_metrics = layout.num_metrics;
  const int64_t num_tokens = layout.num_tokens;
  const int64_t num_segments = layout.num_segments;
  const PiecePlan plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
#if LOSSAGG_ISA_LEVEL >= 2
      TailBatch tails;  // used by float32 sums only
#endif
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
#if LOSSAGG_ISA_LEVEL >= 2
        if constexpr (
            std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
          // segments of kBlock tokens or more: kGroup consecutive ones have their blocks
          // alternate; every one's tail goes to the batch
          int64_t run = 0;
          while (run < kGroup && s + run < last && seg.end(s + run) - seg.begin(s + run) >= kBlock) {
            ++run;
          }
          if (run > 0) {
            const auto group = [&]<int kSegments>(std::integral_constant<int, kSegments>) {
              for (int64_t k = 0; k < num_metrics; ++k) {
                if (k == 0 && counts) {
                  masked_sums_f32_avx512_group<kSegments, true>(v, m, seg, s, out + s, counts + s, tails);
                } else {
                  masked_sums_f32_avx512_group<kSegments, false>(v + k * num_tokens, m, seg, s, out + k * num_segments + s, nullptr, tails);
                }
              }
            };
            if (run == kGroup) {
              group(std::integral_constant<int, kGroup>{});
            } else {
              group(std::integral_constant<int, 1>{});
              run = 1;
            }
            s += run;
            continue;
          }
        }
#endif
        if (e == s) {  // a longer segment
          for (int64_t k = 0; k < num_metrics; ++k) {
            out[k * num_segments + s] = masked_sum<acc_t>(v + k * num_tokens, m, seg.begin(s), seg.end(s), k == 0 && counts ? counts + s : nullptr);
          }
          ++s;
          continue;
        }
        const int64_t lo = seg.begin(s), hi = seg.end(e - 1);
        for (int64_t k = 0; k < num_metrics; ++k) {
          masked_terms<acc_t>(buf, v + k * num_tokens, m, lo, hi);
          for (int j = 0; j < kWindow; ++j) {  // window_sum may read up to kWindow past the batch (and ignores it)
            buf[hi - lo + j] = acc_t(0);
          }
          for (int64_t r = s; r < e; ++r) {
            out[k * num_segments + r] = window_sum(buf + (seg.begin(r) - lo), seg.end(r) - seg.begin(r));
          }
        }
        if (counts) {
          for (int64_t r = s; r < e; ++r) {
            counts[r] = count_kept_range(m, seg.begin(r), seg.end(r));
          }
        }
        s = e;
      }
#if LOSSAGG_ISA_LEVEL >= 2
      tails.flush();
#endif
    });
    return;
  }
  const int64_t num_pieces = plan.num_pieces();
  std::vector<acc_t> partial(static_cast<size_t>(num_metrics * num_pieces));
  std::vector<int64_t> partial_counts(counts ? static_cast<size_t>(num_pieces) : 0);
  for_each_piece(plan, num_tokens, num_metrics, [&](int64_t, int64_t p, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      partial[k * num_pieces + p] = masked_sum<acc_t>(v + k * num_tokens, m, lo, hi, k == 0 && counts ? &partial_counts[p] : nullptr);
    }
  });
  auto combine = [&](int64_t first, int64_t last) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      for (int64_t s = first; s < last; ++s) {
        acc_t total = acc_t(0);
        for (int64_t p = plan.first_piece(s); p < plan.first_piece(s + 1); ++p) {
          total += partial[k * num_pieces + p];
        }
        out[k * num_segments + s] = total;
      }
    }
    if (counts) {
      for (int64_t s = first; s < last; ++s) {
        int64_t total = 0;
        for (int64_t p = plan.first_piece(s); p < plan.first_piece(s + 1); ++p) {
          total += partial_counts[p];
        }
        counts[s] = total;
      }
    }
  };
  if (num_segments * num_metrics < kSerialWork) {
    combine(0, num_segments);
  } else {
    torch::stable::parallel_for(0, num_segments, 4096, combine);
  }
}

template <typename scalar_t, typename acc_t, typename mask_t>
void expand_to_tokens(scalar_t* out, const mask_t* m, const TokenLayout& layout, const Segments& seg, const acc_t* coef) {
  const int64_t num_segments = layout.num_segments;
  const int64_t num_tokens = layout.num_tokens;
  const PiecePlan plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, layout.num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
        if (e == s) {
          for (int64_t k = 0; k < layout.num_metrics; ++k) {
            masked_fill<scalar_t, acc_t>(out + k * num_tokens, m, coef[k * num_segments + s], seg.begin(s), seg.end(s));
          }
          ++s;
          continue;
        }
        const int64_t lo = seg.begin(s), hi = seg.end(e - 1);
        for (int64_t k = 0; k < layout.num_metrics; ++k) {
          // each segment's coefficient over a whole window of the buffer; the next
          // segment's window overwrites what spilled past the segment
          for (int64_t r = s; r < e; ++r) {
            acc_t* w = buf + (seg.begin(r) - lo);
            const acc_t c = coef[k * num_segments + r];
            for (int j = 0; j < kWindow; ++j) {
              w[j] = c;
            }
          }
          masked_scale<scalar_t, acc_t>(out + k * num_tokens, m, buf, lo, hi);
        }
        s = e;
      }
    });
    return;
  }
  for_each_piece(plan, num_tokens, layout.num_metrics, [&](int64_t s, int64_t, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < layout.num_metrics; ++k) {
      masked_fill<scalar_t, acc_t>(out + k * num_tokens, m, coef[k * num_segments + s], lo, hi);
    }
  });
}

template <typename mask_t>
void count_kept(const mask_t* m, const TokenLayout& layout, const Segments& seg, int64_t* out) {
  const PiecePlan plan(seg, layout.num_segments, 0);  // integers: one piece per segment, any order is exact
  // counting is cheap: a thread is worth waking only for about a million tokens
  for_each_task(
      plan, layout.num_tokens, 1,
      [&](int64_t first, int64_t last) {
        for (int64_t s = first; s < last; ++s) {
          out[s] = count_kept_range(m, seg.begin(s), seg.end(s));
        }
      },
      int64_t(1) << 20);
}

// The type-erased entry points: the kernel types are chosen here, once per op.
void segment_sums_entry(const KernelArgs& a, void* out, int64_t* counts) {
  dispatch_kernel_types(a.values_dtype, a.mask_kind, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    segment_sums<acc_t>(static_cast<const S*>(a.values), static_cast<const M*>(a.mask), a.layout, a.seg, static_cast<acc_t*>(out), counts);
  });
}

void expand_to_tokens_entry(const KernelArgs& a, const void* coef, void* out) {
  dispatch_kernel_types(a.values_dtype, a.mask_kind, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    expand_to_tokens<S, acc_t>(static_cast<S*>(out), static_cast<const M*>(a.mask), a.layout, a.seg, static_cast<const acc_t*>(coef));
  });
}

void count_kept_entry(const KernelArgs& a, int64_t* out) {
  dispatch_mask_kind(a.mask_kind, [&]<typename M>(type_tag<M>) { count_kept(static_cast<const M*>(a.mask), a.layout, a.seg, out); });
}

}  // namespace

extern const Engine kEngine = {&segment_sums_entry, &expand_to_tokens_entry, &count_kept_entry};

}  // namespace lossagg::cpu::LOSSAGG_ISA
