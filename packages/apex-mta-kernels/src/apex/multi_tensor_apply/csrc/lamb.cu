// LAMB over lists by role, math in fp32:
//   multi_tensor_lamb_stage1  [g, p, m, v, update]; apex's stage 1 alone (per-tensor decoupled
//                             decay, bias corrections of step + 1); no norms, flag not touched
//   multi_tensor_lamb_stage2  [p, update] and given per-tensor norms; apex's stage 2 alone
//   multi_tensor_lamb         [g, p, m, v]; both stages, the norms computed on the way; the
//                             update is written over g, as in apex
//   multi_tensor_lamb_mp      [g, p, m, v] or [g, p, m, v, p_model]; lr, step, the norms,
//                             found_inf and inv_scale device tensors; skipped when flagged
//
// Stage 1, per element (D = decay: none when wd == 0, L2 in adam_w_mode 0, decoupled in 1):
//   sg = g * inv_scale / clip        clip = gn > max ? gn / max : 1
//   D == L2: sg += wd * p
//   m = b1 m + b3 sg;  v = b2 v + (1 - b2) sg^2
//   u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps);  D == decoupled: u += wd * p
// Stage 2, per tensor: p -= ratio * u, ratio = lr * ||p|| / ||u|| when (use_nvlamb or wd != 0)
// and both norms are nonzero, else lr.
//
// Passes of the fused ops (apex: param norm, stage 1, update norm, stage 2 = 4 passes and 2
// more small launches per norm). Here stage 1 also sums p^2 (when the trust ratio needs it) and
// u^2 (u as stored, rounded to g's dtype) per 65536-element chunk; the last block of each tensor
// to finish (an arrival counter per tensor) adds that tensor's chunk sums in a fixed order and
// writes its two norms, so there is no norm pass and no extra launch, and results are bitwise
// reproducible. Stage 2 reads the two norms of its tensor. For all-fp32 lists that is
// 16 + 12 bytes per element in stage 1 and 8 + 4 in stage 2, against apex's 4 + 28 + 4 + 12.
// With wd == 0 and no use_nvlamb, p is not read in stage 1 and no norm is kept.
//
// noop flag: multi_tensor_lamb sets it when a chunk's sum of p^2 or u^2 is not finite (apex's
// norm kernels do) and never reads it. multi_tensor_lamb_mp skips everything when noop_flag or
// found_inf is set on entry; stage 1 records a non-finite chunk in a private word (the flag
// itself must not change while stage-1 blocks still read it), and stage 2 then sets the flag
// and skips, as apex's stage 2 skips after its mp norm kernel set the flag.
#include "checks.h"
#include "grad_plan.h"
#include "multi_tensor_apply.cuh"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>

