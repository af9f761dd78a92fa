// Runs the CUDA kernels of csrc/cuda/ (unchanged source, through the same launchers)
// on the CPU with the emulation in cuda_host.h, on thousands of generated cases, against
// a float64 reference; checks that results are bitwise identical across block orders,
// and the contract for invalid cu_seqlens with the device checks off (NaN, never
// unwritten memory, never an out-of-bounds access). Built with AddressSanitizer and
// UBSan by CMake (target lossagg_cuda_host_test, run by ctest).
//
//   lossagg_cuda_host_test [cases] [seed] [shard] [shards]
//
// Case i is generated from (seed, i) alone and run by shard i % shards, so ctest runs the
// shards side by side (CMakeLists.txt) and any one case can be rerun alone.
#include "cuda_host.h"

#include "../../csrc/cuda/launch.cuh"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

using cuda_host::BlockOrder;
using cuda_host::HostDevice;
using cuda_host::LaneOrder;
using lossagg::BoolMask;
using lossagg::Segments;
using lossagg::TokenLayout;

namespace {

int passed = 0;
int failed = 0;
std::string case_name;

void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    if (failed <= 20) {
      std::printf("FAIL [%s] %s\n", case_name.c_str(), what.c_str());
    }
  }
}

std::mt19937_64 rng;

