// The host optimizer: AdamW, Adam and Lion in one pass over the pages, on every core, as an XLA FFI target of the
// CPU backend.
//
// Why: XLA's CPU backend emits one loop per array an update writes, and keeps intermediates two of those loops
// share in memory. The best the stage update could be arranged to (optim/flat.py) still moves 2.1x the bytes an
// AdamW update must (parameters, gradients and both moments read; parameters and moments written: 28 B per
// float32 parameter), and XLA splits a memory-bound loop into at most ceil(sqrt(cores)) parts. Here each element
// is read once and written once, and every core the process may use takes chunks of the pages.
//
// The arithmetic is optax's, operation for operation, in float32 (compiled without contraction into fused
// multiply-adds, as XLA compiles it), so the results equal the XLA update's up to the last bit of an element now
// and then:
//   g  = trigger ? g : (g / norm) * max_norm                       clip_with_norm (bfloat16 gradients: in bfloat16)
//   Adam, AdamW:
//   mu = (1 - b1) * g + b1 * mu                                     optax.tree.update_moment
//   nu = (1 - b2) * (g * g) + b2 * nu                               ... per_elem_norm, order 2
//   u  = (mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)             scale_by_adam, bias-corrected
//   Lion:
//   u  = sign((1 - b1) * g + b1 * mu); mu = (1 - b2) * g + b2 * mu  scale_by_lion
//   u  = u + wd * w                                                 add_decayed_weights (wd = 0: Adam)
//   u  = (step_size * u) * lr_scale                                 scale_by_learning_rate, the guard's lr scale
//   p  = p + u                                                      optax.apply_updates
// where w = p. With master weights (optim/factory.py `with_master_weights`: bfloat16 parameters and gradients, a
// float32 master x among the optimizer pages) the step is the master's, and the parameters follow it:
//   w  = x;  x = x + u;  d = x - p;  p = bf16(p + d)                 (the update, and its norm, is d)
// The results are written only where `apply` is set (the step's verdict, known before the update: with finite
// gradients and state the update is finite); the sum of squares of u is computed either way, per chunk in a fixed
// order, so it is the same whatever the number of threads.
//
// Operands: coeffs f32[15] (enum Coeff: the betas, bias corrections, eps, weight decay, step size, the guard's
// lr scale, the gradient norm and clip bound, whether the norm is under it, whether to apply), then P parameter
// pages, P gradient pages, O optimizer pages (1-D; parameters and gradients float32, or bfloat16 with a master;
// the master float32; the moments all float32 or all bfloat16). Results: the update's sum of squares f32[], then
// P parameter pages and O optimizer pages (aliased by the caller to the pages they replace, or buffers of their
// own, which a dropped update fills with the old values; none: only the sum of squares, nothing written).
// Attributes: `table`, per segment (a run of elements contiguous in every family) nine int64s: parameter page,
// offset in it (the gradient page and offset are the same), the master's page and offset (none: -1, 0), mu's page
// and offset, nu's page and offset (Lion: -1, 0), length. `threads`: at most this many threads (0: one per core
// this process may run on), each with at least kPerThread elements; negative: exactly that many (tests). `lion`:
// 1 for Lion, 0 for Adam(W). `master`: 1 with master weights.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Coeff { kOneMinusB1, kB1, kOneMinusB2, kB2, kBc1, kBc2, kEpsRoot, kEps, kWd, kStepSize, kLrScale, kNorm,
             kMaxNorm, kTrigger, kApply, kCount };

constexpr int64_t kChunk = 1 << 16;  // elements per unit of work
constexpr int kLanes = 16;           // independent partial sums: the sum of squares vectorises, in a fixed order
constexpr int kBlock = 256;          // elements per block of a chunk's loop (the update kept on the stack)
constexpr int64_t kPerThread = 1 << 19;  // elements a thread must have to be worth starting (~0.4 ms of work)

struct Segment {
  const void* p;  // parameters and gradients: float, or bfloat16 bits with a master
  const void* g;
  const float* x;  // the master (none: nullptr)
  const void* m;  // the moments: float, or bfloat16 bits (optimizer.state_dtype)
  const void* v;
  void* po;
  float* xo;
  void* mo;
  void* vo;
  int64_t length;
};