namespace apex_mta {
namespace {

// ---- scalars -------------------------------------------------------------------------------------

// A per-step scalar: a one-element device tensor of dtype `kind`, or, when ptr is null, `host`.
struct Scalar {
  const void* ptr;
  int kind;
  float host;
};

__device__ __forceinline__ float value(const Scalar& s) {
  return s.ptr == nullptr ? s.host : read_scalar(s.ptr, s.kind);
}

// ---- stage 1 -------------------------------------------------------------------------------------

struct Stage1Args {
  float beta1, beta3, beta2, one_minus_beta2, eps;
  bool l2;                        // adam_w_mode 0 (stage1 op: decoupled)
  bool p_norm;                    // the trust ratio needs ||p||: read p even without decay
  bool reduce;                    // sum p^2 and u^2 per chunk, flag a non-finite sum
  bool norms;                     // ... and keep them: per-tensor norms to p_norms / u_norms
  bool bias_correction;           // device step only
  float weight_decay;
  const float* per_tensor_decay;  // stage1 op: the decay of each position
  Scalar gnorm, max_norm, inv_scale, found_inf;
  const int* noop;                // lamb_mp: skip when *noop or found_inf is set (else null)
  const void* step;               // device step (lamb_mp), else null and the host values below
  int step_kind;
  float log_beta1, log_beta2;
  float inv_bc1, rsqrt_bc2;
  int* flag;                      // set to 1 on a non-finite chunk sum
  float* partials;                // 2 per block of this dtype group: sum p^2, sum u^2
  int* arrivals;                  // per position: blocks of that tensor done so far
  float* p_norms;                 // per position
  float* u_norms;
};

// What every thread of a block needs; false when the step is skipped (lamb_mp, flagged).
struct Block1 {
  float gscale, inv_bc1, rsqrt_bc2, wd;
  bool decay, read_p;
};

__device__ __forceinline__ bool resolve1(const Stage1Args& a, int pos, Block1& s) {
  if (a.noop != nullptr && (*a.noop != 0 || value(a.found_inf) != 0.f)) return false;
  const float gn = value(a.gnorm), mx = value(a.max_norm);
  // Plain divisions (2 ulp under fast math): the correctly rounded ones call a slow-path
  // subroutine, and the registers saved around that call showed up as spills.
  const float clip = gn > mx ? gn / mx : 1.f;
  s.gscale = value(a.inv_scale) / clip;
  if (a.step != nullptr) {
    float bc1 = 1.f, bc2 = 1.f;
    if (a.bias_correction) {
      // 1 - beta^step as -expm1(step * log(beta)): no cancellation while beta^step is near 1
      const float step = value(Scalar{a.step, a.step_kind, 0.f});
      bc1 = -expm1f(step * a.log_beta1);
      bc2 = -expm1f(step * a.log_beta2);
    }
    s.inv_bc1 = 1.f / bc1;
    s.rsqrt_bc2 = __frsqrt_rn(bc2);
  } else {
    s.inv_bc1 = a.inv_bc1;
    s.rsqrt_bc2 = a.rsqrt_bc2;
  }
  s.wd = a.per_tensor_decay != nullptr ? a.per_tensor_decay[pos] : a.weight_decay;
  s.decay = s.wd != 0.f;
  s.read_p = s.decay || a.p_norm;
  return true;
}

enum class Decay { kNone, kL2, kDecoupled };

// One element: returns the update; m and v in place. With Decay::kNone p is not used, so an inf
// in p (read for its norm only) does not reach m, v or u, as in apex.
template <Decay D>
__device__ __forceinline__ float lamb_update(float g, float p, float& m, float& v, const Stage1Args& a,
                                             const Block1& s) {
  float sg = g * s.gscale;
  if constexpr (D == Decay::kL2) sg = fmaf(s.wd, p, sg);
  m = fmaf(a.beta1, m, a.beta3 * sg);
  v = fmaf(a.beta2, v, a.one_minus_beta2 * sg * sg);
  float u = (m * s.inv_bc1) / fmaf(sqrtf(v), s.rsqrt_bc2, a.eps);
  if constexpr (D == Decay::kDecoupled) u = fmaf(s.wd, p, u);
  return u;
}

// (a, b) summed over the block in a fixed order; valid in thread 0.
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float2 warp_sums[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  __syncthreads();  // a previous call's reads of warp_sums are done
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  if (threadIdx.x == 0) {
    for (int w = 0; w < int(blockDim.x >> 5); ++w) {
      s.x += warp_sums[w].x;
      s.y += warp_sums[w].y;
    }
  }
  return s;
}

// The block's chunk sums of p^2 and u^2: flag a non-finite one; with norms, store them and, in
// the last block of the tensor to get here, add up the tensor's sums into its two norms.
template <int DEPTH>
__device__ __forceinline__ void finish_norms(const TensorListMeta<DEPTH>& meta, int t, float sp, float su,
                                             const Stage1Args& a) {
  __shared__ bool last;
  const float2 s = block_sum2(sp, su);
  const int pos = meta.position[t];
  const int32_t nchunks = meta.block_start[t + 1] - meta.block_start[t];
  if (threadIdx.x == 0) {
    if (!isfinite(s.x) || !isfinite(s.y)) *a.flag = 1;  // racy but idempotent, as in apex
    last = false;
    if (a.norms) {
      const int64_t slot = int64_t(meta.block_offset) + blockIdx.x;
      a.partials[2 * slot] = s.x;
      a.partials[2 * slot + 1] = s.y;
      __threadfence();  // the sums are visible device-wide before the arrival is counted
      last = atomicAdd(a.arrivals + pos, 1) == nchunks - 1;
    }
  }
  __syncthreads();
  if (!last) return;
  // Every sum of this tensor is written. __ldcg reads them from L2, past this SM's L1.
  const float* first = a.partials + 2 * (int64_t(meta.block_offset) + meta.block_start[t]);
  float x = 0.f, y = 0.f;
  for (int32_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
    x += __ldcg(first + 2 * c);
    y += __ldcg(first + 2 * c + 1);
  }
  const float2 r = block_sum2(x, y);
  if (threadIdx.x == 0) {
    a.p_norms[pos] = __fsqrt_rn(r.x);
    a.u_norms[pos] = __fsqrt_rn(r.y);
  }
}

// The fast path, dtypes known at compile time. DEPTH 4: [g, p, m, v], the update written over g;
// DEPTH 5: [g, p, m, v, update], the update of g's dtype.
template <int DEPTH, typename Tg, typename Tp, typename Tm, typename Tv>
struct Stage1Functor {
  static constexpr int kU = DEPTH == 5 ? 4 : 0;
  using Tu = Tg;

  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, Stage1Args a) const {
    Block1 s;
    if (!resolve1(a, meta.position[t], s)) return;
    float sp = 0.f, su = 0.f;
    if (!s.decay) {
      run<Decay::kNone>(meta, t, start, end, a, s, sp, su);
    } else if (a.l2) {
      run<Decay::kL2>(meta, t, start, end, a, s, sp, su);
    } else {
      run<Decay::kDecoupled>(meta, t, start, end, a, s, sp, su);
    }
    if (a.reduce) finish_norms(meta, t, sp, su, a);
  }