int64_t uniform(int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Segment lengths that hit every shape the kernels distinguish: empty, inside one tile,
// exactly on tile edges, crossing many tiles.
std::vector<int64_t> random_lengths(int64_t B) {
  constexpr int64_t tile = lossagg::cuda::kTileTokens;
  std::vector<int64_t> lengths(static_cast<size_t>(B));
  for (auto& n : lengths) {
    switch (uniform(0, 6)) {
      case 0:
        n = 0;
        break;
      case 1:
        n = uniform(1, 8);
        break;
      case 2:
        n = uniform(1, 200);
        break;
      case 3:
        n = tile * uniform(1, 2) + uniform(-1, 1);
        break;
      case 4:
        n = uniform(tile - 3, tile + 3);
        break;
      case 5:
        n = uniform(1, 5 * tile);
        break;
      default:
        n = uniform(0, 40);
        break;
    }
    n = std::max<int64_t>(n, 0);
  }
  return lengths;
}

template <typename T>
double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double to_double<double>(double x) {
  return x;
}
template <>
double to_double<BoolMask>(BoolMask x) {
  return x.value != 0 ? 1.0 : 0.0;  // any non-zero byte is true
}

template <typename T>
T from_double(double x) {
  return static_cast<T>(x);
}
template <>
BoolMask from_double<BoolMask>(double x) {
  // a bool tensor viewed from uint8 may hold any non-zero byte for true
  return BoolMask{static_cast<uint8_t>(x == 0.0 ? 0 : uniform(1, 255))};
}

// A buffer of n elements starting `phase` elements past a 64-byte boundary: every
// alignment phase of the vector loads.
template <typename T>
struct Phased {
  std::vector<unsigned char> storage;
  T* data;
  Phased(int64_t n, int phase) : storage(static_cast<size_t>(n + phase + 64) * sizeof(T) + 64) {
    auto addr = reinterpret_cast<uintptr_t>(storage.data());
    addr = (addr + 63) / 64 * 64 + static_cast<uintptr_t>(phase) * sizeof(T);
    data = reinterpret_cast<T*>(addr);
  }
};

struct Case {
  int64_t B = 0;
  int64_t K = 1;
  bool packed = true;
  int64_t row_len = 0;
  std::vector<int64_t> cu;  // B+1 (packed)
  int64_t T = 0;            // token index space
  int values_phase = 0;
  int mask_phase = 0;
  bool cu_int64 = true;
};

Case random_case(bool packed, int64_t max_b) {
  Case c;
  c.packed = packed;
  c.B = uniform(0, 1) ? uniform(0, 6) : uniform(0, max_b);
  c.K = uniform(0, 3) == 0 ? uniform(2, 4) : 1;
  if (packed) {
    auto lengths = random_lengths(c.B);
    c.cu.assign(1, 0);
    for (int64_t n : lengths) {
      c.cu.push_back(c.cu.back() + n);
    }
    c.T = c.cu.back();
  } else {
    c.row_len = uniform(0, 1) ? uniform(0, 40) : uniform(1000, 2100);
    c.T = c.B * c.row_len;
  }
  c.cu_int64 = uniform(0, 1) != 0;
  c.values_phase = static_cast<int>(uniform(0, 7));
  c.mask_phase = uniform(0, 1) ? c.values_phase : static_cast<int>(uniform(0, 7));
  return c;
}

int64_t seg_begin(const Case& c, int64_t s) { return c.packed ? c.cu[s] : s * c.row_len; }
int64_t seg_end(const Case& c, int64_t s) { return c.packed ? c.cu[s + 1] : (s + 1) * c.row_len; }

// The kernels' types: a floating mask is in the accumulation dtype (the op set-up converts
// the others, csrc/op_setup.h); offsets are int32 or int64 (`cu_int64`).
template <typename S, typename M>
struct Inputs {
  Phased<S> values;
  Phased<M> mask;
  std::vector<int64_t> cu;
  std::vector<int32_t> cu32;
  bool cu_int64 = true;
  std::vector<double> v64, m64;  // what the kernels read, in float64
  Inputs(const Case& c) : values(c.K * c.T, c.values_phase), mask(c.T, c.mask_phase) {
    v64.resize(static_cast<size_t>(c.K * c.T));
    m64.resize(static_cast<size_t>(c.T));
    std::normal_distribution<double> normal;
    for (int64_t t = 0; t < c.T; ++t) {
      double m = uniform(0, 9) < 7 ? 1.0 : 0.0;
      if constexpr (!std::is_same_v<M, BoolMask> && !std::is_integral_v<M>) {
        m *= 0.25 + std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      }
      mask.data[t] = from_double<M>(m);
      m64[t] = to_double(mask.data[t]);
    }
    for (int64_t i = 0; i < c.K * c.T; ++i) {
      double x = normal(rng);
      if (m64[i % std::max<int64_t>(c.T, 1)] == 0.0 && uniform(0, 3) == 0) {  // masked NaN/inf must not leak
        x = uniform(0, 1) ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
      }
      values.data[i] = static_cast<S>(x);
      v64[i] = to_double(values.data[i]);
    }
    cu = c.cu;
    for (int64_t x : c.cu) {
      cu32.push_back(static_cast<int32_t>(x));
    }
    cu_int64 = c.cu_int64;
  }
  Segments segments(const Case& c) const {
    if (!c.packed) {
      return Segments{nullptr, false, c.row_len};
    }
    return cu_int64 ? Segments{cu.data(), true, 0} : Segments{cu32.data(), false, 0};
  }
  TokenLayout layout(const Case& c) const { return TokenLayout{c.packed, c.B, c.T, c.row_len, c.K, c.K > 1}; }
};

// Float64 reference: masked sums [K, B] and, per sum, the sum of |terms| for a tolerance.
void reference_sums(const Case& c, const std::vector<double>& v, const std::vector<double>& m, std::vector<double>& sums, std::vector<double>& abs) {
  sums.assign(static_cast<size_t>(c.K * c.B), 0.0);
  abs.assign(static_cast<size_t>(c.K * c.B), 0.0);
  for (int64_t k = 0; k < c.K; ++k) {
    for (int64_t s = 0; s < c.B; ++s) {
      for (int64_t t = seg_begin(c, s); t < seg_end(c, s); ++t) {
        if (m[t] != 0.0) {
          sums[k * c.B + s] += m[t] * v[k * c.T + t];
          abs[k * c.B + s] += std::fabs(m[t] * v[k * c.T + t]);
        }
      }
    }
  }
}

bool close(double got, double want, double scale, double rtol) {
  return std::isfinite(got) && std::fabs(got - want) <= rtol * (scale + std::fabs(want)) + 1e-30;
}

// reduce_terms over the case's K metrics, each read where it lies (rows into the values
// buffer, in reversed order so that row k is not at values + k * T), with or without weights:
// parts and J against the float64 reference, the same bits in every block order and rerun;
// the backward writes ((g * c_k) / d[k, s]) * w[k, s] * m[t] to every token of every term.
template <typename S, typename In, typename acc_t = lossagg::acc_t_of<S>>
void run_terms_case(
    const Case& c,
    const In& in,
    const Segments& seg,
    TokenLayout layout,
    const std::vector<double>& ref,
    const std::vector<double>& ref_abs,
    uint64_t case_seed) {
  const int64_t K = c.K;
  layout.num_metrics = K;
  layout.has_metric_dim = true;
  std::vector<const S*> rows(static_cast<size_t>(K));
  std::vector<int64_t> source(static_cast<size_t>(K));  // the metric row k reads
  for (int64_t k = 0; k < K; ++k) {
    source[k] = K - 1 - k;
    rows[k] = in.values.data + source[k] * c.T;
  }
  const bool weighted = uniform(0, 1) != 0;
  std::vector<acc_t> d(static_cast<size_t>(K * c.B)), w(static_cast<size_t>(K * c.B));
  std::vector<double> coefficients(static_cast<size_t>(K));
  for (auto& x : d) {
    x = static_cast<acc_t>(static_cast<float>(1.0 + 10.0 * std::uniform_real_distribution<double>(0.0, 1.0)(rng)));
  }
  for (auto& x : w) {
    x = static_cast<acc_t>(static_cast<float>(std::normal_distribution<double>()(rng)));
  }
  for (auto& x : coefficients) {
    x = std::normal_distribution<double>()(rng);
  }
  double want = 0.0, scale = 0.0;
  std::vector<double> want_parts(static_cast<size_t>(K)), part_scale(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t s = 0; s < c.B; ++s) {
      const double wk = weighted ? static_cast<double>(w[k * c.B + s]) : 1.0;
      want_parts[k] += wk * ref[source[k] * c.B + s] / static_cast<double>(d[k * c.B + s]);
      part_scale[k] += std::fabs(wk) * ref_abs[source[k] * c.B + s] / static_cast<double>(d[k * c.B + s]);
    }
    const double ck = coefficients[k];  // as given: c_k J_k is computed in float64 (scaled_part)
    want += ck * want_parts[k];
    scale += std::fabs(ck) * part_scale[k];
  }
  const double rtol = std::is_same_v<acc_t, double> ? 1e-12 : 2e-6;
  std::vector<std::vector<acc_t>> all_parts;
  std::vector<acc_t> results;
  for (BlockOrder order : {BlockOrder::InOrder, BlockOrder::Reversed, BlockOrder::Shuffled, BlockOrder::InOrder}) {
    std::vector<acc_t> parts(static_cast<size_t>(K), acc_t(12345));
    acc_t result = acc_t(12345);
    HostDevice dev(order, case_seed + 3);
    lossagg::cuda::launch_reduce_terms<acc_t>(
        dev, layout, seg, rows.data(), in.mask.data, d.data(), weighted ? w.data() : static_cast<const acc_t*>(nullptr), coefficients.data(),
        parts.data(), &result);
    all_parts.push_back(std::move(parts));
    results.push_back(result);
  }
  bool parts_ok = true;
  for (int64_t k = 0; k < K; ++k) {
    parts_ok = parts_ok && close(all_parts[0][k], want_parts[k], part_scale[k], rtol);
  }
  expect(parts_ok, "reduce_terms: each term's J_k matches the float64 reference");
  expect(close(results[0], want, scale, rtol), "reduce_terms: J matches the float64 reference");
  bool same = true;
  for (size_t r = 1; r < results.size(); ++r) {
    same = same && std::memcmp(&results[r], &results[0], sizeof(acc_t)) == 0 &&
           std::memcmp(all_parts[r].data(), all_parts[0].data(), all_parts[0].size() * sizeof(acc_t)) == 0;
  }
  expect(same, "reduce_terms: bitwise identical across block orders and reruns");
  if (!weighted) {  // each term's J_k has the bits reduce gives its values (docs/ops.md): one order of additions
    TokenLayout one = layout;
    one.num_metrics = 1;
    one.has_metric_dim = false;
    bool as_reduce = true;
    for (int64_t k = 0; k < K; ++k) {
      acc_t alone = acc_t(12345);
      HostDevice dev;
      lossagg::cuda::launch_reduce<acc_t>(dev, one, seg, rows[k], in.mask.data, d.data() + k * c.B, &alone);
      as_reduce = as_reduce && std::memcmp(&alone, &all_parts[0][k], sizeof(acc_t)) == 0;
    }
    expect(as_reduce, "reduce_terms: each term's J_k has the bits of reduce on its values");
  }

  // the backward, into K buffers of their own
  const acc_t upstream = static_cast<acc_t>(0.75);
  std::vector<Phased<S>> grads;
  std::vector<S*> out(static_cast<size_t>(K));
  grads.reserve(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) {
    grads.emplace_back(c.T, c.values_phase);
    std::fill(grads[k].data, grads[k].data + c.T, static_cast<S>(12345.0));
    out[k] = grads[k].data;
  }
  {
    HostDevice dev;
    lossagg::cuda::launch_reduce_terms_backward<S, acc_t>(
        dev, layout, seg, out.data(), in.mask.data, &upstream, d.data(), weighted ? w.data() : static_cast<const acc_t*>(nullptr),
        coefficients.data());
  }
  bool grad_ok = true;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t s = 0; s < c.B; ++s) {
      const acc_t coef = lossagg::term_grad(upstream, coefficients[k], d[k * c.B + s], weighted ? &w[k * c.B + s] : nullptr);
      for (int64_t t = seg_begin(c, s); t < seg_end(c, s); ++t) {
        const double want_g = in.m64[t] == 0.0 ? 0.0 : to_double(static_cast<S>(static_cast<acc_t>(in.m64[t]) * coef));
        grad_ok = grad_ok && to_double(grads[k].data[t]) == want_g;
      }
    }
  }
  expect(grad_ok, "reduce_terms_backward writes m[t] * ((g * c_k) / d[k, s]) * w[k, s] to every token of every term");
}