constexpr int kRow = 9;  // int64s per segment in the table

struct Chunk {
  int segment;
  int64_t start, stop;
};

struct Coefficients {
  float omb1, b1, omb2, b2, bc1, bc2, eps_root, eps, wd, step, lr_scale, norm, max_norm;
  float inv_norm_bf16, max_norm_bf16;  // for bfloat16 gradients: 1 / the norm rounded to bfloat16, the bound rounded
};

// Moments stored as float32 (as they are) or bfloat16 (widened exactly; rounded to nearest even, as XLA's convert
// does: optim/factory.py `stored_as`). The update uses the unrounded float32 moments, as `stored_as` does.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
template <typename M>
inline M narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline uint16_t narrow<uint16_t>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One block: new values into the block buffers (which alias nothing, so the loop vectorises), the update into u.
// Lion (optax.lion): u = sign((1 - b1) g + b1 mu), mu = (1 - b2) g + b2 mu; one moment, no bias correction.
// P: the parameters' (and gradients') element, float or bfloat16 bits; kMaster: the step is the master's.
template <bool kClip, bool kLion, typename M, typename P, bool kMaster>
inline void compute_block(int n, const Coefficients& k, const P* __restrict p, const P* __restrict g,
                          const float* __restrict x, const M* __restrict m, const M* __restrict v,
                          P* __restrict po, float* __restrict xo, M* __restrict mo, M* __restrict vo,
                          float* __restrict u) {
  for (int j = 0; j < n; ++j) {
    float gj = widen(g[j]);
    if (kClip) {
      if constexpr (std::is_same_v<P, float>) {
        gj = (gj / k.norm) * k.max_norm;
      } else {  // clip_with_norm on bfloat16 gradients computes in bfloat16, each result rounded to it; XLA divides
        // by the bfloat16 norm as a multiplication by its float32 reciprocal
        gj = widen(narrow<P>(widen(narrow<P>(gj * k.inv_norm_bf16)) * k.max_norm_bf16));
      }
    }
    const float pj = widen(p[j]);
    const float wj = kMaster ? x[j] : pj;  // the weights the optimizer steps
    float uj;
    if (kLion) {
      const float x = k.omb1 * gj + k.b1 * widen(m[j]);
      uj = x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x;  // jnp.sign: zeros and NaN as they are
      mo[j] = narrow<M>(k.omb2 * gj + k.b2 * widen(m[j]));
    } else {
      const float mj = k.omb1 * gj + k.b1 * widen(m[j]);
      const float vj = k.omb2 * (gj * gj) + k.b2 * widen(v[j]);
      uj = (mj / k.bc1) / (std::sqrt(vj / k.bc2 + k.eps_root) + k.eps);
      mo[j] = narrow<M>(mj);
      vo[j] = narrow<M>(vj);
    }
    uj = uj + k.wd * wj;
    uj = (k.step * uj) * k.lr_scale;
    if (kMaster) {  // optax.apply_updates(master, u); then the parameters to it: apply_updates(p, x - p)
      const float xn = wj + uj;
      const float d = xn - pj;
      xo[j] = xn;
      po[j] = narrow<P>(pj + d);
      u[j] = d;
    } else {
      po[j] = narrow<P>(pj + uj);
      u[j] = uj;
    }
  }
}