  template <Decay D>
  __device__ __forceinline__ void run(const TensorListMeta<DEPTH>& meta, int t, int64_t start, int64_t end,
                                      const Stage1Args& a, const Block1& s, float& sp, float& su) const {
    // g and the update may be one buffer (DEPTH 4): no __restrict__; every load of an iteration
    // comes before its stores in program order.
    const Tg* gp = static_cast<const Tg*>(meta.ptr[0][t]);
    const Tp* pp = static_cast<const Tp*>(meta.ptr[1][t]);
    Tm* mp = static_cast<Tm*>(meta.ptr[2][t]);
    Tv* vp = static_cast<Tv*>(meta.ptr[3][t]);
    Tu* up = static_cast<Tu*>(meta.ptr[kU][t]);
    const bool read_p = s.read_p;

    // The widest role moves one 16-byte word per vector, a 16-bit role beside 32-bit ones 8 bytes
    // (as adam.cu). One vector of each role per thread and iteration: all-fp32 lists take 38
    // registers, so three 512-thread blocks fit on an SM (96 KB of loads in flight there); two
    // vectors per iteration took 72 registers and left one block per SM, idle through its
    // end-of-chunk reduction.
    constexpr int E = 16 / max_size<Tg, Tp, Tm, Tv>();
    constexpr int64_t kStride = int64_t(kThreads) * E;

    int64_t i = start;
    const bool aligned = aligned16(gp) && aligned16(mp) && aligned16(vp) && aligned16(up) &&
                         (!read_p || aligned16(pp));
    if (aligned) {
      const int64_t vec_end = start + (end - start) / E * E;
      for (int64_t j = start + int64_t(threadIdx.x) * E; j < vec_end; j += kStride) {
        float g[E], p[E], m[E], v[E];
        load_elems<E>(gp + j, g);
        if (read_p) {
          load_elems<E>(pp + j, p);
        } else {
#pragma unroll
          for (int k = 0; k < E; ++k) p[k] = 0.f;
        }
        load_elems<E>(mp + j, m);
        load_elems<E>(vp + j, v);
#pragma unroll
        for (int k = 0; k < E; ++k) {
          const float x = round_to<Tu>(lamb_update<D>(g[k], p[k], m[k], v[k], a, s));
          su = fmaf(x, x, su);
          sp = fmaf(p[k], p[k], sp);
          g[k] = x;
        }
        store_elems<E>(up + j, g);
        store_elems<E>(mp + j, m);
        store_elems<E>(vp + j, v);
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      const float g = to_float(gp[j]);
      const float p = read_p ? to_float(pp[j]) : 0.f;
      float m = to_float(mp[j]), v = to_float(vp[j]);
      const float x = round_to<Tu>(lamb_update<D>(g, p, m, v, a, s));
      su = fmaf(x, x, su);
      sp = fmaf(p, p, sp);
      up[j] = from_float<Tu>(x);
      mp[j] = from_float<Tm>(m);
      vp[j] = from_float<Tv>(v);
    }
  }
};

// Any other dtype mix: dtypes read at run time, one element at a time. Correct, not tuned.
template <int DEPTH>
struct Stage1AnyFunctor {
  static constexpr int kU = DEPTH == 5 ? 4 : 0;
  int kinds[DEPTH];

  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, Stage1Args a) const {
    Block1 s;
    if (!resolve1(a, meta.position[t], s)) return;
    float sp = 0.f, su = 0.f;
    if (!s.decay) {
      run<Decay::kNone>(meta, t, start, end, a, s, sp, su);
    } else if (a.l2) {
      run<Decay::kL2>(meta, t, start, end, a, s, sp, su);
    } else {
      run<Decay::kDecoupled>(meta, t, start, end, a, s, sp, su);
    }
    if (a.reduce) {
      // The tensor is located again here rather than kept live through the loop: ptxas held
      // this kernel to 40 registers by spilling t. (An asm read of the block index, so the
      // compiler cannot reuse the first result.)
      int32_t b;
      asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
      finish_norms(meta, locate(meta, b), sp, su, a);
    }
  }

