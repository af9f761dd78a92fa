// AVX-512 (F, BW, VL): the float32 sums of engine_loops.h with 16-float registers and
// zeroing masked loads, the batched tails, and segments' blocks side by side. Builds on
// vec256.h (the combine of the 32 lanes, the tail's finish).
// Included by engine_loops.h (inside namespace lossagg::cpu::LOSSAGG_ISA, after the portable
// primitives it builds on) in the engine units whose target has this instruction set; it
// includes nothing itself (engine_deps.h brings <immintrin.h> before the target is set).
#pragma once

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

// Up to kGroup consecutive segments from s (before last) of kBlock tokens or more, summed
// side by side (masked_sums_f32_avx512_group) for every metric (values rows[k]), their tails to the batch;
// with counts, the kept tokens of metric 0. Returns how many segments it took: 0 when
// segment s is shorter than kBlock.
template <typename mask_t>
int64_t long_segments_f32_avx512(
    const Rows<const float>& rows,
    const mask_t* m,
    const TokenLayout& layout,
    const Segments& seg,
    int64_t s,
    int64_t last,
    float* out,
    int64_t* counts,
    TailBatch& tails) {
  int64_t run = 0;
  while (run < kGroup && s + run < last && seg.end(s + run) - seg.begin(s + run) >= kBlock) {
    ++run;
  }
  if (run == 0) {
    return 0;
  }
  const int64_t num_segments = layout.num_segments;
  const auto group = [&]<int kSegments>(std::integral_constant<int, kSegments>) {
    for (int64_t k = 0; k < layout.num_metrics; ++k) {
      if (k == 0 && counts) {
        masked_sums_f32_avx512_group<kSegments, true>(rows[0], m, seg, s, out + s, counts + s, tails);
      } else {
        masked_sums_f32_avx512_group<kSegments, false>(rows[k], m, seg, s, out + k * num_segments + s, nullptr, tails);
      }
    }
  };
  if (run == kGroup) {
    group(std::integral_constant<int, kGroup>{});
    return kGroup;
  }
  group(std::integral_constant<int, 1>{});
  return 1;
}
#endif
