// CUDA engine shared by the segmented ops.
//
// The token index space is cut into fixed tiles of kTileTokens tokens, one warp each,
// whatever the segment lengths: RL micro-batches hold few, long and uneven sequences,
// so giving a warp or block to each sequence would leave most of the GPU idle. A warp
// finds its tile's first segment by binary search in cu_seqlens and walks the segments
// that overlap the tile. Segments inside one tile are written directly; a segment that
// crosses tiles leaves one partial per tile, combined afterwards by a small fix-up
// kernel in tile order. Every addition happens in an order fixed by the input alone
// (lanes, warp butterfly, tile order): results are bitwise reproducible, with no float
// atomics, no host synchronisation and nothing that breaks CUDA-graph capture.
#pragma once

#include "../kernel_common.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif  // else: the host emulation (tests/cuda_host/) has declared the CUDA built-ins

#include <cstdint>
#include <limits>

namespace lossagg::cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
// Every kernel launches with kThreads threads. They carry no __launch_bounds__: with
// __launch_bounds__(256) ptxas (CUDA 13, sm_90) holds these kernels to 64 registers and
// spills; without it none spills and each uses fewer than 70 registers (`make
// cuda-report`, docs/benchmarks.md), far below what 256 threads may hold (255 each).
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr int64_t kTileTokens = 1024;
constexpr int kSegmentsPerWarp = 8;  // fix-up kernel
constexpr int kSegmentsPerBlock = kSegmentsPerWarp * kWarpsPerBlock;
// CUDA's limit on gridDim.y: metrics beyond it loop inside the kernels. The host
// emulation's test build lowers it so that the loop is exercised with a few metrics.
#ifndef LOSSAGG_MAX_GRID_Y
#define LOSSAGG_MAX_GRID_Y 65535
#endif
constexpr int64_t kMaxGridY = LOSSAGG_MAX_GRID_Y;

inline int64_t num_tiles(int64_t num_tokens) { return (num_tokens + kTileTokens - 1) / kTileTokens; }

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
  // Butterfly: every lane ends with the same, order-fixed total.
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// masked_term, mask_weight and is_kept come from kernel_common.h (shared with the CPU).

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T x[N];
};

// Tokens per vector access: 16 bytes of values.
template <typename scalar_t>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

// Element phase of a pointer within a VEC-element vector (-1 if not element-aligned).
template <int VEC, typename T>
__device__ __forceinline__ int vec_phase(const T* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if (addr % sizeof(T) != 0) {
    return -1;
  }
  return static_cast<int>((addr / sizeof(T)) % VEC);
}

// The phase both tensors share, or -1 (then every token of a segment is read as head).
template <int VEC, typename T, typename M>
__device__ __forceinline__ int common_phase(const T* p, const M* mask) {
  const int pp = vec_phase<VEC>(p);
  return (pp >= 0 && pp == vec_phase<VEC>(mask)) ? pp : -1;
}

// [a, b) splits into a scalar head [a, begin), a vector body [begin, end) of whole
// VEC-token vectors aligned for both tensors, and a scalar tail [end, b). Without a
// common phase (phase < 0) everything is head.
struct VecBody {
  int64_t begin;
  int64_t end;
};
template <int VEC>
__device__ __forceinline__ VecBody vec_body(int64_t a, int64_t b, int phase) {
  if (phase < 0) {
    return {b, b};
  }
  const int64_t begin = a + (VEC - (a + phase) % VEC) % VEC;
  if (begin >= b) {
    return {b, b};
  }
  return {begin, begin + (b - begin) / VEC * VEC};
}