  template <Decay D>
  __device__ __forceinline__ void run(const TensorListMeta<DEPTH>& meta, int t, int64_t start, int64_t end,
                                      const Stage1Args& a, const Block1& s, float& sp, float& su) const {
    void* ptr[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) ptr[d] = meta.ptr[d][t];
    for (int64_t j = start + threadIdx.x; j < end; j += kThreads) {
      const float g = load_any(ptr[0], kinds[0], j);
      const float p = s.read_p ? load_any(ptr[1], kinds[1], j) : 0.f;
      float m = load_any(ptr[2], kinds[2], j), v = load_any(ptr[3], kinds[3], j);
      const float x = round_any(lamb_update<D>(g, p, m, v, a, s), kinds[kU]);
      su = fmaf(x, x, su);
      sp = fmaf(p, p, sp);
      store_any(ptr[kU], kinds[kU], j, x);
      store_any(ptr[2], kinds[2], j, m);
      store_any(ptr[3], kinds[3], j, v);
    }
  }
};

// ---- stage 2 -------------------------------------------------------------------------------------

struct Stage2Args {
  const float* p_norms;  // per position
  const float* u_norms;
  Scalar lr;
  bool trust;            // use_nvlamb or weight_decay != 0
  // lamb_mp: skip when *noop, found_inf or *bad (stage 1's non-finite chunk) is set, and then
  // raise the flag for a bad chunk. null for the other ops.
  const int* noop;
  Scalar found_inf;
  const int* bad;
  int* noop_out;
};

// False when skipped; else the tensor's step size.
__device__ __forceinline__ bool resolve2(const Stage2Args& a, int pos, float& ratio) {
  if (a.noop != nullptr) {
    // Blocks of this launch may see the flag raised here by another block: they skip either way.
    const bool bad = *a.bad != 0;
    if (bad && threadIdx.x == 0) *a.noop_out = 1;
    if (bad || *a.noop != 0 || value(a.found_inf) != 0.f) return false;
  }
  const float lr = value(a.lr);
  ratio = lr;
  if (a.trust) {
    const float pn = a.p_norms[pos], un = a.u_norms[pos];
    if (pn != 0.f && un != 0.f) ratio = lr * (pn / un);
  }
  return true;
}

// DEPTH 2: [u, p]. DEPTH 3: [u, p, p_model], p_model = the new p rounded (written, never read).
template <int DEPTH, typename Tu, typename Tp, typename Tw>
struct Stage2Functor {
  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, Stage2Args a) const {
    float ratio;
    if (!resolve2(a, meta.position[t], ratio)) return;
    const Tu* __restrict__ up = static_cast<const Tu*>(meta.ptr[0][t]);
    Tp* __restrict__ pp = static_cast<Tp*>(meta.ptr[1][t]);
    Tw* __restrict__ wp = nullptr;
    if constexpr (DEPTH == 3) wp = static_cast<Tw*>(meta.ptr[2][t]);

    // U vectors of each role per thread and iteration: 8 elements for [u, p]; one vector for
    // [u, p, p_model] (with two vectors ptxas held the 3-list kernel to 32 registers by spilling).
    constexpr int E = 16 / max_size<Tu, Tp, std::conditional_t<DEPTH == 3, Tw, Tu>>();
    constexpr int U = DEPTH == 3 ? 1 : 8 / E;
    constexpr int64_t kStride = int64_t(kThreads) * E;

    int64_t i = start;
    bool aligned = aligned16(up) && aligned16(pp);
    if constexpr (DEPTH == 3) aligned = aligned && aligned16(wp);
    if (aligned) {
      const int64_t vec_end = start + (end - start) / E * E;
      for (int64_t base = start + int64_t(threadIdx.x) * E; base < vec_end; base += kStride * U) {
        float u[U][E], p[U][E];
#pragma unroll
        for (int k = 0; k < U; ++k) {
          const int64_t j = base + k * kStride;
          if (j < vec_end) {
            load_elems<E>(up + j, u[k]);
            load_elems<E>(pp + j, p[k]);
          }
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
          const int64_t j = base + k * kStride;
          if (j < vec_end) {
#pragma unroll
            for (int e = 0; e < E; ++e) p[k][e] = fmaf(-ratio, u[k][e], p[k][e]);
            store_elems<E>(pp + j, p[k]);
            if constexpr (DEPTH == 3) store_elems<E>(wp + j, p[k]);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      const float p = fmaf(-ratio, to_float(up[j]), to_float(pp[j]));
      pp[j] = from_float<Tp>(p);
      if constexpr (DEPTH == 3) wp[j] = from_float<Tw>(p);
    }
  }
};

template <int DEPTH>
struct Stage2AnyFunctor {
  int kinds[DEPTH];

  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& meta, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, Stage2Args a) const {
    float ratio;
    if (!resolve2(a, meta.position[t], ratio)) return;
    void* ptr[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) ptr[d] = meta.ptr[d][t];
    for (int64_t j = start + threadIdx.x; j < end; j += kThreads) {
      const float p = fmaf(-ratio, load_any(ptr[0], kinds[0], j), load_any(ptr[1], kinds[1], j));
      store_any(ptr[1], kinds[1], j, p);
      if constexpr (DEPTH == 3) store_any(ptr[2], kinds[2], j, p);
    }
  }
};

// ---- host ---------------------------------------------------------------------------------------

int64_t chunks(const at::Tensor& t) { return (t.numel() + kChunk - 1) / kChunk; }

// Pass 1 over `lists` (g, p, m, v[, update]), one launch group per dtype mix.
template <int DEPTH>
void stage1(const std::vector<ListArg>& lists, Stage1Args a) {
  std::array<const std::vector<at::Tensor>*, DEPTH> ptrs;
  for (int d = 0; d < DEPTH; ++d) ptrs[d] = lists[d].list;
  const std::vector<at::Tensor>& g = *lists[0].list;
  for (const auto& [dt, idx] : group_by_dtype(lists)) {
    // Fast path: m and v both fp32 or both p's dtype; any g and p (DEPTH 4), or g, p and the
    // update of one dtype (DEPTH 5, the legacy stage-1 op): 15 and 5 instantiations.
    const bool mv = dt[2] == dt[3] && (dt[2] == at::kFloat || dt[2] == dt[1]);
    bool fast = mv;
    if constexpr (DEPTH == 5) fast = fast && dt[1] == dt[0] && dt[4] == dt[0];
    if (!fast) {
      Stage1AnyFunctor<DEPTH> f{};
      for (int d = 0; d < DEPTH; ++d) f.kinds[d] = kind_of(dt[d]);
      launch<DEPTH>(ptrs, idx, f, a);
    } else if constexpr (DEPTH == 5) {
      APEX_DISPATCH_FLOAT(dt[0], T, [&] {
        if (dt[2] == at::kFloat) {
          launch<5>(ptrs, idx, Stage1Functor<5, T, T, float, float>{}, a);
        } else {
          launch<5>(ptrs, idx, Stage1Functor<5, T, T, T, T>{}, a);
        }
      });
    } else {
      APEX_DISPATCH_FLOAT(dt[0], Tg, [&] {
        APEX_DISPATCH_FLOAT(dt[1], Tp, [&] {
          if (dt[2] == at::kFloat) {
            launch<4>(ptrs, idx, Stage1Functor<4, Tg, Tp, float, float>{}, a);
          } else {
            launch<4>(ptrs, idx, Stage1Functor<4, Tg, Tp, Tp, Tp>{}, a);
          }
        });
      });
    }
    if (a.partials != nullptr) {
      for (int64_t i : idx) a.partials += 2 * chunks(g[i]);
    }
  }
}

// Pass 2 over `lists` (u, p[, p_model]).
template <int DEPTH>
void stage2(const std::vector<ListArg>& lists, const Stage2Args& a) {
  std::array<const std::vector<at::Tensor>*, DEPTH> ptrs;
  for (int d = 0; d < DEPTH; ++d) ptrs[d] = lists[d].list;
  for (const auto& [dt, idx] : group_by_dtype(lists)) {
    // Fast path: any u and p (DEPTH 2); any u and p_model beside an fp32 p (DEPTH 3).
    if (DEPTH == 3 && dt[1] != at::kFloat) {
      Stage2AnyFunctor<DEPTH> f{};
      for (int d = 0; d < DEPTH; ++d) f.kinds[d] = kind_of(dt[d]);
      launch<DEPTH>(ptrs, idx, f, a);
      continue;
    }
    APEX_DISPATCH_FLOAT(dt[0], Tu, [&] {
      if constexpr (DEPTH == 2) {
        APEX_DISPATCH_FLOAT(dt[1], Tp, [&] { launch<2>(ptrs, idx, Stage2Functor<2, Tu, Tp, Tp>{}, a); });
      } else {
        APEX_DISPATCH_FLOAT(dt[2], Tw, [&] { launch<3>(ptrs, idx, Stage2Functor<3, Tu, float, Tw>{}, a); });
      }
    });
  }
}

// ---- argument checks (the same rules and words as reference.py) ----

void check_betas(const char* op, double beta1, double beta2) {
  APEX_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  APEX_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
}

void check_mode(const char* op, int64_t mode) {
  APEX_CHECK_VALUE(mode == 0 || mode == 1, op,
                   ": adam_w_mode must be 0 (L2 weight decay) or 1 (decoupled, AdamW), got ", mode);
}

// A float32 tensor of one value per tensor of the lists (per_tensor_decay, the norms).
void check_per_tensor(const char* op, const char* name, const at::Tensor& t, size_t n, const char* list_name,
                      const at::Tensor& noop_flag) {
  APEX_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " must be a float32 tensor, got ",
                  dtype_str(t.scalar_type()));
  APEX_CHECK_VALUE(t.device() == noop_flag.device(), op, ": ", name, " is on ", t.device(),
                   " but noop_flag is on ", noop_flag.device(), "; every tensor must be on one device");
  APEX_CHECK_VALUE(t.numel() == static_cast<int64_t>(n), op, ": ", name, " has ", t.numel(), " elements but ",
                   list_name, " has ", n, " tensors; one value per tensor is required");
  APEX_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " is not contiguous");
}