template <typename S, typename M>
void run_case(const Case& c, uint64_t case_seed) {
  using acc_t = lossagg::acc_t_of<S>;
  const double rtol = std::is_same_v<acc_t, double> ? 1e-12 : 2e-6;
  Inputs<S, M> in(c);
  const auto seg = in.segments(c);
  const auto layout = in.layout(c);
  std::vector<double> ref, ref_abs;
  reference_sums(c, in.v64, in.m64, ref, ref_abs);

  // segment_sum, in three block orders: same bits, each close to the reference.
  std::vector<std::vector<acc_t>> outs;
  for (BlockOrder order : {BlockOrder::InOrder, BlockOrder::Reversed, BlockOrder::Shuffled}) {
    std::vector<acc_t> out(static_cast<size_t>(c.K * c.B), acc_t(12345));
    HostDevice dev(order, case_seed);
    if (c.K * c.B > 0) {
      lossagg::cuda::launch_segment_sum<acc_t>(dev, layout, seg, in.values.data, in.mask.data, out.data());
    }
    outs.push_back(std::move(out));
  }
  bool sums_ok = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    sums_ok = sums_ok && close(outs[0][i], ref[i], ref_abs[i], rtol);
  }
  expect(sums_ok, "segment_sum matches the float64 reference");
  expect(
      outs[0].empty() || (std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(acc_t)) == 0 &&
                          std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * sizeof(acc_t)) == 0),
      "segment_sum bitwise identical across block orders");

  // reduce (K == 1 view of metric 0), three block orders and a rerun.
  std::vector<double> denoms(static_cast<size_t>(c.B));
  std::vector<acc_t> denoms_acc(static_cast<size_t>(c.B));
  double want = 0.0, scale = 0.0;
  for (int64_t s = 0; s < c.B; ++s) {
    denoms_acc[s] = static_cast<acc_t>(static_cast<float>(1.0 + 10.0 * std::uniform_real_distribution<double>(0.0, 1.0)(rng)));
    denoms[s] = denoms_acc[s];
    want += ref[s] / denoms[s];
    scale += ref_abs[s] / denoms[s];
  }
  TokenLayout one = layout;
  one.num_metrics = 1;
  one.has_metric_dim = false;
  std::vector<acc_t> results;
  for (BlockOrder order : {BlockOrder::InOrder, BlockOrder::Reversed, BlockOrder::Shuffled, BlockOrder::InOrder}) {
    acc_t result = acc_t(12345);
    HostDevice dev(order, case_seed + 1);
    lossagg::cuda::launch_reduce<acc_t>(dev, one, seg, in.values.data, in.mask.data, denoms_acc.data(), &result);
    results.push_back(result);
  }
  expect(close(results[0], want, scale, rtol), "reduce matches the float64 reference");
  bool same = true;
  for (acc_t r : results) {
    same = same && std::memcmp(&r, &results[0], sizeof(acc_t)) == 0;
  }
  expect(same, "reduce bitwise identical across block orders and reruns");

  // segment_sum_and_count (the K == 1 view of metric 0): segment_sum's bits and the exact
  // kept tokens of each segment, in every block order.
  std::vector<int64_t> want_counts(static_cast<size_t>(c.B), 0);
  for (int64_t s = 0; s < c.B; ++s) {
    for (int64_t t = seg_begin(c, s); t < seg_end(c, s); ++t) {
      want_counts[s] += in.m64[t] != 0.0;  // NaN counts as kept
    }
  }
  bool counts_ok = true, count_sums_same = true;
  for (BlockOrder order : {BlockOrder::InOrder, BlockOrder::Reversed, BlockOrder::Shuffled}) {
    std::vector<acc_t> sums(static_cast<size_t>(c.B), acc_t(12345));
    std::vector<int64_t> counts(static_cast<size_t>(c.B), 12345);
    HostDevice dev(order, case_seed + 2);
    if (c.B > 0) {
      lossagg::cuda::launch_segment_sum_and_count<acc_t>(dev, one, seg, in.values.data, in.mask.data, sums.data(), counts.data());
    }
    counts_ok = counts_ok && counts == want_counts;
    count_sums_same = count_sums_same && (c.B == 0 || std::memcmp(sums.data(), outs[0].data(), sums.size() * sizeof(acc_t)) == 0);
  }
  expect(counts_ok, "segment_sum_and_count: exact kept tokens in every block order");
  expect(count_sums_same, "segment_sum_and_count: the sums have segment_sum's bits in every block order");

  // segment_sum_backward: out[k, t] = m[t] * g[k, s(t)], in S.
  std::vector<acc_t> g(static_cast<size_t>(c.K * c.B));
  for (auto& x : g) {
    x = static_cast<acc_t>(std::normal_distribution<double>()(rng));
  }
  Phased<S> grad(c.K * c.T, c.values_phase);
  std::fill(grad.data, grad.data + c.K * c.T, static_cast<S>(12345.0));
  {
    HostDevice dev;
    lossagg::cuda::launch_expand<S, acc_t>(dev, layout, seg, grad.data, in.mask.data, lossagg::cuda::segment_grad<acc_t>(g.data(), c.B));
  }
  bool grad_ok = true;
  for (int64_t k = 0; k < c.K; ++k) {
    for (int64_t s = 0; s < c.B; ++s) {
      for (int64_t t = seg_begin(c, s); t < seg_end(c, s); ++t) {
        const double want_g = in.m64[t] == 0.0 ? 0.0 : to_double(static_cast<S>(static_cast<acc_t>(static_cast<acc_t>(in.m64[t]) * g[k * c.B + s])));
        grad_ok = grad_ok && to_double(grad.data[k * c.T + t]) == want_g;
      }
    }
  }
  expect(grad_ok, "segment_sum_backward writes m[t] * grad[k, s] to every token");

  // reduce_backward: grad / d[s] * m[t].
  acc_t upstream = static_cast<acc_t>(0.75);
  Phased<S> rgrad(c.T, c.values_phase);
  std::fill(rgrad.data, rgrad.data + c.T, static_cast<S>(12345.0));
  {
    HostDevice dev;
    lossagg::cuda::launch_expand<S, acc_t>(
        dev, one, seg, rgrad.data, in.mask.data, lossagg::cuda::grad_over_denom<acc_t>(&upstream, denoms_acc.data()));
  }
  bool rgrad_ok = true;
  for (int64_t s = 0; s < c.B; ++s) {
    const acc_t coef = upstream / denoms_acc[s];
    for (int64_t t = seg_begin(c, s); t < seg_end(c, s); ++t) {
      const double want_g = in.m64[t] == 0.0 ? 0.0 : to_double(static_cast<S>(static_cast<acc_t>(in.m64[t]) * coef));
      rgrad_ok = rgrad_ok && to_double(rgrad.data[t]) == want_g;
    }
  }
  expect(rgrad_ok, "reduce_backward writes grad * m[t] / d[s] to every token");

  if (c.K > 1 || case_seed % 8 == 0) {  // reduce_terms: every case of several metrics, one in eight of one
    run_terms_case<S>(c, in, seg, layout, ref, ref_abs, case_seed);
  }
}

