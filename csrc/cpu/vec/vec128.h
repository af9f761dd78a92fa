// SSE2 (x86-64's baseline): the window tree of engine_loops.h with 4-float registers.
// Included by engine_loops.h (inside namespace lossagg::cpu::LOSSAGG_ISA, after the portable
// primitives it builds on) in the engine units whose target has this instruction set; it
// includes nothing itself (engine_deps.h brings <immintrin.h> before the target is set).
#pragma once

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