// Segment holding token x (x < num_tokens): the last s with begin(s) <= x.
__device__ __forceinline__ int64_t segment_of(const Segments& seg, int64_t num_segments, int64_t x) {
  if (seg.cu == nullptr) {
    return x / seg.row_len;
  }
  int64_t lo = 0;
  int64_t hi = num_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (seg.offset(mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename acc_t>
__device__ __forceinline__ acc_t quiet_nan() {
  return std::numeric_limits<acc_t>::quiet_NaN();
}

// True in every lane when some lane's flag is set (an order-free integer butterfly).
__device__ __forceinline__ bool warp_any(bool flag) { return warp_sum(static_cast<unsigned int>(flag)) != 0u; }

// Whether this warp's share of cu_seqlens breaks the table's rules (cu[0] == 0,
// non-decreasing, cu[B] == T): warp `chunk` of `chunks` checks pairs chunk*32+lane,
// stepping by chunks*32, so together the warps of a launch read the table once. The
// same in every lane of the warp.
__device__ __forceinline__ bool table_chunk_bad(
    const Segments& seg, int64_t num_segments, int64_t num_tokens, int64_t chunk, int64_t chunks, int lane) {
  if (seg.cu == nullptr) {
    return false;
  }
  bool bad = chunk == 0 && lane == 0 && (seg.begin(0) != 0 || seg.begin(num_segments) != num_tokens);
  for (int64_t i = chunk * kWarp + lane; i < num_segments; i += chunks * kWarp) {
    bad = bad || seg.begin(i) > seg.begin(i + 1);
  }
  return warp_any(bad);
}

// The tile a warp of a tile kernel takes: its index (tiles of kTileTokens tokens, kWarpsPerBlock
// warps per block along x), its tokens [lo, hi), and this thread's lane. False for a warp past
// the last tile (the grid is rounded up to whole blocks), which returns at once.
struct WarpTile {
  int lane;
  int64_t index, lo, hi;
};

__device__ __forceinline__ bool warp_tile(int64_t tiles, int64_t num_tokens, WarpTile& t) {
  t.lane = threadIdx.x % kWarp;
  t.index = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (t.index >= tiles) {
    return false;
  }
  t.lo = t.index * kTileTokens;
  t.hi = t.lo + kTileTokens < num_tokens ? t.lo + kTileTokens : num_tokens;
  return true;
}

// Calls f(s, a, b, sb, se) for each segment s overlapping the tile [lo, hi), in order,
// with [a, b) its non-empty part inside the tile and [sb, se) the whole segment. Empty
// segments are skipped (the fix-up kernel writes them).
//
// Returns whether cu_seqlens is consistent over the tile: the segments walked lie in
// [0, T] with non-decreasing offsets, the first starts at or before lo, the walk reaches
// hi, segment 0 starts at 0 and segment B-1 ends at T. A valid table passes in every
// tile; where it fails the caller writes NaN instead of trusting the walk (with
// table_chunk_bad, an invalid table is seen in at least one tile whatever its defect).
// Every index stays in bounds either way.
template <typename F>
__device__ __forceinline__ bool for_each_segment_in_tile(
    const Segments& seg, int64_t num_segments, int64_t num_tokens, int64_t lo, int64_t hi, F&& f) {
  if (seg.cu == nullptr) {  // padded rows: always consistent
    for (int64_t s = lo / seg.row_len; s < num_segments && seg.begin(s) < hi; ++s) {
      const int64_t sb = seg.begin(s);
      const int64_t se = seg.end(s);
      const int64_t a = sb > lo ? sb : lo;
      const int64_t b = se < hi ? se : hi;
      if (a < b) {
        f(s, a, b, sb, se);
      }
    }
    return true;
  }
  if (num_segments <= 0) {
    return false;  // tokens but no segment
  }
  int64_t s = segment_of(seg, num_segments, lo);
  bool ok = seg.begin(s) <= lo && (s > 0 || seg.begin(0) == 0);
  int64_t reached = lo;
  for (; s < num_segments; ++s) {
    const int64_t sb = seg.begin(s);
    if (sb >= hi) {
      break;
    }
    const int64_t se = seg.end(s);
    ok = ok && sb >= 0 && sb <= se && se <= num_tokens && (s + 1 < num_segments || se == num_tokens);
    if (!ok) {
      break;
    }
    const int64_t a = sb > lo ? sb : lo;
    const int64_t b = se < hi ? se : hi;
    if (a < b) {
      f(s, a, b, sb, se);
    }
    reached = se > reached ? se : reached;
  }
  return ok && reached >= hi;
}

// This lane's share of the masked sum of tokens [a, b), and of their kept tokens (*kept,
// added to). `phase`: values and mask share the same phase, so indices with
// (i + phase) % VEC == 0 are aligned for both.
template <typename acc_t, typename scalar_t, typename mask_t>
__device__ __forceinline__ acc_t
lane_masked_sum(const scalar_t* __restrict__ v, const mask_t* __restrict__ m, int64_t a, int64_t b, int lane, int phase, unsigned int& kept) {
  constexpr int VEC = vec_width<scalar_t>();
  acc_t acc = acc_t(0);
  unsigned int n = 0;
  const VecBody body = vec_body<VEC>(a, b, phase);
  const int64_t body_begin = body.begin;
  const int64_t body_end = body.end;
  for (int64_t i = a + lane; i < body_begin; i += kWarp) {
    acc += masked_term(static_cast<acc_t>(v[i]), m[i]);
    n += is_kept(m[i]);
  }
  for (int64_t i = body_begin + static_cast<int64_t>(lane) * VEC; i < body_end; i += static_cast<int64_t>(kWarp) * VEC) {
    const Pack<scalar_t, VEC> xv = *reinterpret_cast<const Pack<scalar_t, VEC>*>(v + i);
    const Pack<mask_t, VEC> mv = *reinterpret_cast<const Pack<mask_t, VEC>*>(m + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc += masked_term(static_cast<acc_t>(xv.x[j]), mv.x[j]);
      n += is_kept(mv.x[j]);
    }
  }
  for (int64_t i = body_end + lane; i < b; i += kWarp) {
    acc += masked_term(static_cast<acc_t>(v[i]), m[i]);
    n += is_kept(m[i]);
  }
  kept += n;
  return acc;
}

// Where metric k's values lie: the rows of one [K, T] array (`base`, row k at base + k *
// num_tokens: segment_sum, reduce, their backward, with grid.y over the metrics), or up to
// kMaxTermRows arrays of their own (`row`, base null: reduce_terms and its backward, read where
// they lie, launched with one block row so that each warp sums every term over its tile while
// the tile's mask is in its L1, and the mask is read from memory once). One type for both, so
// each (values, mask) pair has one tile kernel and one expand kernel for every op: the branch
// is per metric, never per token.
constexpr int kMaxTermRows = 8;

// Element k of a kernel parameter's small array, picked by selects over constant indices: a
// dynamic index into a parameter array would copy the array to the thread's stack first.
template <typename T>
__device__ __forceinline__ T pick(const T (&a)[kMaxTermRows], int64_t k) {
  T x = a[0];
#pragma unroll
  for (int j = 1; j < kMaxTermRows; ++j) {
    x = k == j ? a[j] : x;
  }
  return x;
}

template <typename T>
struct Rows {
  T* base;
  T* row[kMaxTermRows];
  __device__ __forceinline__ T* operator()(int64_t k, int64_t num_tokens) const { return base != nullptr ? base + k * num_tokens : pick(row, k); }
};

template <typename T>
__host__ inline Rows<T> strided_rows(T* base) {
  Rows<T> r{};
  r.base = base;
  return r;
}

// Pass 1 of segment sums. grid: (ceil(tiles / kWarpsPerBlock), min(K, kMaxGridY)), or
// (…, 1) for rows of their own. out[k, s] for segments inside one tile; first_partial / last_partial [K, tiles] for the
// tile's first segment (if it starts before the tile or ends after it) and for its last
// segment (if it ends after the tile). With counts (segment_sum_and_count), the kept
// tokens go the same way, for metric 0: counts[s], or first_count / last_count [tiles].
// A tile over which cu_seqlens is inconsistent sets *bad_table (a plain integer store; the
// fix-up then writes NaN).
template <typename acc_t, typename scalar_t, typename mask_t>
__global__ void segment_sum_tiles_kernel(
    Rows<const scalar_t> values,
    const mask_t* __restrict__ mask,
    Segments seg,
    int64_t num_segments,
    int64_t num_tokens,
    int64_t num_metrics,
    int64_t tiles,
    acc_t* __restrict__ out,
    acc_t* __restrict__ first_partial,
    acc_t* __restrict__ last_partial,
    unsigned int* __restrict__ bad_table,
    int64_t* __restrict__ counts,
    int64_t* __restrict__ first_count,
    int64_t* __restrict__ last_count) {
  constexpr int VEC = vec_width<scalar_t>();
  WarpTile t;
  if (!warp_tile(tiles, num_tokens, t)) {
    return;
  }
  const int lane = t.lane;
  const int64_t tile = t.index, lo = t.lo, hi = t.hi;
  if (blockIdx.y == 0 && table_chunk_bad(seg, num_segments, num_tokens, tile, tiles, lane) && lane == 0) {
    *bad_table = 1u;
  }
  for (int64_t k = blockIdx.y; k < num_metrics; k += gridDim.y) {
    const scalar_t* v = values(k, num_tokens);
    const int phase = common_phase<VEC>(v, mask);
    const bool count = counts != nullptr && k == 0;
    const bool ok = for_each_segment_in_tile(seg, num_segments, num_tokens, lo, hi, [&](int64_t s, int64_t a, int64_t b, int64_t sb, int64_t se) {
      unsigned int lane_kept = 0;
      const acc_t sum = warp_sum(lane_masked_sum<acc_t>(v, mask, a, b, lane, phase, lane_kept));
      const int64_t kept = count ? static_cast<int64_t>(warp_sum(lane_kept)) : 0;  // integers: any order
      if (lane == 0) {
        if (sb >= lo && se <= hi) {
          out[k * num_segments + s] = sum;
          if (count) {
            counts[s] = kept;
          }
        } else {
          if (sb <= lo) {  // the tile's first segment: it holds token lo
            first_partial[k * tiles + tile] = sum;
            if (count) {
              first_count[tile] = kept;
            }
          }
          if (se > hi) {
            last_partial[k * tiles + tile] = sum;
            if (count) {
              last_count[tile] = kept;
            }
          }
        }
      }
    });
    if (!ok && lane == 0) {
      *bad_table = 1u;
    }
  }
}

// Total of segment s across tiles, for a segment that crosses tiles, computed by one
// warp in a fixed order: last_partial[ta] + (sum of first_partial over the middle tiles)
// + first_partial[tb].
template <typename acc_t>
__device__ __forceinline__ acc_t
combine_tiles(const acc_t* __restrict__ first_partial, const acc_t* __restrict__ last_partial, int64_t ta, int64_t tb, int lane) {
  acc_t middle = acc_t(0);
  for (int64_t t = ta + 1 + lane; t < tb; t += kWarp) {
    middle += first_partial[t];
  }
  middle = warp_sum(middle);
  return (last_partial[ta] + middle) + first_partial[tb];
}

// Kept tokens of segment s across tiles (integers: any order).
__device__ __forceinline__ int64_t
combine_tile_counts(const int64_t* __restrict__ first_count, const int64_t* __restrict__ last_count, int64_t ta, int64_t tb, int lane) {
  unsigned long long middle = 0;
  for (int64_t t = ta + 1 + lane; t < tb; t += kWarp) {
    middle += static_cast<unsigned long long>(first_count[t]);
  }
  middle = warp_sum(middle);
  return last_count[ta] + static_cast<int64_t>(middle) + first_count[tb];
}

// Pass 2 (fix-up). grid: (ceil(B / kSegmentsPerBlock), min(K, kMaxGridY)). Completes
// out[k, s] (and counts[s], when counting) for empty segments and segments that cross
// tiles; with an inconsistent cu_seqlens the counts are -1. With kReduce (K == 1) it
// also computes sum_s out[s] / denoms[s]: each block sums its segments in order, and the
// last block to finish (an integer counter) adds the block sums in block order into
// *result. With an inconsistent cu_seqlens (seen by a tile, or by this segment's own
// offsets) every sum is NaN, so is the reduce result: never unwritten memory.
template <bool kReduce, typename acc_t>
__global__ void segment_sum_fixup_kernel(
    Segments seg,
    int64_t num_segments,
    int64_t num_tokens,
    int64_t num_metrics,
    int64_t tiles,
    acc_t* __restrict__ out,
    const acc_t* __restrict__ first_partial,
    const acc_t* __restrict__ last_partial,
    const unsigned int* __restrict__ bad_table,
    const acc_t* __restrict__ denoms,
    acc_t* __restrict__ block_sums,
    unsigned int* __restrict__ counter,
    acc_t* __restrict__ result,
    int64_t* __restrict__ counts,
    const int64_t* __restrict__ first_count,
    const int64_t* __restrict__ last_count) {
  __shared__ acc_t weighted[kSegmentsPerBlock];
  __shared__ bool is_last_block;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t block_first = static_cast<int64_t>(blockIdx.x) * kSegmentsPerBlock;
  const bool table_bad = *bad_table != 0u;

  for (int64_t k = blockIdx.y; k < num_metrics; k += gridDim.y) {
    acc_t* out_k = out + k * num_segments;
    for (int j = 0; j < kSegmentsPerWarp; ++j) {
      const int slot = warp * kSegmentsPerWarp + j;
      const int64_t s = block_first + slot;
      acc_t value = acc_t(0);
      if (s < num_segments) {
        const int64_t b0 = seg.begin(s);
        const int64_t e0 = seg.end(s);
        const bool bad = table_bad || b0 < 0 || b0 > e0 || e0 > num_tokens || (s == 0 && b0 != 0) || (s + 1 == num_segments && e0 != num_tokens);
        const bool count = counts != nullptr && k == 0;
        int64_t kept = bad ? -1 : 0;
        if (bad) {
          value = quiet_nan<acc_t>();
        } else if (e0 > b0) {
          const int64_t ta = b0 / kTileTokens;
          const int64_t tb = (e0 - 1) / kTileTokens;
          value = ta != tb ? combine_tiles(first_partial + k * tiles, last_partial + k * tiles, ta, tb, lane) : out_k[s];
          if (count) {
            kept = ta != tb ? combine_tile_counts(first_count, last_count, ta, tb, lane) : counts[s];
          }
        }
        if (lane == 0) {
          out_k[s] = value;
          if (count) {
            counts[s] = kept;
          }
        }
        if constexpr (kReduce) {
          value = value / denoms[s];
        }
      }
      if constexpr (kReduce) {
        if (lane == 0) {
          weighted[slot] = value;
        }
      }
    }
  }
  if constexpr (kReduce) {
    __syncthreads();
    if (threadIdx.x == 0) {
      acc_t block_total = acc_t(0);
      for (int i = 0; i < kSegmentsPerBlock; ++i) {
        block_total += weighted[i];
      }
      block_sums[blockIdx.x] = table_bad ? quiet_nan<acc_t>() : block_total;  // also when B == 0
      __threadfence();
      const unsigned int done = atomicAdd(counter, 1u);
      is_last_block = done == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last_block && threadIdx.x == 0) {
      __threadfence();
      acc_t total = acc_t(0);
      for (unsigned int i = 0; i < gridDim.x; ++i) {
        total += __ldcg(block_sums + i);
      }
      *result = total;
    }
  }
}

// The coefficient of token t of segment s in metric k's gradient, for every backward op: one
// type, chosen per op by `kind` (a branch per segment, never per token), each kind computing
// exactly what that op's gradient is.
//   segment:   segment_sum_backward, each segment's incoming gradient grad [K, B];
//   over_denom: reduce_backward, the scalar incoming gradient (read on the device: no host sync)
//              over the sample's denominator;
//   term:      reduce_terms_backward, for the terms [k0, k0 + kMaxTermRows) of a call:
//              ((grad * c_k) / d[k, s]) * w[k, s] (no w: the quotient) by term_grad.
struct TermCoefficients {
  double c[kMaxTermRows];
};

enum class CoefficientKind : int { segment, over_denom, term };

template <typename acc_t>
struct Coefficient {
  CoefficientKind kind;
  const acc_t* grad;
  const acc_t* denoms;   // over_denom: [B]; term: [K, B]
  const acc_t* weights;  // term: [K, B] or null
  TermCoefficients coefficients;
  int64_t k0;
  int64_t num_segments;
  __device__ acc_t operator()(int64_t k, int64_t s) const {
    switch (kind) {
      case CoefficientKind::segment:
        return grad[k * num_segments + s];
      case CoefficientKind::over_denom:
        return *grad / denoms[s];
      default: {
        const int64_t i = (k0 + k) * num_segments + s;
        return term_grad(*grad, pick(coefficients.c, k), denoms[i], weights != nullptr ? weights + i : nullptr);
      }
    }
  }
};

template <typename acc_t>
__host__ inline Coefficient<acc_t> segment_grad(const acc_t* grad, int64_t num_segments) {
  return {CoefficientKind::segment, grad, nullptr, nullptr, {}, 0, num_segments};
}
template <typename acc_t>
__host__ inline Coefficient<acc_t> grad_over_denom(const acc_t* grad, const acc_t* denoms) {
  return {CoefficientKind::over_denom, grad, denoms, nullptr, {}, 0, 0};
}
template <typename acc_t>
__host__ inline Coefficient<acc_t> term_grad_of(
    const acc_t* grad, const acc_t* denoms, const acc_t* weights, const TermCoefficients& c, int64_t k0, int64_t num_segments) {
  return {CoefficientKind::term, grad, denoms, weights, c, k0, num_segments};
}

// Backward: out(k)[t] = mask_weight(m[t]) * coef(k, s(t)), 0 where the mask is 0 (Rows: the
// rows of one [K, T] array, or up to kMaxTermRows tensors of their own; Coefficient: any op's).
// grid: (ceil(tiles / kWarpsPerBlock), min(K, kMaxGridY)). Every token of the tile is
// written: with an invalid cu_seqlens (device checks off) the tiles that see it are all
// NaN (every lane's stores of the walk ordered before the fill), so the gradient holds NaN
// and never unwritten memory.
template <typename scalar_t, typename acc_t, typename mask_t>
__global__ void expand_tiles_kernel(
    Rows<scalar_t> out,
    const mask_t* __restrict__ mask,
    Segments seg,
    int64_t num_segments,
    int64_t num_tokens,
    int64_t num_metrics,
    int64_t tiles,
    Coefficient<acc_t> coef) {
  constexpr int VEC = vec_width<scalar_t>();
  WarpTile t;
  if (!warp_tile(tiles, num_tokens, t)) {
    return;
  }
  const int lane = t.lane;
  const int64_t tile = t.index, lo = t.lo, hi = t.hi;
  const bool table_bad = table_chunk_bad(seg, num_segments, num_tokens, tile, tiles, lane);
  for (int64_t k = blockIdx.y; k < num_metrics; k += gridDim.y) {
    scalar_t* o = out(k, num_tokens);
    const int phase = common_phase<VEC>(o, mask);
    const bool ok =
        !table_bad && for_each_segment_in_tile(seg, num_segments, num_tokens, lo, hi, [&](int64_t s, int64_t a, int64_t b, int64_t, int64_t) {
          const acc_t c = coef(k, s);
          const VecBody body = vec_body<VEC>(a, b, phase);
          const int64_t body_begin = body.begin;
          const int64_t body_end = body.end;
          for (int64_t i = a + lane; i < body_begin; i += kWarp) {
            o[i] = static_cast<scalar_t>(masked_term(c, mask[i]));
          }
          for (int64_t i = body_begin + static_cast<int64_t>(lane) * VEC; i < body_end; i += static_cast<int64_t>(kWarp) * VEC) {
            const Pack<mask_t, VEC> mv = *reinterpret_cast<const Pack<mask_t, VEC>*>(mask + i);
            Pack<scalar_t, VEC> ov;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              ov.x[j] = static_cast<scalar_t>(masked_term(c, mv.x[j]));
            }
            *reinterpret_cast<Pack<scalar_t, VEC>*>(o + i) = ov;
          }
          for (int64_t i = body_end + lane; i < b; i += kWarp) {
            o[i] = static_cast<scalar_t>(masked_term(c, mask[i]));
          }
        });
    if (!ok) {
      // A token may have been written by another lane in the walk above (the vector body
      // maps tokens to lanes differently from this loop). `ok` is warp-uniform, so the whole
      // warp meets here: the barrier orders those stores before the NaN ones.
      __syncwarp();
      for (int64_t i = lo + lane; i < hi; i += kWarp) {
        o[i] = static_cast<scalar_t>(quiet_nan<acc_t>());
      }
    }
  }
}

// reduce_terms' totals, for the terms [k0, k0 + num_terms) of a call (a chunk of at most
// kMaxTermRows). For each term k: q[s] = sums[k, s] / denoms[k, s] (with weights, w·S / d by
// weighted_quotient), J_k = sum_s q[s] added in reduce's own order (the fix-up kernel's: blocks
// of kSegmentsPerBlock samples, each block's quotients in sample order from 0, then the blocks'
// totals in block order from 0), so that a term has the bits reduce gives its values;
// parts[k] = J_k; then *result = c_k0 J_k0 (the first chunk) or *result + c_k J_k, term after
// term (scaled_part). Thread j computes the totals of blocks j, j + kThreads, ...; thread 0 adds
// them in order. Deterministic; with an inconsistent cu_seqlens (bad_table, set by the tiles;
// or a segment's own offsets, whose sum the fix-up made NaN) J_k and J are NaN.
template <typename acc_t>
__global__ void terms_total_kernel(
    const acc_t* __restrict__ sums,
    const acc_t* __restrict__ denoms,
    const acc_t* __restrict__ weights,
    TermCoefficients coefficients,
    int64_t k0,
    int64_t num_terms,
    int64_t num_segments,
    const unsigned int* __restrict__ bad_table,
    acc_t* __restrict__ parts,
    acc_t* __restrict__ result) {
  __shared__ acc_t block_total[kThreads];
  const bool table_bad = *bad_table != 0u;
  const int64_t needed = (num_segments + kSegmentsPerBlock - 1) / kSegmentsPerBlock;
  const int64_t blocks = needed > 0 ? needed : 1;  // the fix-up's grid: one block when B == 0
  for (int64_t j = 0; j < num_terms; ++j) {
    const int64_t k = k0 + j;
    const acc_t* x = sums + k * num_segments;
    const acc_t* d = denoms + k * num_segments;
    const acc_t* w = weights != nullptr ? weights + k * num_segments : nullptr;
    acc_t total = acc_t(0);
    for (int64_t first = 0; first < blocks; first += kThreads) {
      const int64_t b = first + threadIdx.x;
      acc_t own = acc_t(0);
      if (b < blocks) {
        for (int i = 0; i < kSegmentsPerBlock; ++i) {
          const int64_t s = b * kSegmentsPerBlock + i;
          own += s < num_segments ? (w != nullptr ? weighted_quotient(x[s], w[s], d[s]) : x[s] / d[s]) : acc_t(0);
        }
      }
      block_total[threadIdx.x] = own;
      __syncthreads();
      if (threadIdx.x == 0) {
        const int64_t n = blocks - first < kThreads ? blocks - first : kThreads;
        for (int64_t i = 0; i < n; ++i) {
          total += block_total[i];
        }
      }
      __syncthreads();  // block_total is reused by the next blocks
    }
    if (threadIdx.x == 0) {
      const acc_t part = table_bad ? quiet_nan<acc_t>() : total;
      parts[k] = part;
      const acc_t scaled = scaled_part(part, pick(coefficients.c, j));
      *result = k == 0 ? scaled : *result + scaled;
    }
  }
}

}  // namespace lossagg::cuda