// The gradient under a defective cu_seqlens, run with the lanes of each block in three
// orders (the GPU orders unsynchronised stores of two lanes in any way): every token is
// written, every tile of kTileTokens tokens is NaN throughout or holds no NaN at all (the
// incoming gradient and the denominators are finite, so a NaN comes only from a tile that
// saw the defect), and the three runs agree bit for bit.
template <typename S, typename In, typename Seg, typename Layout, typename acc_t>
void expect_tiles_all_nan_or_none(const Case& c, const In& in, const Seg& seg, const Layout& layout, std::vector<acc_t>& denoms) {
  std::vector<std::vector<double>> runs;
  for (LaneOrder lanes : {LaneOrder::InOrder, LaneOrder::Reversed, LaneOrder::Shuffled}) {
    Phased<S> grad(c.T, c.values_phase);
    std::fill(grad.data, grad.data + c.T, static_cast<S>(12345.0));
    acc_t upstream = acc_t(1);
    {
      HostDevice dev(BlockOrder::InOrder, 7, lanes);
      lossagg::cuda::launch_expand<S, acc_t>(
          dev, layout, seg, grad.data, in.mask.data, lossagg::cuda::grad_over_denom<acc_t>(&upstream, denoms.data()));
    }
    std::vector<double> g(grad.data, grad.data + c.T);
    bool g_nan = false, g_written = true, tiles_whole = true;
    for (int64_t lo = 0; lo < c.T; lo += lossagg::cuda::kTileTokens) {
      const int64_t hi = std::min<int64_t>(lo + lossagg::cuda::kTileTokens, c.T);
      int64_t nans = 0;
      for (int64_t t = lo; t < hi; ++t) {
        nans += std::isnan(g[t]);
        g_written = g_written && g[t] != 12345.0;
      }
      g_nan = g_nan || nans > 0;
      tiles_whole = tiles_whole && (nans == 0 || nans == hi - lo);
    }
    expect(g_nan && g_written, "bad cu_seqlens: the gradient holds NaN, every token written");
    expect(tiles_whole, "bad cu_seqlens: each tile of the gradient is NaN throughout or holds no NaN, whatever the lane order");
    runs.push_back(std::move(g));
  }
  bool same = true;
  for (size_t r = 1; r < runs.size(); ++r) {
    same = same && std::memcmp(runs[r].data(), runs[0].data(), runs[0].size() * sizeof(double)) == 0;
  }
  expect(same, "bad cu_seqlens: the gradient is the same bits in every lane order");
}