// One chunk of one segment; returns the sum of squares of its update.
template <bool kClip, bool kLion, typename M, typename P, bool kMaster>
double run_chunk(const Segment& s, int64_t a, int64_t b, const Coefficients& k, bool apply) {
  alignas(64) float lanes[kLanes] = {0};
  alignas(64) float xb[kBlock], u[kBlock];
  alignas(64) P pb[kBlock];
  alignas(64) M mb[kBlock], vb[kBlock];
  const P* p = static_cast<const P*>(s.p);
  const P* g = static_cast<const P*>(s.g);
  const M* m = static_cast<const M*>(s.m);
  const M* v = static_cast<const M*>(s.v);  // (Lion: none)
  for (int64_t i0 = a; i0 < b; i0 += kBlock) {
    const int n = static_cast<int>(b - i0 < kBlock ? b - i0 : kBlock);
    compute_block<kClip, kLion, M, P, kMaster>(n, k, p + i0, g + i0, kMaster ? s.x + i0 : nullptr, m + i0,
                                               kLion ? nullptr : v + i0, pb, xb, mb, vb, u);
    if (apply) {  // read before written: the results may replace the operands in place
      std::memcpy(static_cast<P*>(s.po) + i0, pb, n * sizeof(P));
      if (kMaster) std::memcpy(s.xo + i0, xb, n * sizeof(float));
      std::memcpy(static_cast<M*>(s.mo) + i0, mb, n * sizeof(M));
      if (!kLion) std::memcpy(static_cast<M*>(s.vo) + i0, vb, n * sizeof(M));
    } else if (s.po != nullptr) {  // a dropped update: results in buffers of their own keep the old values
      if (s.po != s.p) std::memcpy(static_cast<P*>(s.po) + i0, p + i0, n * sizeof(P));
      if (kMaster && s.xo != s.x) std::memcpy(s.xo + i0, s.x + i0, n * sizeof(float));
      if (s.mo != s.m) std::memcpy(static_cast<M*>(s.mo) + i0, m + i0, n * sizeof(M));
      if (!kLion && s.vo != s.v) std::memcpy(static_cast<M*>(s.vo) + i0, v + i0, n * sizeof(M));
    }
    int j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += u[j + l] * u[j + l];
    for (; j < n; ++j) lanes[j % kLanes] += u[j] * u[j];
  }
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename M, typename P, bool kMaster>
double run_chunk_any(const Segment& s, int64_t a, int64_t b, const float* c, bool lion) {
  const Coefficients k{c[kOneMinusB1], c[kB1], c[kOneMinusB2], c[kB2], c[kBc1], c[kBc2], c[kEpsRoot],
                       c[kEps], c[kWd], c[kStepSize], c[kLrScale], c[kNorm], c[kMaxNorm],
                       1.0f / widen(narrow<uint16_t>(c[kNorm])), widen(narrow<uint16_t>(c[kMaxNorm]))};
  const bool apply = c[kApply] != 0.0f, clip = c[kTrigger] == 0.0f;
  if (lion)
    return clip ? run_chunk<true, true, M, P, kMaster>(s, a, b, k, apply)
                : run_chunk<false, true, M, P, kMaster>(s, a, b, k, apply);
  return clip ? run_chunk<true, false, M, P, kMaster>(s, a, b, k, apply)
              : run_chunk<false, false, M, P, kMaster>(s, a, b, k, apply);
}

// Float32 parameters and moments of either width; or bfloat16 parameters with a float32 master.
double run_segment_chunk(const Segment& s, int64_t a, int64_t b, const float* c, bool lion, bool master,
                         size_t moment_width) {
  if (master)
    return moment_width == 2 ? run_chunk_any<uint16_t, uint16_t, true>(s, a, b, c, lion)
                             : run_chunk_any<float, uint16_t, true>(s, a, b, c, lion);
  return moment_width == 2 ? run_chunk_any<uint16_t, float, false>(s, a, b, c, lion)
                           : run_chunk_any<float, float, false>(s, a, b, c, lion);
}

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

// Pages are held as the bits of their values (uint32 for float32, uint16 for bfloat16: angel_jax/memory/layout.py):
// the kernel reads an unsigned page as the float of its width. Which float a 16-bit page holds is the caller's to
// know (the table is built from its layout); bfloat16 is the only 16-bit float here.
ffi::DataType AsFloat(ffi::DataType t) {
  if (t == ffi::DataType::U32) return ffi::DataType::F32;
  if (t == ffi::DataType::U16) return ffi::DataType::BF16;
  return t;
}

ffi::Error AdamWImpl(ffi::Buffer<ffi::F32> coeffs, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> sq,
                     ffi::RemainingRets rets, ffi::Span<const int64_t> table, int64_t param_pages,
                     int64_t opt_pages, int64_t threads, int64_t lion, int64_t master) {
  if (coeffs.element_count() != kCount)
    return ffi::Error::InvalidArgument("angel_host_optimizer: coeffs must hold one float32 per coefficient");
  if (table.size() % kRow != 0)
    return ffi::Error::InvalidArgument("angel_host_optimizer: table is not 9 int64s per segment");
  // No page results: the first pass of a step whose update norm is bounded (its sum of squares only).
  const bool norm_only = rets.size() == 0;
  if (static_cast<int64_t>(args.size()) != 2 * param_pages + opt_pages ||
      (!norm_only && static_cast<int64_t>(rets.size()) != param_pages + opt_pages))
    return ffi::Error::InvalidArgument("angel_host_optimizer: operand or result count differs from the page counts");
  if (norm_only && coeffs.typed_data()[kApply] != 0.0f)
    return ffi::Error::InvalidArgument("angel_host_optimizer: an update to apply needs its page results");
  // Parameters and gradients: float32, or bfloat16 with a master. Each optimizer page's dtype is checked by the
  // segments that use it: a master's float32, the moments' all float32 or all bfloat16.
  const int64_t P = param_pages;
  const ffi::DataType param_type = master ? ffi::DataType::BF16 : ffi::DataType::F32;
  std::vector<const void*> in(args.size());
  std::vector<int64_t> in_len(args.size());
  std::vector<ffi::DataType> in_type(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    in_type[i] = AsFloat(b->element_type());
    if (static_cast<int64_t>(i) < 2 * P && in_type[i] != param_type)
      return ffi::Error::InvalidArgument(master ? "angel_host_optimizer: parameter and gradient pages must be "
                                                  "bfloat16 with a master"
                                                : "angel_host_optimizer: parameter and gradient pages must be float32");
    if (static_cast<int64_t>(i) >= 2 * P && in_type[i] != ffi::DataType::F32 && in_type[i] != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("angel_host_optimizer: optimizer pages must be float32 or bfloat16");
    in[i] = b->untyped_data();
    in_len[i] = static_cast<int64_t>(b->element_count());
  }
  std::vector<void*> out(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return r.error();
    out[i] = (*r)->untyped_data();
    const size_t from = static_cast<int64_t>(i) < P ? i : i + P;
    if (AsFloat((*r)->element_type()) != in_type[from] || static_cast<int64_t>((*r)->element_count()) != in_len[from])
      return ffi::Error::InvalidArgument("angel_host_optimizer: a result page differs from its operand");
  }
  auto width = [](ffi::DataType t) -> size_t { return t == ffi::DataType::F32 ? 4 : 2; };
  auto at = [](const void* base, int64_t offset, size_t bytes) {
    return static_cast<const char*>(base) + offset * static_cast<int64_t>(bytes);
  };
  const size_t pw = width(param_type);
  size_t moment_width = 0;  // set by the first segment
  std::vector<Segment> segments;
  std::vector<Chunk> chunks;
  for (size_t k = 0; k < table.size(); k += kRow) {
    const int64_t pp = table[k], po = table[k + 1], xp = table[k + 2], xo = table[k + 3], mp = table[k + 4],
                  mo = table[k + 5], np = table[k + 6], no = table[k + 7], n = table[k + 8];
    const bool has_nu = !lion;  // Lion's rows name no nu page (-1)
    const bool inside = pp >= 0 && pp < P && mp >= 0 && mp < opt_pages && n >= 0 && po >= 0 && mo >= 0 &&
                        po + n <= in_len[pp] && mo + n <= in_len[2 * P + mp] &&
                        (!has_nu || (np >= 0 && np < opt_pages && no >= 0 && no + n <= in_len[2 * P + np])) &&
                        (!master || (xp >= 0 && xp < opt_pages && xo >= 0 && xo + n <= in_len[2 * P + xp]));
    if (!inside || (master == 0) != (xp < 0))
      return ffi::Error::InvalidArgument("angel_host_optimizer: a segment lies outside its pages");
    const ffi::DataType mt = in_type[2 * P + mp];
    if (moment_width == 0) moment_width = width(mt);
    if (width(mt) != moment_width || (has_nu && in_type[2 * P + np] != mt) ||
        (master && in_type[2 * P + xp] != ffi::DataType::F32))
      return ffi::Error::InvalidArgument("angel_host_optimizer: the moments must share one dtype, the master "
                                         "float32");
    segments.push_back({at(in[pp], po, pw), at(in[P + pp], po, pw),
                        master ? static_cast<const float*>(in[2 * P + xp]) + xo : nullptr,
                        at(in[2 * P + mp], mo, moment_width),
                        has_nu ? at(in[2 * P + np], no, moment_width) : nullptr,
                        norm_only ? nullptr : const_cast<char*>(at(out[pp], po, pw)),
                        norm_only || !master ? nullptr : static_cast<float*>(out[P + xp]) + xo,
                        norm_only ? nullptr : const_cast<char*>(at(out[P + mp], mo, moment_width)),
                        norm_only || !has_nu ? nullptr : const_cast<char*>(at(out[P + np], no, moment_width)), n});
    for (int64_t a = 0; a < n; a += kChunk)
      chunks.push_back({static_cast<int>(segments.size() - 1), a, a + kChunk < n ? a + kChunk : n});
  }
  // Results in buffers of their own (not aliased to their operands) get the operands' elements no segment covers
  // (page padding) copied over: the segments write only their own elements.
  if (!norm_only) {
    std::vector<std::vector<std::pair<int64_t, int64_t>>> covered(rets.size());
    for (size_t k = 0; k < table.size(); k += kRow) {
      const int64_t n = table[k + 8];
      covered[table[k]].push_back({table[k + 1], table[k + 1] + n});
      if (master) covered[P + table[k + 2]].push_back({table[k + 3], table[k + 3] + n});
      covered[P + table[k + 4]].push_back({table[k + 5], table[k + 5] + n});
      if (!lion) covered[P + table[k + 6]].push_back({table[k + 7], table[k + 7] + n});
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      const size_t from = static_cast<int64_t>(i) < P ? i : i + P;
      if (out[i] == in[from]) continue;
      const size_t bytes = width(in_type[from]);
      auto& spans = covered[i];
      std::sort(spans.begin(), spans.end());
      int64_t done = 0;
      spans.push_back({in_len[from], in_len[from]});
      for (const auto& [a, b] : spans) {
        if (a > done)
          std::memcpy(static_cast<char*>(out[i]) + done * bytes, static_cast<const char*>(in[from]) + done * bytes,
                      (a - done) * bytes);
        done = std::max(done, b);
      }
    }
  }
  const float* c = coeffs.typed_data();
  std::vector<double> partial(chunks.size(), 0.0);
  std::atomic<size_t> next{0};
  auto work = [&]() {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
      const Chunk& ch = chunks[i];
      partial[i] = run_segment_chunk(segments[ch.segment], ch.start, ch.stop, c, lion, master, moment_width);
    }
  };
  int64_t elements = 0;
  for (const Segment& s : segments) elements += s.length;
  // Every usable core, but no thread for less than kPerThread elements: a small stage's update is over before
  // threads would have started.
  int n_threads = threads > 0 ? static_cast<int>(threads) : usable_cores();
  if (n_threads > elements / kPerThread) n_threads = static_cast<int>(elements / kPerThread);
  if (threads < 0) n_threads = static_cast<int>(-threads);  // exactly this many (tests)
  if (static_cast<size_t>(n_threads) > chunks.size()) n_threads = static_cast<int>(chunks.size());
  if (n_threads < 1) n_threads = 1;
  std::vector<std::thread> pool;
  try {
    for (int t = 1; t < n_threads; ++t) pool.emplace_back(work);
  } catch (const std::system_error&) {
    // No more threads to be had (a process at its limit): the chunks are shared by those that started.
  }
  work();
  for (auto& t : pool) t.join();
  double total = 0.0;
  for (double x : partial) total += x;  // chunk order: independent of the threads
  *sq->typed_data() = static_cast<float>(total);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AngelHostOptimizer, AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("table")
                                  .Attr<int64_t>("param_pages")
                                  .Attr<int64_t>("opt_pages")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("lion")
                                  .Attr<int64_t>("master"));