Scalar device_scalar(const at::Tensor& t) { return {t.data_ptr(), kind_of(t.scalar_type()), 0.f}; }
Scalar host_scalar(double v) { return {nullptr, kF32, static_cast<float>(v)}; }

Stage1Args base_args(double beta1, double beta2, double eps, bool grad_averaging) {
  Stage1Args a{};
  a.beta1 = static_cast<float>(beta1);
  a.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.inv_scale = host_scalar(1.0);
  a.found_inf = host_scalar(0.0);
  a.inv_bc1 = a.rsqrt_bc2 = 1.f;
  return a;
}

void host_bias_correction(Stage1Args& a, double beta1, double beta2, double step) {
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  a.inv_bc1 = static_cast<float>(1.0 / bc1);
  a.rsqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
}

int64_t total_chunks(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const at::Tensor& t : ts) n += chunks(t);
  return n;
}

bool all_empty(const std::vector<at::Tensor>& ts) {
  for (const at::Tensor& t : ts) {
    if (t.numel() != 0) return false;
  }
  return true;
}

void multi_tensor_lamb_stage1_cuda(at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
                                   at::TensorList exp_avg_sqs_, at::TensorList updates_,
                                   const at::Tensor& noop_flag, const at::Tensor& per_tensor_decay,
                                   int64_t step, double beta1, double beta2, double eps,
                                   const at::Tensor& global_grad_norm, double max_global_grad_norm) {
  const char* op = "multi_tensor_lamb_stage1";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const auto u = updates_.vec();
  const std::vector<ListArg> lists{
      {"grads", &g}, {"params", &p}, {"exp_avgs", &m}, {"exp_avg_sqs", &v}, {"updates", &u}};
  check_lists(op, lists, noop_flag);
  check_per_tensor(op, "per_tensor_decay", per_tensor_decay, g.size(), "grads", noop_flag);
  check_betas(op, beta1, beta2);
  APEX_CHECK_VALUE(step >= 0, op, ": step must be >= 0 (the bias correction uses step + 1), got ", step);
  check_scalar(op, "global_grad_norm", global_grad_norm, noop_flag, false);
  if (all_empty(g)) return;
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  Stage1Args a = base_args(beta1, beta2, eps, true);
  a.per_tensor_decay = per_tensor_decay.data_ptr<float>();
  a.gnorm = device_scalar(global_grad_norm);
  a.max_norm = host_scalar(max_global_grad_norm);
  host_bias_correction(a, beta1, beta2, static_cast<double>(step + 1));
  stage1<5>(lists, a);
}