// cu_seqlens that break the rules, with the device checks off: NaN results, every
// output written, no access out of bounds (AddressSanitizer watches).
template <typename S, typename M>
void run_bad_table_case(Case c, int defect) {
  using acc_t = lossagg::acc_t_of<S>;
  switch (defect) {
    case 0:
      c.cu[0] = uniform(1, 3);
      break;  // does not start at 0
    case 1:
      c.cu.back() += uniform(1, 2000);
      break;  // ends past T
    case 2:
      c.cu.back() -= uniform(1, 2000);
      break;  // ends before T (negative when T is small)
    case 4:
      break;    // the defect is in the case as given
    default: {  // decreasing somewhere
      const int64_t i = uniform(1, static_cast<int64_t>(c.cu.size()) - 2);
      c.cu[i] = c.cu[i + 1] + uniform(1, 1500);
      break;
    }
  }
  Inputs<S, M> in(c);
  const auto seg = in.segments(c);
  auto layout = in.layout(c);
  layout.num_metrics = 1;
  layout.has_metric_dim = false;
  std::vector<acc_t> out(static_cast<size_t>(c.B), acc_t(12345));
  {
    HostDevice dev;
    lossagg::cuda::launch_segment_sum<acc_t>(dev, layout, seg, in.values.data, in.mask.data, out.data());
  }
  bool any_nan = false, all_written = true;
  for (acc_t x : out) {
    any_nan = any_nan || std::isnan(static_cast<double>(x));
    all_written = all_written && x != acc_t(12345);
  }
  expect(any_nan && all_written, "bad cu_seqlens: segment_sum gives NaN, every sum written");

  std::vector<acc_t> sums(static_cast<size_t>(c.B), acc_t(12345));
  std::vector<int64_t> counts(static_cast<size_t>(c.B), 12345);
  {
    HostDevice dev;
    lossagg::cuda::launch_segment_sum_and_count<acc_t>(dev, layout, seg, in.values.data, in.mask.data, sums.data(), counts.data());
  }
  bool counts_marked = true, any_marked = false;
  for (size_t s = 0; s < counts.size(); ++s) {
    counts_marked = counts_marked && (counts[s] == -1) == std::isnan(static_cast<double>(sums[s]));
    any_marked = any_marked || counts[s] == -1;
  }
  expect(any_marked && counts_marked, "bad cu_seqlens: segment_sum_and_count gives count -1 exactly where the sum is NaN");

  std::vector<acc_t> denoms(static_cast<size_t>(c.B), acc_t(2));
  acc_t result = acc_t(12345);
  {
    HostDevice dev;
    lossagg::cuda::launch_reduce<acc_t>(dev, layout, seg, in.values.data, in.mask.data, denoms.data(), &result);
  }
  expect(std::isnan(static_cast<double>(result)), "bad cu_seqlens: reduce gives NaN");

  if (c.T > 0) {
    expect_tiles_all_nan_or_none<S>(c, in, seg, layout, denoms);
  }
}

