// AVX2 (with F16C, POPCNT): the float32 sums of engine_loops.h with 8-float registers, and the
// count of a one-byte mask 32 bytes at a time.
// Included by engine_loops.h (inside namespace lossagg::cpu::LOSSAGG_ISA, after the portable
// primitives it builds on) in the engine units whose target has this instruction set; it
// includes nothing itself (engine_deps.h brings <immintrin.h> before the target is set).
#pragma once

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

// Tokens of the one-byte mask p[lo, hi) that are non-zero: 32 bytes compared with 0 at a time,
// the kept ones counted from the compare's bit mask.
inline int64_t count_kept_bytes_avx2(const uint8_t* p, int64_t lo, int64_t hi) {
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