void multi_tensor_lamb_stage2_cuda(at::TensorList params_, at::TensorList updates_, const at::Tensor& noop_flag,
                                   const at::Tensor& per_tensor_param_norm,
                                   const at::Tensor& per_tensor_update_norm, double lr, double weight_decay,
                                   bool use_nvlamb) {
  const char* op = "multi_tensor_lamb_stage2";
  const auto p = params_.vec(), u = updates_.vec();
  check_lists(op, {{"params", &p}, {"updates", &u}}, noop_flag);
  check_per_tensor(op, "per_tensor_param_norm", per_tensor_param_norm, p.size(), "params", noop_flag);
  check_per_tensor(op, "per_tensor_update_norm", per_tensor_update_norm, p.size(), "params", noop_flag);
  if (all_empty(p)) return;
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  Stage2Args b{};
  b.p_norms = per_tensor_param_norm.data_ptr<float>();
  b.u_norms = per_tensor_update_norm.data_ptr<float>();
  b.lr = host_scalar(lr);
  b.trust = use_nvlamb || weight_decay != 0.0;
  stage2<2>({{"updates", &u}, {"params", &p}}, b);
}

// Per-tensor norm workspace of the fused ops.
struct NormSpace {
  at::Tensor partials, counters, norms;
};

NormSpace norm_space(const std::vector<at::Tensor>& g, const at::Tensor& noop_flag, bool norms, bool mp) {
  const auto f32 = noop_flag.options().dtype(at::kFloat);
  const int64_t n = static_cast<int64_t>(g.size());
  NormSpace w;
  // counters: the arrival count of each position, then lamb_mp's non-finite-chunk word.
  if (norms || mp) w.counters = at::zeros({n + 1}, noop_flag.options().dtype(at::kInt));
  if (norms) {
    w.partials = at::empty({2 * total_chunks(g)}, f32);
    w.norms = at::empty({2 * n}, f32);
  }
  return w;
}

void set_norms(Stage1Args& a, Stage2Args& b, NormSpace& w, int64_t n) {
  if (!w.norms.defined()) return;
  a.partials = w.partials.data_ptr<float>();
  a.arrivals = w.counters.data_ptr<int>();
  a.p_norms = w.norms.data_ptr<float>();
  a.u_norms = a.p_norms + n;
  b.p_norms = a.p_norms;
  b.u_norms = a.u_norms;
}

// multi_tensor_lamb's checks of everything but the lists and the norm.
void check_lamb_args(const char* op, double beta1, double beta2, int64_t step, bool bias_correction,
                     int64_t adam_w_mode) {
  check_mode(op, adam_w_mode);
  check_betas(op, beta1, beta2);
  APEX_CHECK_VALUE(!bias_correction || step >= 1, op, ": step must be >= 1 when bias_correction is set, got ",
                   step);
}

// multi_tensor_lamb once its arguments are checked: [g, p, m, v] in `lists`.
void run_lamb(const std::vector<ListArg>& lists, const at::Tensor& noop_flag, double lr, double beta1,
              double beta2, double eps, int64_t step, bool bias_correction, double weight_decay,
              bool grad_averaging, int64_t adam_w_mode, const at::Tensor& global_grad_norm,
              double max_grad_norm, bool use_nvlamb) {
  const std::vector<at::Tensor>& g = *lists[0].list;
  if (all_empty(g)) return;
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const bool trust = use_nvlamb || weight_decay != 0.0;

  Stage1Args a = base_args(beta1, beta2, eps, grad_averaging);
  a.l2 = adam_w_mode == 0;
  a.weight_decay = static_cast<float>(weight_decay);
  a.p_norm = trust;
  a.reduce = true;
  a.norms = trust;
  a.gnorm = device_scalar(global_grad_norm);
  a.max_norm = host_scalar(max_grad_norm);
  if (bias_correction) host_bias_correction(a, beta1, beta2, static_cast<double>(step));
  a.flag = noop_flag.data_ptr<int>();
  Stage2Args b{};
  b.lr = host_scalar(lr);
  b.trust = trust;
  NormSpace w = norm_space(g, noop_flag, trust, false);
  set_norms(a, b, w, static_cast<int64_t>(g.size()));

  stage1<4>(lists, a);
  stage2<2>({{"grads", lists[0].list}, {"params", lists[1].list}}, b);
}