// The four mask kinds the kernels are built for.
template <typename S>
void run_with_mask(const Case& c, uint64_t seed, int mask_kind) {
  switch (mask_kind) {
    case 0:
      return run_case<S, BoolMask>(c, seed);
    case 1:
      return run_case<S, uint8_t>(c, seed);
    case 2:
      return run_case<S, lossagg::acc_t_of<S>>(c, seed);
    default:
      return run_case<S, int64_t>(c, seed);
  }
}

void run_any(const Case& c, uint64_t seed, int values_kind, int mask_kind) {
  switch (values_kind) {
    case 0:
      return run_with_mask<float>(c, seed, mask_kind);
    case 1:
      return run_with_mask<double>(c, seed, mask_kind);
    case 2:
      return run_with_mask<c10::Half>(c, seed, mask_kind);
    default:
      return run_with_mask<c10::BFloat16>(c, seed, mask_kind);
  }
}

const char* kValues[] = {"float32", "float64", "float16", "bfloat16"};
const char* kMasks[] = {"bool", "uint8", "floating (accumulation dtype)", "int64"};

}  // namespace

int main(int argc, char** argv) {
  // test_kernels [cases [seed [shard shards [bad_tables]]]]: scripts/ctest.sh passes the tier's numbers
  const int cases = argc > 1 ? std::atoi(argv[1]) : 200;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20261130;
  const int shard = argc > 3 ? std::atoi(argv[3]) : 0;
  const int shards = argc > 4 ? std::max(1, std::atoi(argv[4])) : 1;
  const int bad_tables = argc > 5 ? std::atoi(argv[5]) : 60;
  auto seed_case = [&](uint64_t kind, int i) { rng.seed(seed * 1000003ULL + kind * 1000000007ULL + static_cast<uint64_t>(i)); };

  for (int i = shard; i < cases; i += shards) {
    seed_case(0, i);
    const bool packed = uniform(0, 3) != 0;
    // B up to several fix-up blocks (64 segments each) in one case in eight.
    const Case c = random_case(packed, uniform(0, 7) == 0 ? 5 * lossagg::cuda::kSegmentsPerBlock : 40);
    const int vk = static_cast<int>(uniform(0, 3)), mk = static_cast<int>(uniform(0, 3));
    case_name = "case " + std::to_string(i) + ": B=" + std::to_string(c.B) + " K=" + std::to_string(c.K) + " T=" + std::to_string(c.T) +
                (packed ? (c.cu_int64 ? " packed64" : " packed32") : " padded row_len=" + std::to_string(c.row_len)) + " values=" + kValues[vk] +
                " mask=" + kMasks[mk] + " phases=" + std::to_string(c.values_phase) + "/" + std::to_string(c.mask_phase);
    run_any(c, seed + i, vk, mk);
  }

  // Invalid tables, every defect, with the device checks off.
  for (int i = shard; i < bad_tables; i += shards) {
    seed_case(1, i);
    Case c = random_case(true, 150);
    if (c.B < 2) {
      c = random_case(true, 150);
      if (c.B < 2) {
        continue;
      }
    }
    const int defect = i % 4;
    case_name = "bad table " + std::to_string(i) + ": defect " + std::to_string(defect) + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T);
    if (i % 2) {
      run_bad_table_case<float, BoolMask>(c, defect);
    } else {
      run_bad_table_case<c10::BFloat16, float>(c, defect);
    }
  }

  if (shard == 0) {  // a table whose walk fails late in a tile, after segments were written
    for (int64_t back : {500, 1500, 1999}) {
      Case c;
      c.B = 3;
      c.cu = {0, 2000, back, 3000};
      c.T = 3000;
      case_name = "bad table: cu_seqlens [0, 2000, " + std::to_string(back) + ", 3000]";
      run_bad_table_case<float, BoolMask>(c, 4);
      run_bad_table_case<c10::BFloat16, float>(c, 4);
    }
  }

  if (shard == 0) {  // tokens but no segment: cu_seqlens = [0] with T = 5
    Case c;
    c.B = 0;
    c.cu = {0};
    c.T = 5;
    case_name = "bad table: no segment for 5 tokens";
    Inputs<float, BoolMask> in(c);
    float result = 12345.0f;
    HostDevice dev;
    lossagg::cuda::launch_reduce<float>(dev, in.layout(c), in.segments(c), in.values.data, in.mask.data, static_cast<const float*>(nullptr), &result);
    expect(std::isnan(result), "bad cu_seqlens with no segment: reduce gives NaN");
    std::vector<float> grad(5, 12345.0f);
    float upstream = 1.0f;
    lossagg::cuda::launch_expand<float, float>(
        dev, in.layout(c), in.segments(c), grad.data(), in.mask.data, lossagg::cuda::grad_over_denom<float>(&upstream, nullptr));
    bool all_nan = true;
    for (float x : grad) {
      all_nan = all_nan && std::isnan(x);
    }
    expect(all_nan, "bad cu_seqlens with no segment: every gradient is NaN");
  }

  // More metrics than the gridDim.y limit (lowered for this build, see CMakeLists.txt):
  // the kernels loop over the rest, forward and backward.
  if (shard == 0) {
    Case c;
    c.K = lossagg::cuda::kMaxGridY + 3;
    c.B = 2;
    c.cu = {0, 2, 3};
    c.T = 3;
    case_name = "K beyond gridDim.y";
    seed_case(2, 0);
    Inputs<float, BoolMask> in(c);
    std::vector<double> ref, abs;
    reference_sums(c, in.v64, in.m64, ref, abs);
    std::vector<float> out(static_cast<size_t>(c.K * c.B), 12345.0f);
    HostDevice dev;
    lossagg::cuda::launch_segment_sum<float>(dev, in.layout(c), in.segments(c), in.values.data, in.mask.data, out.data());
    bool ok = true;
    for (size_t i = 0; i < ref.size(); ++i) {
      ok = ok && close(out[i], ref[i], abs[i], 2e-6);
    }
    expect(ok, "segment_sum with K beyond gridDim.y matches the reference");
    std::vector<float> g(static_cast<size_t>(c.K * c.B), 1.5f);
    std::vector<float> grad(static_cast<size_t>(c.K * c.T), 12345.0f);
    HostDevice dev2;
    lossagg::cuda::launch_expand<float, float>(
        dev2, in.layout(c), in.segments(c), grad.data(), in.mask.data, lossagg::cuda::segment_grad<float>(g.data(), c.B));
    bool gok = true;
    for (int64_t k = 0; k < c.K; ++k) {
      for (int64_t t = 0; t < c.T; ++t) {
        gok = gok && grad[k * c.T + t] == (in.m64[t] != 0.0 ? 1.5f : 0.0f);
      }
    }
    expect(gok, "segment_sum_backward with K beyond gridDim.y writes every metric");
  }

  // More terms than one chunk of the terms' launches (kMaxTermRows): the chunks add in term order.
  if (shard == 0) {
    Case c;
    c.K = lossagg::cuda::kMaxTermRows * 2 + 3;
    c.B = 5;
    c.cu = {0, 3, 1030, 1030, 2100, 2301};
    c.T = 2301;
    case_name = "reduce_terms with K beyond one chunk";
    seed_case(3, 0);
    Inputs<float, BoolMask> in(c);
    std::vector<double> ref, abs;
    reference_sums(c, in.v64, in.m64, ref, abs);
    run_terms_case<float>(c, in, in.segments(c), in.layout(c), ref, abs, 99);
  }

  // The smallest case where an order of additions other than reduce's shows: x, 1, x in three
  // one-token samples (x = half an ulp of 1), d = 1. reduce adds ((0 + x) + 1) + x = 1; a tree
  // would add x + x first. Each term of reduce_terms must give reduce's 1 (docs/ops.md).
  if (shard == 0) {
    case_name = "reduce_terms adds a term as reduce adds it (x, 1, x)";
    const auto one_term = [&]<typename A>(A x) {
      const A values[3] = {x, A(1), x};
      const BoolMask mask[3] = {{1}, {1}, {1}};
      const int64_t cu[4] = {0, 1, 2, 3};
      const A d[3] = {A(1), A(1), A(1)};
      const double coefficient = 1.0;
      const Segments seg{cu, true, 0};
      const TokenLayout layout{true, 3, 3, 0, 1, false};
      A alone = A(12345), part = A(12345), total = A(12345);
      HostDevice dev;
      lossagg::cuda::launch_reduce<A>(dev, layout, seg, values, mask, d, &alone);
      const A* rows[1] = {values};
      HostDevice dev2;
      lossagg::cuda::launch_reduce_terms<A>(dev2, layout, seg, rows, mask, d, static_cast<const A*>(nullptr), &coefficient, &part, &total);
      expect(
          alone == A(1) && std::memcmp(&part, &alone, sizeof(A)) == 0 && std::memcmp(&total, &alone, sizeof(A)) == 0,
          "reduce_terms: J_0 and J have reduce's bits on x, 1, x");
    };
    one_term(std::ldexp(1.0f, -24));
    one_term(std::ldexp(1.0, -53));
  }

  std::printf("cuda_host shard %d/%d: %d passed, %d failed\n", shard, shards, passed, failed);
  return failed == 0 ? 0 : 1;
}