void multi_tensor_lamb_cuda(at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
                            at::TensorList exp_avg_sqs_, const at::Tensor& noop_flag, double lr, double beta1,
                            double beta2, double eps, int64_t step, bool bias_correction, double weight_decay,
                            bool grad_averaging, int64_t adam_w_mode, const at::Tensor& global_grad_norm,
                            double max_grad_norm, bool use_nvlamb) {
  const char* op = "multi_tensor_lamb";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const std::vector<ListArg> lists{{"grads", &g}, {"params", &p}, {"exp_avgs", &m}, {"exp_avg_sqs", &v}};
  check_lists(op, lists, noop_flag);
  check_lamb_args(op, beta1, beta2, step, bias_correction, adam_w_mode);
  check_scalar(op, "global_grad_norm", global_grad_norm, noop_flag, false);
  run_lamb(lists, noop_flag, lr, beta1, beta2, eps, step, bias_correction, weight_decay, grad_averaging,
           adam_w_mode, global_grad_norm, max_grad_norm, use_nvlamb);
}

void multi_tensor_lamb_mp_cuda(at::TensorList grads_, at::TensorList params_, at::TensorList exp_avgs_,
                               at::TensorList exp_avg_sqs_, at::TensorList model_params_,
                               const at::Tensor& noop_flag, const at::Tensor& lr, double beta1, double beta2,
                               double eps, const at::Tensor& step, bool bias_correction, double weight_decay,
                               bool grad_averaging, int64_t adam_w_mode, const at::Tensor& global_grad_norm,
                               const at::Tensor& max_grad_norm, bool use_nvlamb, const at::Tensor& found_inf,
                               const at::Tensor& inv_scale) {
  const char* op = "multi_tensor_lamb_mp";
  const auto g = grads_.vec(), p = params_.vec(), m = exp_avgs_.vec(), v = exp_avg_sqs_.vec();
  const auto w16 = model_params_.vec();
  std::vector<ListArg> lists{{"grads", &g}, {"params", &p}, {"exp_avgs", &m}, {"exp_avg_sqs", &v}};
  const bool with_model = !w16.empty();
  if (with_model) lists.push_back({"model_params", &w16});
  check_lists(op, lists, noop_flag);
  check_mode(op, adam_w_mode);
  check_betas(op, beta1, beta2);
  check_scalar(op, "lr", lr, noop_flag, false);
  check_scalar(op, "step", step, noop_flag, true);
  check_scalar(op, "global_grad_norm", global_grad_norm, noop_flag, false);
  check_scalar(op, "max_grad_norm", max_grad_norm, noop_flag, false);
  check_scalar(op, "found_inf", found_inf, noop_flag, false);
  check_scalar(op, "inv_scale", inv_scale, noop_flag, false);
  if (all_empty(g)) return;
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const bool trust = use_nvlamb || weight_decay != 0.0;

  Stage1Args a = base_args(beta1, beta2, eps, grad_averaging);
  a.l2 = adam_w_mode == 0;
  a.weight_decay = static_cast<float>(weight_decay);
  a.p_norm = trust;
  a.reduce = true;
  a.norms = trust;
  a.gnorm = device_scalar(global_grad_norm);
  a.max_norm = device_scalar(max_grad_norm);
  a.inv_scale = device_scalar(inv_scale);
  a.found_inf = device_scalar(found_inf);
  a.noop = noop_flag.data_ptr<int>();
  a.step = step.data_ptr();
  a.step_kind = kind_of(step.scalar_type());
  a.bias_correction = bias_correction;
  a.log_beta1 = static_cast<float>(std::log(beta1));
  a.log_beta2 = static_cast<float>(std::log(beta2));
  NormSpace w = norm_space(g, noop_flag, trust, true);
  int* bad = w.counters.data_ptr<int>() + g.size();
  a.flag = bad;
  Stage2Args b{};
  b.lr = device_scalar(lr);
  b.trust = trust;
  b.noop = a.noop;
  b.found_inf = a.found_inf;
  b.bad = bad;
  b.noop_out = noop_flag.data_ptr<int>();
  set_norms(a, b, w, static_cast<int64_t>(g.size()));

  stage1<4>(std::vector<ListArg>(lists.begin(), lists.begin() + 4), a);
  if (with_model) {
    stage2<3>({{"grads", &g}, {"params", &p}, {"model_params", &w16}}, b);
  } else {
    stage2<2>({{"grads", &g}, {"params", &p}}, b);
  }
}

// Ops of other files of this library, called through the dispatcher (no Python, no list
// conversion): the global grad norm is multi_tensor_l2norm's, bit for bit, and the master copy
// multi_tensor_scale's.
at::Tensor l2norm_total(const std::vector<at::Tensor>& tensors, const at::Tensor& noop_flag) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("apex_mta::multi_tensor_l2norm", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, const at::Tensor&, bool)>();
  return std::get<0>(op.call(tensors, noop_flag, false));
}

void copy_to(const std::vector<at::Tensor>& from, const std::vector<at::Tensor>& to, const at::Tensor& noop_flag) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("apex_mta::multi_tensor_scale", "")
                             .typed<void(at::TensorList, at::TensorList, const at::Tensor&, double)>();
  op.call(from, to, noop_flag, 1.0);
}

}  // namespace

// ---- the cached plan ----------------------------------------------------------------------------
//
// A FusedLAMB bucket's lists on the C++ side (GradPlan says how a step is checked and run):
// step() is the list path's multi_tensor_l2norm (when no global norm is given: the bucket holds
// every grad of the optimizer) + multi_tensor_lamb (+ multi_tensor_scale of the masters into the
// params), on the same kernels, so the same bits. A plan made of params alone (work, exp_avgs and
// exp_avg_sqs empty) only takes the global grad norm of several buckets (grad_norm()).
class LambPlan : public GradPlan {
 public:
  LambPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> work, std::vector<at::Tensor> exp_avgs,
           std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> copies)
      : GradPlan(std::move(params)), work_(std::move(work)), m_(std::move(exp_avgs)),
        v_(std::move(exp_avg_sqs)), copies_(std::move(copies)) {
    const size_t n = params_.size();
    norm_only_ = work_.empty() && m_.empty() && v_.empty() && copies_.empty();
    APEX_CHECK_VALUE(norm_only_ || (work_.size() == n && m_.size() == n && v_.size() == n), "LambPlan: params has ",
                     n, " tensors but work, exp_avgs and exp_avg_sqs have ", work_.size(), ", ", m_.size(),
                     " and ", v_.size(), " (all ", n, ", or all 0 for a plan of the grad norm only)");
    APEX_CHECK_VALUE(copies_.empty() || copies_.size() == n, "LambPlan: copies has ", copies_.size(),
                     " tensors; expected 0 or ", n);
  }

  // ||every grad|| (multi_tensor_l2norm's total), or None when a param has no grad.
  c10::optional<at::Tensor> grad_norm(at::Tensor noop_flag) {
    const Release release{this};
    if (!ensure_fetched()) return c10::nullopt;
    return l2norm_total(grads_, noop_flag);
  }

  // multi_tensor_lamb on [grads, work, exp_avgs, exp_avg_sqs]; with no global_grad_norm, that
  // of this plan's grads, taken first. False (nothing launched): a param has no grad.
  bool step(at::Tensor noop_flag, double lr, double beta1, double beta2, double eps, int64_t step,
            bool bias_correction, double weight_decay, bool grad_averaging, int64_t adam_w_mode,
            c10::optional<at::Tensor> global_grad_norm, double max_grad_norm, bool use_nvlamb) {
    const char* op = "multi_tensor_lamb";
    const Release release{this};
    APEX_CHECK_VALUE(!norm_only_, "LambPlan: this plan holds params only (a plan of the grad norm); it cannot step");
    check_lamb_args(op, beta1, beta2, step, bias_correction, adam_w_mode);
    const std::vector<ListArg> lists{{"grads", &grads_}, {"params", &work_}, {"exp_avgs", &m_}, {"exp_avg_sqs", &v_}};
    // Every check before the first launch: bad input leaves everything untouched.
    if (!prepare(op, noop_flag, 1, lists)) return false;
    if (global_grad_norm.has_value()) check_scalar(op, "global_grad_norm", *global_grad_norm, noop_flag, false);
    const at::Tensor gnorm = global_grad_norm.has_value() ? *global_grad_norm : l2norm_total(grads_, noop_flag);
    run_lamb(lists, noop_flag, lr, beta1, beta2, eps, step, bias_correction, weight_decay, grad_averaging,
             adam_w_mode, gnorm, max_grad_norm, use_nvlamb);
    if (!copies_.empty()) copy_to(work_, copies_, noop_flag);
    return true;
  }

 private:
  std::vector<at::Tensor> work_, m_, v_, copies_;
  bool norm_only_ = false;
};

}  // namespace apex_mta

TORCH_LIBRARY_FRAGMENT(apex_mta, m) {
  auto c = m.class_<apex_mta::LambPlan>("LambPlan")
               .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                                std::vector<at::Tensor>, std::vector<at::Tensor>>())
               .def("grad_norm", &apex_mta::LambPlan::grad_norm)
               .def("step", &apex_mta::LambPlan::step);
  apex_mta::def_grad_plan_methods(c);
}

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_lamb_stage1", &apex_mta::multi_tensor_lamb_stage1_cuda);
  m.impl("multi_tensor_lamb_stage2", &apex_mta::multi_tensor_lamb_stage2_cuda);
  m.impl("multi_tensor_lamb", &apex_mta::multi_tensor_lamb_cuda);
  m.impl("multi_tensor_lamb_mp", &apex_mta::multi_tensor_lamb_mp_cuda);
}
