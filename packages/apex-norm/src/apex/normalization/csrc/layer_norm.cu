// LayerNorm and RMSNorm, forward and backward, for float32, float16 and bfloat16 in any mix.
//
// One group of TX threads (a warp or more; in the forward, as few as one thread for short rows)
// owns a row; a block holds TY such groups. The input dtype is a template parameter; weight,
// bias and output dtypes are read at run time (a uniform branch per access, free next to the
// memory traffic), which keeps the number of instantiations small while any dtype combination
// works. Statistics and sums are float32.
//
// Fast path ("fast"): H % 8 == 0 and every pointer aligned to 8 elements. Each thread keeps its
// NV vectors of 8 elements of a row in registers in the input's own dtype (16-bit data stays
// packed: half the registers of float32), so the row is read from memory once. The backward's
// grid is persistent (what fits on the GPU at once): each row group walks the rows r, r + G, ...,
// summing the weight gradients as it goes, and issues the loads of its next row before the
// current row is reduced and written. The forward's grid can be persistent too (APEX_NORM_TUNE
// fwd_waves, without the prefetch), but a block per rows measured faster (see Tune). A row's
// sums take one barrier (two alternating shared-memory slots), and LayerNorm's mean and variance
// come from one reduction: for 16-bit input the sums of d = x - x[0] and d^2 (fwd_fast's
// one_pass); for float32 each thread's (count, mean, M2), merged pairwise in a fixed order (Chan
// et al.), exact where sum and sum of squares would cancel. The backward's fast kernel wants
// grad_output in the input's dtype (the usual case); other mixes take "vec", the same layout
// without the packing and the prefetch. Otherwise ("generic"): scalar loops that read the row
// again for each pass (any H, any alignment). Indices are 64-bit throughout.
//
// Weight and bias gradients: a column reduction in two stages. Stage 1 writes float32 partial
// sums, one row of H per row group: the vectorised backward kernels accumulate them in registers
// while they compute grad_input (each group sums many rows); the generic path runs a separate
// kernel over row ranges. Stage 2 sums the partials per column, in a fixed order (the result is
// the same on every run).
#include "checks.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace apex_norm {
namespace {

enum Dt : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
constexpr int kVec = 8;        // elements per vector access (16 bytes of a 16-bit dtype)
constexpr int kMaxTX = 512;    // threads per row, at most (registers: see __launch_bounds__)

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Element e of a packed vector as float. A bfloat16 is the upper half of a float32, so each takes
// one shift or one mask of the 32-bit word holding it (static_cast spends two on the upper one of
// a pair: extract, then shift).
template <typename T>
__device__ __forceinline__ float elem(const Pack<T>& pk, int e) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(pk.v)[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    return static_cast<float>(pk.v[e]);
  }
}

template <typename T>
__device__ __forceinline__ void load_vec(const void* p, int64_t i, float (&o)[kVec]) {
  const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(static_cast<const T*>(p) + i);
#pragma unroll
  for (int k = 0; k < kVec; ++k) o[k] = elem(pk, k);
}

template <typename T>
__device__ __forceinline__ void store_vec(void* p, int64_t i, const float (&o)[kVec]) {
  Pack<T> pk;
#pragma unroll
  for (int k = 0; k < kVec; ++k) pk.v[k] = static_cast<T>(o[k]);
  *reinterpret_cast<Pack<T>*>(static_cast<T*>(p) + i) = pk;
}

__device__ __forceinline__ void load_vec_dt(const void* p, int dt, int64_t i, float (&o)[kVec]) {
  if (dt == kBF16) {
    load_vec<at::BFloat16>(p, i, o);
  } else if (dt == kF16) {
    load_vec<at::Half>(p, i, o);
  } else {
    load_vec<float>(p, i, o);
  }
}

__device__ __forceinline__ void store_vec_dt(void* p, int dt, int64_t i, const float (&o)[kVec]) {
  if (dt == kBF16) {
    store_vec<at::BFloat16>(p, i, o);
  } else if (dt == kF16) {
    store_vec<at::Half>(p, i, o);
  } else {
    store_vec<float>(p, i, o);
  }
}

__device__ __forceinline__ float load_dt(const void* p, int dt, int64_t i) {
  if (dt == kBF16) return static_cast<float>(static_cast<const at::BFloat16*>(p)[i]);
  if (dt == kF16) return static_cast<float>(static_cast<const at::Half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_dt(void* p, int dt, int64_t i, float v) {
  if (dt == kBF16) {
    static_cast<at::BFloat16*>(p)[i] = static_cast<at::BFloat16>(v);
  } else if (dt == kF16) {
    static_cast<at::Half*>(p)[i] = static_cast<at::Half>(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over this thread's group of `width` lanes of its warp (a power of two; 32 or more means the
// whole warp). The forward's row groups may be narrower than a warp (short rows).
__device__ __forceinline__ float lane_sum(float v, unsigned width) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (unsigned(o) < width) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Sum of `a` and `b` over the TX threads of this row group. Every thread of the block must call
// it (it may hold __syncthreads); blockDim.x is a multiple of 32, blockDim.x * blockDim.y <= 1024.
__device__ __forceinline__ float2 row_sum2(float a, float b, float2* smem) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (blockDim.x == 32) return make_float2(a, b);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  float2* s = smem + threadIdx.y * 32;
  if (lane == 0) s[warp] = make_float2(a, b);
  __syncthreads();
  float2 t = lane < nw ? s[lane] : make_float2(0.f, 0.f);
  t.x = warp_sum(t.x);
  t.y = warp_sum(t.y);
  __syncthreads();  // smem is reused by the next call
  return t;
}

__device__ __forceinline__ float row_sum(float a, float2* smem) { return row_sum2(a, 0.f, smem).x; }

// The weight an output is divided by to recover x-hat (memory_efficient): |w| >= eps, sign kept.
__device__ __forceinline__ float clamp_mag(float w, float eps) {
  return w >= 0.f ? fmaxf(w, eps) : fminf(w, -eps);
}

struct FwdArgs {
  const void* x;
  const void* w;
  const void* b;
  void* y;
  float* mean;
  float* rstd;
  int64_t rows, H;
  float eps;
  int wt, yt;
  bool one_pass;  // fwd_fast's LayerNorm moments from shifted sums (see fwd_fast)
};

// -- the fast path's pieces -------------------------------------------------------------------

constexpr int kMaxWarps = kMaxTX / 32;  // warps per row group, at most
constexpr int kMaxTY = 8;  // row groups per block with shared-memory sums (groups of 64+ threads)

template <typename T>
__device__ __forceinline__ void load_pack(const void* p, int64_t i, Pack<T>& o) {
  o = *reinterpret_cast<const Pack<T>*>(static_cast<const T*>(p) + i);
}

// The 16-bit forward's cache hints (Tune's fwd_hint for LayerNorm, rms_fwd_hint for RMSNorm;
// LEAN kernels only). kHintX: the input's loads skip L1 (L1::no_allocate): each row is read
// once, and its lines could push out of L1 the weight and bias that every row of the block
// reads again. kHintParams: weight and bias through the read-only path, kept in L1 at
// L1::evict_last. kHintY: the output stored as streaming data (st.global.cs, evict-first in
// L2). Without a hint, plain loads and stores. Measured (see Tune): the set of all three is
// LayerNorm's default; the first two alone gained nothing, so the store is what helps it.
constexpr int kHintX = 1, kHintParams = 2, kHintY = 4;

// A 16-byte vector of 16-bit elements loaded, with the hint in `bit` (kHintX or kHintParams) if
// HINT has it (and the GPU has the hints: sm_70 on), else plainly. The asm is volatile so that
// each load keeps its place against the compiler barriers around it (see fwd_rows).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
constexpr bool kHasHints = false;
#else
constexpr bool kHasHints = true;
#endif
template <int HINT, int bit, typename T>
__device__ __forceinline__ void load_pack_hinted(const T* p, Pack<T>& o) {
  static_assert(sizeof(Pack<T>) == 16, "hints are for 16-byte vectors");
  if constexpr (kHasHints && (HINT & bit) != 0) {
    uint32_t* w = reinterpret_cast<uint32_t*>(o.v);
    if constexpr (bit == kHintX) {
      asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "l"(p));
    } else {
      asm volatile("ld.global.nc.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "l"(p));
    }
  } else {
    o = *reinterpret_cast<const Pack<T>*>(p);
  }
}

// A float rounded to T (16-bit, to nearest even as static_cast<T>), as its bits, by value.
template <typename T>
__device__ __forceinline__ uint32_t bits16(float v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// Eight floats stored as a 16-byte vector of T (16-bit) with kHintY's streaming store. The words
// are built from the values' bits by value (a packed array or a c10 value whose address is
// taken put the vector in local memory in one kernel).
template <typename T>
__device__ __forceinline__ void store_vec_streaming(T* p, const float (&o)[kVec]) {
  static_assert(sizeof(T) == 2, "hints are for 16-byte vectors of a 16-bit dtype");
  uint32_t w[kVec / 2];
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) w[i] = bits16<T>(o[2 * i]) | (bits16<T>(o[2 * i + 1]) << 16);
  if constexpr (kHasHints) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3]));
  } else {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// An empty asm on a packed 16-bit vector's words: the compiler must assume they changed, so it
// converts them to float again at the next use instead of keeping the earlier conversions live.
template <typename T>
__device__ __forceinline__ void reconvert(Pack<T>& pk) {
  if constexpr (sizeof(T) == 2) {
    uint32_t* w = reinterpret_cast<uint32_t*>(pk.v);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) asm volatile("" : "+r"(w[i]));
  }
}

// Sums over the row group, one barrier per call: the partials of call k go to slot k % 2, and the
// barrier of call k + 1 stands between the reads of call k and the writes of call k + 2. Every
// thread of the block must make the same calls (rows past the end pass zeros). A group of a warp
// or less (blockDim.x <= 32) sums with shuffles alone. BUTTERFLY: how the warps' partials are
// added (below): LayerNorm's backward takes it, RMSNorm's backward and both forwards keep the
// loop (their SASS that of before it). MAXW: the most warps a group has (kMaxWarps, or 32 for
// bwd_ring_wide's rows of up to 1024 threads; a group of more than kMaxWarps warps fills its
// block, 256 / tx rows a block, so its two parities' slots, [0, 32) and [kMaxTY * kMaxWarps,
// + 32), stay apart).
template <bool BUTTERFLY, int MAXW = kMaxWarps>
struct GroupSum {
  float2* slots;  // [2][kMaxTY][kMaxWarps]
  int parity;

  __device__ __forceinline__ float2 operator()(float a, float b) { return sum<2>(make_float2(a, b)); }

  // One value (RMSNorm's single sum): half the shuffles and slot reads.
  __device__ __forceinline__ float one(float a) { return sum<1>(make_float2(a, 0.f)).x; }

 private:
  // The first K (1 or 2) fields of v summed over the group.
  template <int K>
  __device__ __forceinline__ float2 sum(float2 v) {
    // One uniform test per call: the backward's groups (a warp or more) keep the unconditional
    // warp sums on their per-row critical path; only the forward's narrow groups pay lane_sum's.
    if (blockDim.x < 32) {
      v.x = lane_sum(v.x, blockDim.x);
      if constexpr (K == 2) v.y = lane_sum(v.y, blockDim.x);
      return v;
    }
    v.x = warp_sum(v.x);
    if constexpr (K == 2) v.y = warp_sum(v.y);
    if (blockDim.x == 32) return v;
    float2* s = slots + (parity * kMaxTY + threadIdx.y) * kMaxWarps;
    parity ^= 1;
    if ((threadIdx.x & 31) == 0) {
      s[threadIdx.x >> 5].x = v.x;
      if constexpr (K == 2) s[threadIdx.x >> 5].y = v.y;
    }
    __syncthreads();
    const int nw = int(blockDim.x >> 5);
    if constexpr (BUTTERFLY) {
      // Each aligned run of nw lanes (nw, the group's warps, a power of two: the host's pick()
      // doubles tx from 32, and bwd_impl asserts it) reads the nw partials and sums them by an
      // xor butterfly: one slot read and log2(nw) shuffle steps, not nw - 1 slot reads and adds
      // in a loop. Every lane adds the same pairs (a + b == b + a): the same bits in every
      // thread of the group. Measured (H200, 12-04 21:4x) in bf16 LayerNorm's backward only;
      // the forwards would pay registers for it. See benchmarks/NOTES.md, section of 21:3x.
      const float2& m = s[(threadIdx.x & 31) & (nw - 1)];
      float2 t;
      t.x = m.x;
      if constexpr (K == 2) t.y = m.y;
#pragma unroll
      for (int o = 1; o < MAXW; o <<= 1) {
        if (o >= nw) break;
        t.x += __shfl_xor_sync(0xffffffffu, t.x, o);
        if constexpr (K == 2) t.y += __shfl_xor_sync(0xffffffffu, t.y, o);
      }
      return t;
    }
    float2 t = v;
    t.x = s[0].x;
    if constexpr (K == 2) t.y = s[0].y;
    for (int w = 1; w < nw; ++w) {
      t.x += s[w].x;
      if constexpr (K == 2) t.y += s[w].y;
    }
    return t;
  }
};

// (count, mean, M2) of two disjoint sets merged; `lo` is the one of lower rank, so every thread
// merges in the same order and gets the same bits.
struct Moments {
  float n, mean, m2;
};

__device__ __forceinline__ Moments merge(Moments lo, Moments hi) {
  const float n = lo.n + hi.n;
  if (n == 0.f) return lo;
  const float f = hi.n / n;
  const float d = hi.mean - lo.mean;
  return {n, fmaf(d, f, lo.mean), lo.m2 + hi.m2 + d * d * lo.n * f};
}

__device__ __forceinline__ Moments group_moments(Moments m, float4* slots, int& parity) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    if (unsigned(o) >= blockDim.x) break;  // a group narrower than a warp
    const Moments other{__shfl_xor_sync(0xffffffffu, m.n, o),
                        __shfl_xor_sync(0xffffffffu, m.mean, o),
                        __shfl_xor_sync(0xffffffffu, m.m2, o)};
    m = (threadIdx.x & o) ? merge(other, m) : merge(m, other);
  }
  if (blockDim.x <= 32) return m;
  float4* s = slots + (parity * kMaxTY + threadIdx.y) * kMaxWarps;
  parity ^= 1;
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = make_float4(m.n, m.mean, m.m2, 0.f);
  __syncthreads();
  Moments t{s[0].x, s[0].y, s[0].z};
  for (int w = 1; w < int(blockDim.x >> 5); ++w) t = merge(t, Moments{s[w].x, s[w].y, s[w].z});
  return t;
}

// A vector of weight or bias in, of output out: in Tx where LEAN (weight, bias and output in the
// input's dtype, the usual case: no dtype branch, fewer registers), else in the run-time dtype.
template <typename Tx, bool LEAN>
__device__ __forceinline__ void load_param_vec(const void* p, int dt, int64_t i, float (&o)[kVec]) {
  if constexpr (LEAN) {
    load_vec<Tx>(p, i, o);
  } else {
    load_vec_dt(p, dt, i, o);
  }
}

template <typename Tx, bool LEAN>
__device__ __forceinline__ void store_out_vec(void* p, int dt, int64_t i, const float (&o)[kVec]) {
  if constexpr (LEAN) {
    store_vec<Tx>(p, i, o);
  } else {
    store_vec_dt(p, dt, i, o);
  }
}

// The forward's weight or bias vector and output vector: with HINT's kHintParams / kHintY (LEAN
// only), through the hinted access; else as load_param_vec / store_out_vec.
template <typename Tx, bool LEAN, int HINT>
__device__ __forceinline__ void fwd_param_vec(const void* p, int dt, int64_t i, float (&o)[kVec]) {
  if constexpr ((HINT & kHintParams) != 0) {
    Pack<Tx> pk;
    load_pack_hinted<HINT, kHintParams>(static_cast<const Tx*>(p) + i, pk);
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = elem(pk, e);
  } else {
    load_param_vec<Tx, LEAN>(p, dt, i, o);
  }
}

template <typename Tx, bool LEAN, int HINT>
__device__ __forceinline__ void fwd_out_vec(void* p, int dt, int64_t i, const float (&o)[kVec]) {
  if constexpr ((HINT & kHintY) != 0) {
    store_vec_streaming(static_cast<Tx*>(p) + i, o);
  } else {
    store_out_vec<Tx, LEAN>(p, dt, i, o);
  }
}

// One row per group per iteration: the row's NV vectors per thread are loaded at once, summed,
// then normalised and written from the registers. LEAN: weight, bias and output in the input's
// 16-bit dtype (no dtype branches), and the row converted to float again for the output rather
// than kept as floats from the sums (bf16 RMSNorm at 8 vectors a thread: 86 registers, not 126).
// Two kernels run it: fwd_fast (blocks of up to kMaxTX threads, so 128 registers at most) and
// fwd_fast_r80 (LEAN at 80 registers: three blocks of 256 threads per SM); see Tune's fwd_r80.
// HINT: the cache hints of Tune's fwd_hint (16-bit LEAN rows).
template <typename Tx, int NV, bool RMS, bool LEAN, int HINT>
__device__ __forceinline__ void fwd_rows(const FwdArgs& a) {
  static_assert(HINT == 0 || (LEAN && sizeof(Tx) == 2), "cache hints are for 16-bit LEAN rows");
  __shared__ float4 slots[2 * kMaxTY * kMaxWarps];
  int parity = 0;
  GroupSum<false> gsum{reinterpret_cast<float2*>(slots), 0};
  const int64_t nvec = a.H / kVec;
  const float inv_h = 1.f / static_cast<float>(a.H);
  const int64_t G = int64_t(gridDim.x) * blockDim.y;
  const int64_t iters = (a.rows + G - 1) / G;  // the same for every thread (barriers inside)
  int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  Pack<Tx> cur[NV];
  for (int64_t it = 0; it < iters; ++it, row += G) {
    const bool live = row < a.rows;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (live && j < nvec) {
        if constexpr ((HINT & kHintX) != 0) {
          load_pack_hinted<HINT, kHintX>(static_cast<const Tx*>(a.x) + row * a.H + j * kVec, cur[k]);
        } else {
          load_pack(a.x, row * a.H + j * kVec, cur[k]);
        }
      }
    }
    float mu = 0.f, r;
    if (RMS) {
      float q = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (live && j < nvec) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) q = fmaf(elem(cur[k], e), elem(cur[k], e), q);
        }
      }
      r = rsqrtf(gsum.one(q) * inv_h + a.eps);
    } else if (sizeof(Tx) == 2 && a.one_pass) {
      // The row's sums of d = x - K and d^2 in one group sum (one barrier, as RMSNorm's), K the
      // row's first element: var = E[d^2] - E[d]^2. K is one of the row's values, so
      // (K - mean)^2 <= H * var and the cancellation costs at most log2(H + 1) bits of var's
      // float32 in an adversarial row (an outlier first), about one bit in a typical one: below
      // a 16-bit output's rounding, not below float32's, so float32 input keeps the merge.
      const float K = live ? static_cast<float>(static_cast<const Tx*>(a.x)[row * a.H]) : 0.f;
      float s = 0.f, q = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (live && j < nvec) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const float d = elem(cur[k], e) - K;
            s += d;
            q = fmaf(d, d, q);
          }
        }
      }
      const float2 t = gsum(s, q);
      const float dm = t.x * inv_h;
      mu = K + dm;
      const float var = t.y * inv_h - dm * dm;
      r = rsqrtf((var < 0.f ? 0.f : var) + a.eps);  // not fmaxf: a NaN row stays NaN (fast math)
    } else {
      // This thread's own moments, two passes over its registers, then one merge over the group.
      float s = 0.f, n = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (live && j < nvec) {
          n += float(kVec);
#pragma unroll
          for (int e = 0; e < kVec; ++e) s += elem(cur[k], e);
        }
      }
      const float m = n > 0.f ? s / n : 0.f;
      float m2 = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (live && j < nvec) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const float d = elem(cur[k], e) - m;
            m2 = fmaf(d, d, m2);
          }
        }
      }
      const Moments t = group_moments(Moments{n, m, m2}, slots, parity);
      mu = t.mean;
      r = rsqrtf(t.m2 * inv_h + a.eps);
    }
    if (live) {
      if (threadIdx.x == 0) {
        if (!RMS) a.mean[row] = mu;
        a.rstd[row] = r;
      }
      if constexpr (LEAN) {
        // Convert the packed 16-bit row again below rather than keep the sums' float copies
        // (twice the registers).
#pragma unroll
        for (int k = 0; k < NV; ++k) reconvert(cur[k]);
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (j < nvec) {
          float w[kVec], b[kVec], o[kVec];
          if (a.w) fwd_param_vec<Tx, LEAN, HINT>(a.w, a.wt, j * kVec, w);
          // A compiler barrier: each vector's weight is loaded in its own step rather than all of
          // them hoisted ahead and held (ptxas, nvcc 13.0 sm_90, bf16 at 8 vectors: fwd_fast_r80
          // at 80 registers without the 8-24 bytes of spill it had, for RMSNorm and LayerNorm).
          asm volatile("" ::: "memory");
          if (!RMS && a.b) fwd_param_vec<Tx, LEAN, HINT>(a.b, a.wt, j * kVec, b);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            // (x - mu) * r, not the one fma x * r - mu * r: that one leaves the rounding of
            // mu * r where x == mu (a constant fp16 row of 60000 at eps 1e-5: 0.99 for 0,
            // float32 emulated).
            const float y = (elem(cur[k], e) - mu) * r;
            // With a bias, y * w + b in one fma (1 for w where there is none).
            if (!RMS && a.b) {
              o[e] = fmaf(y, a.w ? w[e] : 1.f, b[e]);
            } else {
              o[e] = a.w ? y * w[e] : y;
            }
          }
          fwd_out_vec<Tx, LEAN, HINT>(a.y, a.yt, row * a.H + j * kVec, o);
        }
      }
    }
  }
}

template <typename Tx, int NV, bool RMS, bool LEAN, int HINT = 0>
__global__ void __launch_bounds__(kMaxTX) fwd_fast(FwdArgs a) {
  fwd_rows<Tx, NV, RMS, LEAN, HINT>(a);
}

#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
#define APEX_NORM_MAXNREG_80 __maxnreg__(80)
#else
#define APEX_NORM_MAXNREG_80 __launch_bounds__(kMaxTX)  // no __maxnreg__ before CUDA 12.4
#endif
template <typename Tx, int NV, bool RMS, int HINT = 0>
__global__ void APEX_NORM_MAXNREG_80 fwd_fast_r80(FwdArgs a) {
  fwd_rows<Tx, NV, RMS, true, HINT>(a);
}

template <typename Tx, bool RMS>
__global__ void __launch_bounds__(kMaxTX) fwd_generic(FwdArgs a) {
  __shared__ float2 smem[32 * 32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < a.rows;
  const Tx* x = static_cast<const Tx*>(a.x) + (live ? row * a.H : 0);
  const float inv_h = 1.f / static_cast<float>(a.H);
  float mu = 0.f;
  if (!RMS) {
    float s = 0.f;
    if (live)
      for (int64_t j = threadIdx.x; j < a.H; j += blockDim.x) s += static_cast<float>(x[j]);
    mu = row_sum(s, smem) * inv_h;
  }
  float q = 0.f;
  if (live) {
    for (int64_t j = threadIdx.x; j < a.H; j += blockDim.x) {
      const float d = static_cast<float>(x[j]) - mu;
      q += d * d;
    }
  }
  const float r = rsqrtf(row_sum(q, smem) * inv_h + a.eps);
  if (!live) return;
  if (threadIdx.x == 0) {
    if (!RMS) a.mean[row] = mu;
    a.rstd[row] = r;
  }
  for (int64_t j = threadIdx.x; j < a.H; j += blockDim.x) {
    float y = (static_cast<float>(x[j]) - mu) * r;
    if (a.w) y *= load_dt(a.w, a.wt, j);
    if (!RMS && a.b) y += load_dt(a.b, a.wt, j);
    store_dt(a.y, a.yt, row * a.H + j, y);
  }
}

struct BwdArgs {
  const void* dy;
  const void* xy;  // the input, or the output when memory_efficient
  const float* mean;
  const float* rstd;
  const void* w;
  const void* b;
  void* dx;
  float* part_w;  // [groups, H] partial sums of dy * x-hat, or null
  float* part_b;  // [groups, H] partial sums of dy, or null
  int64_t rows, H;
  float eps;
  int dyt, wt, dxt;
  bool mem_eff;
  int stages;  // bwd_ring: rows in the shared-memory ring (2 to 4)
};

// x-hat of one element: from the input and the row's statistics, or (memory_efficient) from the
// output, the bias and the clamped weight.
template <bool RMS>
__device__ __forceinline__ float xhat_of(const BwdArgs& a, float v, float mu, float r, float w,
                                         float b) {
  if (a.mem_eff) {
    if (!RMS && a.b) v -= b;
    if (a.w) v /= clamp_mag(w, a.eps);
    return v;
  }
  return (v - mu) * r;
}

// x-hat as xhat_of, with memory_efficient (ME) known at compile time: the fast kernel's registers.
template <bool RMS, bool ME>
__device__ __forceinline__ float xhat_t(const BwdArgs& a, float v, float mu, float r, float w,
                                        float b) {
  if (ME) {
    if (!RMS && a.b) v -= b;
    if (a.w) v /= clamp_mag(w, a.eps);
    return v;
  }
  return (v - mu) * r;
}

// One row of the packed backward kernels (bwd_fast, bwd_ring): the row's sums over its group (two
// for LayerNorm, one for RMSNorm), then grad_input written; src(k, x, dy) gives this thread's
// vector k of the input (or output) and of grad_output, once per pass (registers for bwd_fast,
// the ring's shared memory for bwd_ring); acc(i, dy, x-hat) adds element i's terms
// (i < NV * kVec) to the weight/bias gradient sums. Every thread of the block calls it (a barrier
// inside); `live`: the row exists.
template <typename Tx, int NV, bool RMS, bool ME, bool LEAN, typename GS, typename Src, typename Acc>
__device__ __forceinline__ void bwd_row(const BwdArgs& a, GS& gsum, Src&& src, float muc,
                                        float rc, int64_t row, bool live, Acc&& acc) {
  const int64_t nvec = a.H / kVec;
  const float inv_h = 1.f / static_cast<float>(a.H);
  const bool has_b = !RMS && ME && a.b;
  float sg = 0.f, sgx = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (live && j < nvec) {
      Pack<Tx> xk, gk;
      src(k, xk, gk);
      float w[kVec], b[kVec];
      if (a.w) load_param_vec<Tx, LEAN>(a.w, a.wt, j * kVec, w);
      if (has_b) load_param_vec<Tx, LEAN>(a.b, a.wt, j * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xv = xhat_t<RMS, ME>(a, elem(xk, e), muc, rc, a.w ? w[e] : 1.f,
                                      has_b ? b[e] : 0.f);
        const float dy = elem(gk, e);
        const float g = a.w ? dy * w[e] : dy;
        if (!RMS) sg += g;
        sgx = fmaf(g, xv, sgx);
        acc(k * kVec + e, dy, xv);
      }
    }
  }
  // RMSNorm has no mean term: one sum.
  float mg = 0.f, mgx;
  if constexpr (RMS) {
    mgx = gsum.one(sgx) * inv_h;
  } else {
    const float2 t = gsum(sg, sgx);
    mg = t.x * inv_h;
    mgx = t.y * inv_h;
  }
  if (!live) return;
  // grad_input = rc * (g - mg - x-hat * mgx) as g * rc + (t * c1 + c0): two fmas, t = x - mu
  // (x-hat = t * rc) or, memory_efficient, x-hat itself. (rc * rc flushes to zero below rc ~
  // 1e-19, a row's spread above ~1e19, where float32's variance overflows anyway.)
  const float c0 = -rc * mg;
  const float c1 = ME ? -rc * mgx : -rc * rc * mgx;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nvec) {
      Pack<Tx> xk, gk;
      src(k, xk, gk);
      float w[kVec], b[kVec], o[kVec];
      if (a.w) load_param_vec<Tx, LEAN>(a.w, a.wt, j * kVec, w);
      if (has_b) load_param_vec<Tx, LEAN>(a.b, a.wt, j * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float t = ME ? xhat_t<RMS, ME>(a, elem(xk, e), muc, rc, a.w ? w[e] : 1.f,
                                             has_b ? b[e] : 0.f)
                           : (RMS ? elem(xk, e) : elem(xk, e) - muc);
        const float dy = elem(gk, e);
        const float g = a.w ? dy * w[e] : dy;
        o[e] = fmaf(g, rc, fmaf(t, c1, c0));
      }
      store_out_vec<Tx, LEAN>(a.dx, a.dxt, row * a.H + j * kVec, o);
    }
  }
}

// Row group `group`'s partial weight (and, with_b, bias) gradient sums for its vector j. (Arrays
// by reference and a flag, not pointers: a pointer picked at run time would put them in local
// memory.)
__device__ __forceinline__ void store_partials(const BwdArgs& a, int64_t group, int64_t j,
                                               const float (&w)[kVec], const float (&b)[kVec],
                                               bool with_b) {
  float4* pw = reinterpret_cast<float4*>(a.part_w + group * a.H + j * kVec);
  pw[0] = make_float4(w[0], w[1], w[2], w[3]);
  pw[1] = make_float4(w[4], w[5], w[6], w[7]);
  if (with_b) {
    float4* pb = reinterpret_cast<float4*>(a.part_b + group * a.H + j * kVec);
    pb[0] = make_float4(b[0], b[1], b[2], b[3]);
    pb[1] = make_float4(b[4], b[5], b[6], b[7]);
  }
}

// The fast backward: grad_output in the input's dtype, both kept packed; with PF the next row's
// input, grad_output and statistics are loaded while this row is reduced and written. The weight
// and bias gradient sums live in shared memory (dynamic: NV * 8 floats per thread for each, laid
// out so a warp's accesses are consecutive words), which leaves the registers to the rows in
// flight: kept in registers they would take 16-32 per thread and cap the rows in flight.
template <typename Tx, int NV, bool RMS, bool PF, bool ME>
__global__ void __launch_bounds__(kMaxTX) bwd_fast(BwdArgs a) {
  __shared__ float2 slots[2 * kMaxTY * kMaxWarps];
  extern __shared__ float acc[];  // [RMS ? 1 : 2][NV * kVec][threads], when part_w is set
  GroupSum<!RMS> gsum{slots, 0};
  const int64_t nvec = a.H / kVec;
  const bool need_mu = !RMS && !ME;
  const bool sums = a.part_w != nullptr;
  const int nthreads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  float* acc_w = acc + tid;                          // element (k, e) at [(k * kVec + e) * nthreads]
  float* acc_b = acc + NV * kVec * nthreads + tid;  // LayerNorm only
  if (sums) {
#pragma unroll
    for (int i = 0; i < NV * kVec; ++i) {
      acc_w[i * nthreads] = 0.f;
      if (!RMS && a.part_b) acc_b[i * nthreads] = 0.f;
    }
  }
  const int64_t G = int64_t(gridDim.x) * blockDim.y;
  const int64_t group = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t iters = (a.rows + G - 1) / G;  // the same for every thread (barriers inside)
  int64_t row = group;
  Pack<Tx> xc[NV], gc[NV];
  float rc = 0.f, muc = 0.f;
  if (PF && row < a.rows) {
    rc = a.rstd[row];
    if (need_mu) muc = a.mean[row];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j < nvec) {
        load_pack(a.xy, row * a.H + j * kVec, xc[k]);
        load_pack(a.dy, row * a.H + j * kVec, gc[k]);
      }
    }
  }
  for (int64_t it = 0; it < iters; ++it) {
    const bool live = row < a.rows;
    const int64_t next = row + G;
    constexpr int NN = PF ? NV : 1;
    Pack<Tx> xn[NN], gn[NN];
    float rn = 0.f, mun = 0.f;
    if (PF && next < a.rows) {  // in flight while this row is reduced and written
      rn = a.rstd[next];
      if (need_mu) mun = a.mean[next];
#pragma unroll
      for (int k = 0; k < NN; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (j < nvec) {
          load_pack(a.xy, next * a.H + j * kVec, xn[k]);
          load_pack(a.dy, next * a.H + j * kVec, gn[k]);
        }
      }
    }
    if (!PF && live) {
      rc = a.rstd[row];
      if (need_mu) muc = a.mean[row];
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (j < nvec) {
          load_pack(a.xy, row * a.H + j * kVec, xc[k]);
          load_pack(a.dy, row * a.H + j * kVec, gc[k]);
        }
      }
    }
    auto regs = [&](int k, Pack<Tx>& x, Pack<Tx>& g) {
      x = xc[k];
      g = gc[k];
    };
    bwd_row<Tx, NV, RMS, ME, false>(a, gsum, regs, muc, rc, row, live, [&](int i, float dy, float xv) {
      if (sums) {
        float* pw = acc_w + i * nthreads;
        *pw = fmaf(dy, xv, *pw);
        if (!RMS && a.part_b) acc_b[i * nthreads] += dy;
      }
    });
    if (PF) {
#pragma unroll
      for (int k = 0; k < NN; ++k) {
        xc[k] = xn[k];
        gc[k] = gn[k];
      }
      rc = rn;
      muc = mun;
    }
    row = next;
  }
  if (!sums) return;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nvec) {
      float w[kVec], b[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        w[e] = acc_w[(k * kVec + e) * nthreads];
        if (!RMS && a.part_b) b[e] = acc_b[(k * kVec + e) * nthreads];
      }
      store_partials(a, group, j, w, b, !RMS && a.part_b);
    }
  }
}

// Dynamic shared memory of bwd_fast: the weight (and bias) gradient sums of every thread.
size_t bwd_fast_smem(int nv, int threads, bool want_w, bool want_b) {
  const int arrays = (want_w || want_b ? 1 : 0) + (want_b ? 1 : 0);
  return size_t(arrays) * nv * kVec * threads * sizeof(float);
}

// -- the ring backward: rows in flight through shared memory ---------------------------------
//
// bwd_fast holds the next row in registers, so a row group has one row in flight and the
// registers (97 for bf16 at 2 vectors a thread) cap the blocks per SM at two: on an H200 the
// bf16 backward moved ~49 % of the copy rate, about the time of the float32 one for half the
// bytes (a fixed cost per row, not bandwidth). bwd_ring copies rows ahead with cp.async into a
// ring of S stages in shared memory (each thread copies, and later reads, only its own 16-byte
// chunks, so no barrier guards the ring), leaving S - 1 rows in flight per row group whatever
// the registers. The weight/bias sums live in registers (at most 32 floats a thread: RMSNorm up
// to 4 vectors a thread, LayerNorm up to 2); in shared memory, as bwd_fast keeps them, they
// measured slower (LayerNorm bf16 H=4096 fwd+bwd 51.3 % of copy against 63.2 %). LayerNorm at 4
// vectors a thread (16-bit rows past 8192) keeps the weight sums in registers and the bias sums
// in shared memory (ring_bias_in_smem): bwd_fast, with both there and one row in flight, moved
// 36.7 % of copy at H=16384.

// The copies and the wait clobber "memory": no barrier orders a thread's ring reads against its
// own copies into the same slots, so the compiler must keep each read on its side of them (the
// SASS of every kernel is the same with and without, nvcc 13.0 sm_90; this makes it a rule).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
#endif
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<float*>(smem) = *static_cast<const float*>(gmem);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most n (0 to 3) of this thread's committed groups are still in flight.
__device__ __forceinline__ void cp_async_wait(int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  switch (n) {
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
  }
#endif
}

// The ring's layout in dynamic shared memory: data [S][2 (input, grad_output)][NV * C][threads]
// of 16 bytes (C = 16-byte chunks per vector), then statistics [S][2 (rstd, mean)][threads]
// floats, then (ring_bias_in_smem) the bias sums [NV * kVec / 4][threads] float4s.
template <typename Tx>
__host__ __device__ constexpr int chunks_of() {
  return int(sizeof(Pack<Tx>) / 16);
}

// Whether bwd_ring takes rows of nv vectors a thread: its weight sums fit 32 floats of registers.
__host__ __device__ constexpr bool ring_fits(int nv, bool /*rms*/) { return nv * kVec <= 32; }

// Whether bwd_ring keeps LayerNorm's bias sums in shared memory: weight and bias sums together
// would be more than 32 floats a thread.
__host__ __device__ constexpr bool ring_bias_in_smem(int nv, bool rms) { return !rms && nv * kVec * 2 > 32; }

// WIDE: bwd_ring_wide's rows (LayerNorm at 2 vectors a thread on up to 1024 threads, the bias
// sums in shared memory as at 4 vectors).
template <typename Tx, int NV, bool RMS, bool ME, bool LEAN, bool QUADS, bool WIDE = false>
__device__ __forceinline__ void bwd_ring_rows(BwdArgs a) {
  static_assert(ring_fits(NV, RMS), "bwd_ring keeps its weight sums in registers");
  static_assert(!WIDE || (!RMS && NV == 2), "bwd_ring_wide: LayerNorm rows of 2 vectors a thread");
  constexpr bool kBS = ring_bias_in_smem(NV, RMS) || WIDE;
  const int S = a.stages;  // 2 to 4
  constexpr int C = chunks_of<Tx>();
  __shared__ float2 slots[2 * kMaxTY * kMaxWarps];
  extern __shared__ __align__(16) float dyn[];
  GroupSum<!RMS, WIDE ? 32 : kMaxWarps> gsum{slots, 0};
  const int64_t nvec = a.H / kVec;
  const bool need_mu = !RMS && !ME;
  const bool sums = a.part_w != nullptr;
  const bool sum_b = !RMS && a.part_b != nullptr;
  const int nthreads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  uint4* ring = reinterpret_cast<uint4*>(dyn);
  float* stat = reinterpret_cast<float*>(ring + size_t(S) * 2 * NV * C * nthreads);
  // kBS: elements 4q..4q+3 as one float4 at [q * nthreads]: one 16-byte read-modify-write for
  // four sums, not four of 4 bytes (ptxas/cuobjdump, nvcc 13.0 sm_90, bf16: 332 LDS and 57 STS
  // against 492 and 225). On an H200 (12-04 21:4x) it gained at H=8192 and lost ~2 % at H=16384
  // (rows of 512 threads), in a build not this one; kept at both until a per-width choice is
  // timed in one build (QUADS false: one float per sum, element i at [i * nthreads]; Tune's
  // bwd_bias4). See benchmarks/NOTES.md, section of 21:3x.
  float4* acc_bs = reinterpret_cast<float4*>(stat + size_t(S) * 2 * nthreads) + tid;
  float* acc_b1 = stat + size_t(S) * 2 * nthreads + tid;
  float acc_w[NV * kVec], acc_b[RMS || kBS ? 1 : NV * kVec];
#pragma unroll
  for (int i = 0; i < NV * kVec; ++i) {
    acc_w[i] = 0.f;
    if constexpr (kBS && !QUADS) {
      if (sum_b) acc_b1[i * nthreads] = 0.f;
    } else if constexpr (kBS) {
      if (sum_b && i % 4 == 0) acc_bs[(i / 4) * nthreads] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else if (!RMS) {
      acc_b[i] = 0.f;
    }
  }
  const int64_t G = int64_t(gridDim.x) * blockDim.y;
  const int64_t group = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t iters = (a.rows + G - 1) / G;  // the same for every thread (barriers inside)
  const char* xy = static_cast<const char*>(a.xy);
  const char* dyp = static_cast<const char*>(a.dy);
  // Issue the copies of row r into stage s (an empty group past the end keeps the count).
  auto issue = [&](int64_t r, int s) {
    if (r < a.rows) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (j < nvec) {
          const int64_t off = (r * a.H + j * kVec) * int64_t(sizeof(Tx));
#pragma unroll
          for (int c = 0; c < C; ++c) {
            cp_async16(ring + ((size_t(s) * 2 + 0) * NV * C + k * C + c) * nthreads + tid, xy + off + 16 * c);
            cp_async16(ring + ((size_t(s) * 2 + 1) * NV * C + k * C + c) * nthreads + tid, dyp + off + 16 * c);
          }
        }
      }
      cp_async4(stat + (s * 2 + 0) * nthreads + tid, a.rstd + r);
      if (need_mu) cp_async4(stat + (s * 2 + 1) * nthreads + tid, a.mean + r);
    }
    cp_async_commit();
  };
  for (int s = 0; s < S - 1; ++s) issue(group + s * G, s);
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = group + it * G;
    const bool live = row < a.rows;
    issue(row + (S - 1) * G, int((it + S - 1) % S));
    cp_async_wait(S - 1);  // this row's group has landed
    const int s = int(it % S);
    // The row's vectors are read from the ring in each of bwd_row's two passes rather than held
    // in registers across its group sum (this thread's own slots: no barrier needed). The stage
    // is rewritten by this thread's copies of a later iteration only, after both passes.
    const uint4* xs = ring + size_t(s) * 2 * NV * C * nthreads + tid;
    const uint4* gs = xs + size_t(NV) * C * nthreads;
    auto from_ring = [&](int k, Pack<Tx>& x, Pack<Tx>& g) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        reinterpret_cast<uint4*>(&x)[c] = xs[(k * C + c) * nthreads];
        reinterpret_cast<uint4*>(&g)[c] = gs[(k * C + c) * nthreads];
      }
    };
    const float rc = live ? stat[(s * 2 + 0) * nthreads + tid] : 0.f;
    const float muc = (live && need_mu) ? stat[(s * 2 + 1) * nthreads + tid] : 0.f;
    float bq[4];  // kBS: grad_output of the quad being summed (i is a constant: registers)
    bwd_row<Tx, NV, RMS, ME, LEAN>(a, gsum, from_ring, muc, rc, row, live, [&](int i, float dy, float xv) {
      acc_w[i] = fmaf(dy, xv, acc_w[i]);
      if constexpr (kBS && !QUADS) {
        if (sum_b) acc_b1[i * nthreads] += dy;
      } else if constexpr (kBS) {
        bq[i % 4] = dy;
        if (sum_b && i % 4 == 3) {  // bwd_row calls acc for all kVec elements of a vector
          float4 v = acc_bs[(i / 4) * nthreads];
          v.x += bq[0];
          v.y += bq[1];
          v.z += bq[2];
          v.w += bq[3];
          acc_bs[(i / 4) * nthreads] = v;
        }
      } else if (!RMS) {
        acc_b[i] += dy;
      }
    });
  }
  cp_async_wait(0);  // nothing may be in flight when the block exits
  if (!sums) return;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nvec) {
      float w[kVec], b[kVec];  // copied out by constant indices: the sums stay in registers
      float4 q = make_float4(0.f, 0.f, 0.f, 0.f);  // kBS: the bias sums' quad of element e
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        w[e] = acc_w[k * kVec + e];
        if constexpr (kBS && !QUADS) {
          b[e] = sum_b ? acc_b1[(k * kVec + e) * nthreads] : 0.f;
        } else if constexpr (kBS) {
          if (sum_b && e % 4 == 0) q = acc_bs[((k * kVec + e) / 4) * nthreads];
          b[e] = e % 4 == 0 ? q.x : e % 4 == 1 ? q.y : e % 4 == 2 ? q.z : q.w;
        } else {
          b[e] = RMS ? 0.f : acc_b[RMS ? 0 : k * kVec + e];
        }
      }
      store_partials(a, group, j, w, b, sum_b);
    }
  }
}

template <typename Tx, int NV, bool RMS, bool ME, bool LEAN, bool QUADS = true>
__global__ void __launch_bounds__(kMaxTX) bwd_ring(BwdArgs a) {
  bwd_ring_rows<Tx, NV, RMS, ME, LEAN, QUADS>(a);
}

// bwd_ring at 80 registers (see Tune's bwd_r80).
template <typename Tx, int NV, bool RMS, bool ME, bool LEAN>
__global__ void APEX_NORM_MAXNREG_80 bwd_ring_r80(BwdArgs a) {
  bwd_ring_rows<Tx, NV, RMS, ME, LEAN, true>(a);
}

// LayerNorm's 16-bit ring on rows of up to 1024 threads at 2 vectors a thread (H = 2048 on 128,
// two rows a block; 4096 on 256; 8192 on 512; 16384 on 1024), its bias sums in shared memory as
// the 4-vector ring keeps them, at 64 registers (__launch_bounds__(1024, 1)): 32 warps an SM
// where the 4-vector ring (125 registers: 256 threads a row, two blocks an SM at 8192; 512, one
// block at 16384) has 16. Hypothesis:
// that backward (about 60 % of copy for its three tensors at 16384, RMSNorm's 87 % in the same
// shape) waits on latency, not on issue (its LEAN variant, with a quarter of the instructions,
// was slower). Tune's bwd_wide; the same template arguments as bwd_ring, for its name.
template <typename Tx, int NV, bool RMS, bool ME, bool LEAN, bool QUADS = true>
__global__ void __launch_bounds__(1024, 1) bwd_ring_wide(BwdArgs a) {
  bwd_ring_rows<Tx, NV, RMS, ME, LEAN, QUADS, true>(a);
}

// Dynamic shared memory of bwd_ring: the ring of S rows, their statistics and (bias_sums) the
// bias gradient sums of ring_bias_in_smem.
size_t bwd_ring_smem(int S, int nv, int chunks, int threads, bool bias_sums) {
  return size_t(S) * 2 * nv * chunks * threads * 16 + size_t(S) * 2 * threads * 4 +
         (bias_sums ? size_t(nv) * kVec * threads * 4 : 0);
}

template <typename Tx, int NV, bool RMS>
__global__ void __launch_bounds__(kMaxTX) bwd_vec(BwdArgs a) {
  __shared__ float2 smem[32 * 32];
  const int64_t nvec = a.H / kVec;
  const float inv_h = 1.f / static_cast<float>(a.H);
  float acc_w[NV][kVec], acc_b[NV][kVec];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc_w[k][e] = acc_b[k][e] = 0.f;
  const int64_t groups = int64_t(gridDim.x) * blockDim.y;
  const int64_t group = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  // Every thread runs the same number of iterations (barriers inside); rows past the end are idle.
  const int64_t iters = (a.rows + groups - 1) / groups;
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = group + it * groups;
    const bool live = row < a.rows;
    const int64_t base = row * a.H;
    const float r = live ? a.rstd[row] : 0.f;
    const float mu = (live && !RMS && !a.mem_eff) ? a.mean[row] : 0.f;
    float xh[NV][kVec], g[NV][kVec];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (live && j < nvec) {
        float w[kVec], b[kVec], dy[kVec];
        load_vec<Tx>(a.xy, base + j * kVec, xh[k]);
        load_vec_dt(a.dy, a.dyt, base + j * kVec, dy);
        if (a.w) load_vec_dt(a.w, a.wt, j * kVec, w);
        if (!RMS && a.b && a.mem_eff) load_vec_dt(a.b, a.wt, j * kVec, b);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float xv = xhat_of<RMS>(a, xh[k][e], mu, r, a.w ? w[e] : 1.f,
                                        (!RMS && a.b && a.mem_eff) ? b[e] : 0.f);
          xh[k][e] = xv;
          g[k][e] = a.w ? dy[e] * w[e] : dy[e];
          sg += g[k][e];
          sgx += g[k][e] * xv;
          acc_w[k][e] += dy[e] * xv;
          if (!RMS) acc_b[k][e] += dy[e];
        }
      }
    }
    const float2 t = row_sum2(sg, sgx, smem);
    const float mg = RMS ? 0.f : t.x * inv_h;
    const float mgx = t.y * inv_h;
    if (live) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
        if (j < nvec) {
          float o[kVec];
#pragma unroll
          for (int e = 0; e < kVec; ++e) o[e] = r * (g[k][e] - mg - xh[k][e] * mgx);
          store_vec_dt(a.dx, a.dxt, base + j * kVec, o);
        }
      }
    }
  }
  if (a.part_w == nullptr) return;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nvec) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        a.part_w[group * a.H + j * kVec + e] = acc_w[k][e];
        if (!RMS && a.part_b) a.part_b[group * a.H + j * kVec + e] = acc_b[k][e];
      }
    }
  }
}

template <typename Tx, bool RMS>
__global__ void __launch_bounds__(kMaxTX) bwd_generic(BwdArgs a) {
  __shared__ float2 smem[32 * 32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < a.rows;
  const int64_t base = live ? row * a.H : 0;
  const Tx* xy = static_cast<const Tx*>(a.xy) + base;
  const float r = live ? a.rstd[row] : 0.f;
  const float mu = (live && !RMS && !a.mem_eff) ? a.mean[row] : 0.f;
  const bool has_b = !RMS && a.b && a.mem_eff;
  float sg = 0.f, sgx = 0.f;
  if (live) {
    for (int64_t j = threadIdx.x; j < a.H; j += blockDim.x) {
      const float w = a.w ? load_dt(a.w, a.wt, j) : 1.f;
      const float xv = xhat_of<RMS>(a, static_cast<float>(xy[j]), mu, r, w,
                                    has_b ? load_dt(a.b, a.wt, j) : 0.f);
      const float gv = load_dt(a.dy, a.dyt, base + j) * w;
      sg += gv;
      sgx += gv * xv;
    }
  }
  const float2 t = row_sum2(sg, sgx, smem);
  if (!live) return;
  const float inv_h = 1.f / static_cast<float>(a.H);
  const float mg = RMS ? 0.f : t.x * inv_h;
  const float mgx = t.y * inv_h;
  for (int64_t j = threadIdx.x; j < a.H; j += blockDim.x) {
    const float w = a.w ? load_dt(a.w, a.wt, j) : 1.f;
    const float xv = xhat_of<RMS>(a, static_cast<float>(xy[j]), mu, r, w,
                                  has_b ? load_dt(a.b, a.wt, j) : 0.f);
    const float gv = load_dt(a.dy, a.dyt, base + j) * w;
    store_dt(a.dx, a.dxt, base + j, r * (gv - mg - xv * mgx));
  }
}

// Stage 1 of the weight/bias gradients for the generic path: the partial sums over the rows
// [split * rows_per_split, ...) of dy * x-hat and dy, one column per thread (coalesced).
template <typename Tx, bool RMS>
__global__ void colpart(BwdArgs a, int64_t rows_per_split) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= a.H) return;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_split;
  const int64_t r1 = r0 + rows_per_split < a.rows ? r0 + rows_per_split : a.rows;
  const float w = a.w ? load_dt(a.w, a.wt, col) : 1.f;
  const float b = (!RMS && a.b && a.mem_eff) ? load_dt(a.b, a.wt, col) : 0.f;
  float sw = 0.f, sb = 0.f;
  for (int64_t row = r0; row < r1; ++row) {
    const float mu = (!RMS && !a.mem_eff) ? a.mean[row] : 0.f;
    const float xv = xhat_of<RMS>(
        a, static_cast<float>(static_cast<const Tx*>(a.xy)[row * a.H + col]), mu, a.rstd[row], w, b);
    const float dy = load_dt(a.dy, a.dyt, row * a.H + col);
    sw += dy * xv;
    sb += dy;
  }
  a.part_w[int64_t(blockIdx.y) * a.H + col] = sw;
  if (a.part_b) a.part_b[int64_t(blockIdx.y) * a.H + col] = sb;
}

// Stage 2: out[col] = sum over g of part[g, col], in a fixed order; blockIdx.y picks the pair
// (weight, then bias), so both gradients take one launch. A block of 1024 threads takes W columns
// (W = 8, 16 or 32 by H: colsum_width), 1024 / W threads down each, four independent loads in
// flight per thread, then a tree over the threads in shared memory. The partials (G rows of H
// floats, just written: by the launch arithmetic G is ~400-1000 on an H200 at [32768, H <= 4096],
// a few MB, in L2) are latency-bound: the earlier shape (32 columns, 8 threads down each, one running sum) left
// most SMs idle at H <= 2048 (32-64 blocks a gradient) and took 7.4 us at H=4096 (RMSNorm,
// torch.profiler, 12-04 10:00) for 6.5 MB. Measured against it (H200, 12-04 19:5x, bf16
// fwd+bwd ms, two runs each): RMSNorm H=1024 0.0977, 0.0980 against 0.1009, 0.1017; LayerNorm
// 0.1156, 0.1151 against 0.1181, 0.1187; H = 2048-8192 within the run's noise (H=16384: see the
// LEAN ring in bwd_impl, timed in the same A/B).
struct ColSums {
  const float* part[2];
  void* out[2];
};

constexpr int kColsumThreads = 1024;

template <int W>
__global__ void __launch_bounds__(kColsumThreads) colsum(ColSums c, int64_t G, int64_t H, int ot) {
  constexpr int R = kColsumThreads / W;  // threads down each column
  __shared__ float s[R][W + 1];
  // Selects, not an index: a run-time index into the parameter array would copy it to the stack.
  const float* part = blockIdx.y ? c.part[1] : c.part[0];
  const int tx = threadIdx.x % W, ty = threadIdx.x / W;
  const int64_t col = int64_t(blockIdx.x) * W + tx;
  float v = 0.f;
  if (col < H) {
    const float* p = part + col;
    float v1 = 0.f, v2 = 0.f, v3 = 0.f;
    int64_t g = ty;
    for (; g + 3 * R < G; g += 4 * R) {
      v += p[g * H];
      v1 += p[(g + R) * H];
      v2 += p[(g + 2 * R) * H];
      v3 += p[(g + 3 * R) * H];
    }
    for (; g < G; g += R) v += p[g * H];
    v = (v + v1) + (v2 + v3);
  }
  s[ty][tx] = v;
  __syncthreads();
#pragma unroll
  for (int half = R / 2; half > 0; half /= 2) {
    if (ty < half) s[ty][tx] += s[ty + half][tx];
    __syncthreads();
  }
  if (ty == 0 && col < H) store_dt(blockIdx.y ? c.out[1] : c.out[0], ot, col, s[0][tx]);
}

// colsum's columns per block: 128-512 blocks at H = 1024..16384. A function of H only, so the
// order of colsum's sums depends on G and H alone (G, the row groups, follows the GPU's SM count
// and occupancy: a run repeats its bits on one GPU, not across GPUs).
int colsum_width(int64_t H) { return H >= 8192 ? 32 : H >= 4096 ? 16 : 8; }

// -- launchers -------------------------------------------------------------------------------

int dt_of(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default:
      APEX_CHECK_TYPE(false, op, ": ", name, " has dtype ", t.scalar_type(),
                      "; the CUDA kernels support float32, float16 and bfloat16");
  }
  return kF32;
}

// A device attribute, asked once per device.
template <cudaDeviceAttr A>
int device_attr(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, A, device));
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

int sm_count(int device) { return device_attr<cudaDevAttrMultiProcessorCount>(device); }

bool vec_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (kVec * t.element_size()) == 0;
}

struct Config {
  int tx, ty, nv;  // nv == 0: the generic kernels
};

// Threads per row: enough that each holds about `per_thread` vectors (min_tx at least: a warp for
// the backward, one thread for the forward; max_tx, kMaxTX unless said, at most); rows per block:
// up to 256 threads a block. The backward keeps more arrays per thread, so it asks for fewer
// vectors each.
Config pick(int64_t H, bool aligned, int max_nv, int per_thread, int min_tx, int max_tx = kMaxTX) {
  if (aligned && H % kVec == 0 && H > 0) {
    const int64_t nvec = H / kVec;
    int tx = min_tx;
    while (tx < max_tx && int64_t(tx) * per_thread < nvec) tx *= 2;
    int nv = 1;
    while (int64_t(tx) * nv < nvec) nv *= 2;
    if (nv <= max_nv) return {tx, std::max(1, 256 / tx), nv};
  }
  // The scalar kernels' shape (nv 0): rows of up to kMaxTX threads whatever max_tx (which widens
  // vector rows only: bwd_ring_wide's).
  int tx = 32;
  while (tx < kMaxTX && int64_t(tx) * 4 < H) tx *= 2;
  return {tx, std::max(1, 256 / tx), 0};
}

// The launch shape's knobs. APEX_NORM_TUNE ("fwd_pt=2,bwd_pt=2,fwd_pt16=8,bwd_pt16=2,fwd_waves=0,
// bwd_waves=1,bwd_ring=2", read once; every field of Tune below by name, an unknown name
// warned about) overrides them for tuning sweeps: *_pt vectors per thread
// (*_pt16 for 16-bit input), *_waves the persistent grid in multiples of what fits at once (0: one
// row group per block row, no persistence), bwd_ring the 16-bit backward's ring stages (see
// bwd_ring); smem_kb caps a block's shared memory (0: the device's), for tests of the fallbacks
// that GPUs with less shared memory take. Measured on an
// H200 (2026-12-03, [32768, H], scripts/norm_sweep.sh): the forward without persistence and with
// 128 bytes of a row per thread (8 vectors of bf16) is fastest (today's kernels at
// 2048 < H <= 4096 take 4: fwd_mid_pt16): RMSNorm bf16 H=4096 148 us
// against 199 us persistent and 221 us with 4 bf16 vectors (that kernel; see rms_short_pt16 for
// RMSNorm's short rows now). float32 (2026-12-04 15:4x, H=4096 fwd, % of copy at fwd_pt = 4 / 2
// / 1): RMSNorm 95.3 / 99.1 / 92.6, LayerNorm 80.9 / 84.7 / 48.3, so 2 vectors (64 bytes) a
// thread; 16:0x at H = 1024 / 16384: RMSNorm 93.3 / 80.6 against 92.1 / 80.8 at 4, LayerNorm
// 86.7 / 65.0 against 82.5 / 65.2.
// The backward needs the persistent grid for its weight-gradient sums; 2 vectors per thread beat
// 1 and 4 for bf16 at H = 1024, 4096, 16384 in bwd_fast (12-03; rows of H > 4096 now take 4, see
// bwd_wide_pt16). The 16-bit backward through the ring (12-03 13:45): RMSNorm bf16
// fwd+bwd 60.6 / 80.6 / 82.8 % of copy at H = 1024 / 4096 / 16384 with 2 stages (3 and 4 the same
// or slower), against 47.7 / 56.9 / 42.9 % for bwd_fast.
struct Tune {
  int fwd_pt = 2, bwd_pt = 2, fwd_waves = 0, bwd_waves = 1;
  int fwd_pt16 = 8, bwd_pt16 = 2;  // the same for 16-bit input (a vector is 16 bytes, not 32)
  int bwd_ring = 2;  // rows in bwd_ring's ring (2 to 4); 0: off (bwd_vec, or bwd_fast as without the ring)
  int smem_kb = 0;   // >0: a block's shared memory capped at this many KB, as on a smaller GPU
  // 1: LayerNorm's forward moments for 16-bit input from shifted sums in one group sum; 0: each
  // thread's moments, then a Chan merge over the group (float32 input always). Measured on an H200 (2026-12-03 23:3x, bf16 fwd, % of copy at
  // H = 1024 / 4096 / 16384): 54.6 / 76.7 / 77.5 against 49.1 / 69.9 / 68.0.
  int ln_one_pass = 1;
  // The 16-bit forward at 8 vectors a thread (weight, bias and output in its dtype) through
  // fwd_fast_r80, else through fwd_fast's LEAN variant: value 1 LayerNorm, 2 RMSNorm, 3 both, 0
  // neither. At fewer vectors the row fits without the cap, and the cap there measured slower
  // (bf16 RMSNorm H=1024 / 2048 at 2 vectors: 0.0426 / 0.0830 ms against 0.0363 / 0.0698;
  // LayerNorm at 4 vectors, 15:4x build, 0.0443 / 0.0886 / 0.1713 at H = 1024..4096 against
  // 0.0418 / 0.0791 / 0.1523 in the 16:0x one). Measured on an H200 (2026-12-04 16:0x, ours
  // only, bf16 fwd ms at H = 1024 / 2048 / 4096 / 8192 / 16384, fwd_fast_r80 at 80 registers
  // without spill, see fwd_rows): RMSNorm through it at 8 vectors 0.0372 / 0.0699 / 0.1355 /
  // 0.2630 / 0.5150 against 0.0363 (2 vectors, rms_short_pt16) / 0.0698 / 0.1441 / 0.2805 /
  // 0.5582 through LEAN (86 registers); LayerNorm 0.0410 / 0.0742 / 0.1509 / 0.2993 / 0.5742
  // (two runs of the 15:4x build, which spilled 24 bytes: 0.0427-0.0429 / 0.0769-0.0770 /
  // 0.1524-0.1531 / 0.3031-0.3036 / 0.6152-0.6289). H=4096 now runs 4 vectors by default
  // (fwd_mid_pt16), so its figures here are those of fwd_mid_pt16=0.
  int fwd_r80 = 3;
  // The 16-bit backward's ring at 2 vectors a thread and rows of up to 256 threads (not
  // memory_efficient) through bwd_ring_r80 (__maxnreg__(80)): 1 LayerNorm, 2 RMSNorm, 3 both, 0
  // neither. ptxas (nvcc 13.0, sm_90, bf16, general / LEAN variant, since the ring is read in
  // both passes, c132a76): LayerNorm 97 / 86 registers in bwd_ring, 80 / 76 in bwd_ring_r80;
  // RMSNorm 62 / 58 in bwd_ring but 72 / 72 in bwd_ring_r80: for RMSNorm the cap adds registers,
  // three blocks of 256 threads per SM instead of four, and measured faster (again at 18:0x:
  // H=4096 0.3562-0.3571 ms against 0.3650-0.3652 uncapped). Before c132a76 (the runs below):
  // LayerNorm 96 / 98 and 80, RMSNorm 64 / 63 and 78 / 80. Measured on an H200,
  // scripts/norm_sweep.sh, bf16 fwd+bwd: LayerNorm (12-04 14:2x, % of copy, through it in two
  // runs / not) H=2048 68.7, 68.9 / 66.7; H=4096 69.5, 70.1 / 66.5; H=1024 (64 threads) 60.0,
  // 60.6 / 60.9 (16:0x, ms: 0.1303, 0.1318 / 0.1295-0.1309: no gain there, taken for one rule);
  // H=8192 (512 threads) 65.4, 65.5 / 65.9. RMSNorm (12-04 16:0x, ms, through it / two runs not)
  // H=1024 0.1082 / 0.1136, 0.1141; 2048 0.1969 / 0.2022, 0.2002; 4096 0.3872 / 0.3933, 0.3926;
  // H=8192 0.8314 / 0.7703, 0.7671, so rows of 512 threads keep bwd_ring.
  int bwd_r80 = 3;
  // 16-bit RMSNorm's forward on rows of at most 256 vectors (H <= 2048): vectors per thread (0:
  // fwd_pt16). Measured on an H200 (2026-12-04 15:4x, bf16 fwd, scripts/norm_sweep.sh, ours only,
  // ms at H = 1024 / 2048): 2 vectors 0.0357 / 0.0677, 4 0.0360 / 0.0692, 8 0.0376-0.0377 /
  // 0.0697 (two runs); at 2048 within run noise of 8 (16:0x: 0.0698-0.0700 at 2, 0.0699 at 8).
  // LayerNorm there is fastest at 8 (0.0427-0.0429 / 0.0769-0.0770 against 0.0576 / 0.1124 at 2).
  int rms_short_pt16 = 2;
  // The 16-bit backward on rows of more than 512 vectors (H > 4096): vectors per thread (0:
  // bwd_pt16), so H = 8192 runs rows of 256 threads at 4 vectors (two blocks per SM), not 512 at
  // 2 (one for LayerNorm's 96 registers). Measured on an H200 (2026-12-04 16:15, ours only, bf16
  // fwd+bwd ms, bwd_pt16=4 / =2 in two runs): H=8192 RMSNorm 0.7322 / 0.7523, 0.7499, LayerNorm
  // 0.9295 / 0.9851, 0.9869; at H=4096 RMSNorm 0.3765 / 0.3803, 0.3808 (1 %), LayerNorm 0.4712 /
  // 0.4546, 0.4551 (slower), so rows up to 4096 keep bwd_pt16. LayerNorm only where its 4-vector
  // ring (bias sums in shared memory) fits the device: on GPUs of ~100 KB a block (sm_86, sm_89,
  // sm_120) its H=8192 row would lose the ring to bwd_fast, so it keeps 2 vectors there.
  int bwd_wide_pt16 = 4;
  // 1: the ring backward at 1-2 vectors a thread (not memory_efficient) with weight, bias and
  // grad_input in the input's dtype through its LEAN variant (no run-time dtype branches per
  // vector); 0: the general one.
  int bwd_lean = 1;
  // The 16-bit forward on rows of 257-512 vectors (2048 < H <= 4096), both norms: vectors per
  // thread (0: fwd_pt16), so H=4096 runs rows of 128 threads at 4 vectors (through fwd_fast's
  // LEAN variant where weight, bias and output share the input's dtype), not 64 at 8 (through
  // fwd_fast_r80). Measured on an H200 (2026-12-04 20:1x, ours only, bf16 fwd ms, fwd_pt16=4 / 8,
  // two runs each in run order): H=4096 RMSNorm 0.1320, 0.1322 / 0.1363, 0.1362, LayerNorm 0.1450,
  // 0.1451 / 0.1501, 0.1495; again at 20:2x (fwd_mid_pt16=4 / 0): RMSNorm 0.1326, 0.1332 /
  // 0.1369, 0.1363, LayerNorm 0.1439, 0.1437 / 0.1500, 0.1491. Within 0.5 % or slower elsewhere:
  // H=2048 LayerNorm 0.0741, 0.0750 / 0.0732, 0.0732 (RMSNorm takes rms_short_pt16 under both);
  // H=8192 LayerNorm 0.2952, 0.2926 / 0.2873, 0.2874, RMSNorm 0.2612, 0.2611 / 0.2624, 0.2623;
  // H=16384 RMSNorm 0.5584, 0.5602 / 0.5142, 0.5138.
  int fwd_mid_pt16 = 4;
  // LayerNorm's 16-bit ring backward at 4 vectors a thread (H > 4096, bias sums in shared
  // memory): 1 the bias sums as float4s (one 16-byte read-modify-write per four), 0 one float
  // each, as before 4672dc4. Measured on an H200 (12-04 21:4x, in a build with a run-time knob
  // for the group sums, not this one; bf16 fwd+bwd): -3.8 % at H=8192, +2.3 % at H=16384. To be
  // timed per row width in one build (2026-12-05 03:4x, % of copy at H = 8192 / 12288 / 16384,
  // two runs, 1 / 0): 78.5, 78.2 / 74.6, 74.8; 68.3, 68.3 / 66.5, 66.5; 69.1, 69.0 / 69.8, 69.6.
  int bwd_bias4 = 1;
  // The 16-bit forward's cache hints where weight, bias and output share the input's dtype (see
  // kHintX), LayerNorm's (fwd_hint) and RMSNorm's (rms_fwd_hint): 0 none; 7 the input's loads
  // skip L1, weight and bias at L1::evict_last through the read-only path, the output stored as
  // streaming data; 4 that store alone; other values: none (1 and 3, the loads' hints without
  // the store, were compiled until 12-05 06:0x: no gain below). Measured on an H200 (2026-12-05
  // 03:4x, scripts/gpu_norm.sh HINT_SWEEP=1, bf16 fwd, % of copy at H = 1024 / 2048 / 4096 /
  // 8192 / 16384, two runs each): LayerNorm 0: 78.5, 79.9 / 87.5, 87.3 / 88.2, 87.9 / 88.0, 88.3
  // / 86.5, 87.9; 1: 79.4, 79.5 / 86.3, 86.5 / 87.3, 86.8 / 85.4, 85.4 / 90.0, 84.8; 3: 79.1,
  // 79.5 / 87.0, 86.1 / 86.8, 87.1 / 85.4, 85.4 / 89.8, 90.5; 7: 83.3, 84.9 / 88.7, 90.8 / 87.8,
  // 89.0 / 92.9, 94.2 / 87.1, 94.2. RMSNorm 0: 89.4, 89.4 / 92.5, 91.5 / 95.9, 96.4 / 96.4,
  // 96.8 / 98.8, 98.7; 7: 87.5, 88.7 / 91.7, 93.6 / 94.9, 97.1 / 94.5, 95.8 / 94.8, 96.2 (1 and
  // 3 lower still). So the streaming store is what helps LayerNorm, and RMSNorm keeps none. On
  // an H100 (12-05 05:4x, the same sweep, 7 / 4 for LayerNorm, 0 / 4 for RMSNorm): LayerNorm
  // 92.7, 92.4 / 86.7, 87.0; 95.4, 96.1 / 92.7, 93.0; 97.6, 98.5 / 98.1, 98.5; 98.6, 99.0 /
  // 99.4, 99.2; 98.9, 99.6 / 100.0, 99.9; RMSNorm 94.6, 94.8 / 94.4, 94.1; 97.3, 97.2 / 97.3,
  // 97.4; 98.7, 99.1 / 98.4, 98.7; 99.4, 99.6 / 99.0, 99.1; 100.1, 100.3 / 100.0, 100.0: the
  // store alone gains RMSNorm nothing there (untimed on an H200) and costs LayerNorm's short
  // rows the input hints' 5-6 points.
  int fwd_hint = 7;
  int rms_fwd_hint = 0;
  // Not kept (built 12-05, third session; measured on an H100, 12-05 10:5x, gpu_norm.sh's
  // STORE_SWEEP of 61fb6b6, two runs each, off / on): the float32 forward's output as streaming
  // data (fwd32_hint; % of copy, RMSNorm fwd H=16384 98.3, 98.3 / 91.8, 90.4, LayerNorm fwd+bwd
  // H=4096 96.0, 95.2 / 96.9, 94.9), and the bf16 ring backward's grad_input as streaming data
  // (bwd_hint; fwd+bwd, RMSNorm H=16384 95.4, 95.3 / 95.9, 91.7, LayerNorm 87.7, 87.5 / 85.9,
  // 84.7; within a point elsewhere). The forward's gain from its store (fwd_hint) did not carry.

  // LayerNorm's 16-bit backward (LEAN, with a bias, not memory_efficient) through bwd_ring_wide:
  // 2 vectors a thread on rows of up to 1024 threads at 64 registers, its bias sums in shared
  // memory, where every thread holds two vectors of the row and an SM holds 32 of its warps (1024
  // threads) at once, the warps it was built for. Bit 1: rows past 4096, against the 4-vector
  // ring's 16 warps; bit 2: rows of 1025-4096, against bwd_ring_r80's 24 (80 registers, three
  // blocks of 256 at 4096). Measured on an H100 (2026-12-05 10:5x, scripts/gpu_norm.sh
  // WIDE_SWEEP=1, bf16 fwd+bwd ms, bwd_wide=0 / 3 in two runs each, before the row rule): H=2048
  // 0.2671, 0.2675 / 0.2630, 0.2641 (rows of 128 threads, two a block: four blocks, 32 warps);
  // 4096 0.5048, 0.4985 / 0.4839, 0.4849 (four blocks of 256); 8192 0.9829, 0.9825 / 0.9444,
  // 0.9428 (two of 512); 16384 2.0518, 2.0503 / 1.9768, 1.9853 (one of 1024); 12288 1.5744,
  // 1.5733 / 1.6642, 1.6640: 1536 vectors on 1024 threads, half of them idle on their second
  // (the 4-vector ring idles a quarter of its 512 threads' slots too, and was faster), so rows
  // that do not fill their threads stay off.
  int bwd_wide = 3;
};

// APEX_NORM_TUNE's knobs: name, field, least and most value (another is ignored, said once).
struct Knob {
  const char* name;
  int Tune::*field;
  int least, most;
};
constexpr int kAny = std::numeric_limits<int>::max();
constexpr Knob kKnobs[] = {
    {"fwd_pt", &Tune::fwd_pt, 1, kAny},           {"bwd_pt", &Tune::bwd_pt, 1, kAny},
    {"fwd_waves", &Tune::fwd_waves, 0, kAny},     {"bwd_waves", &Tune::bwd_waves, 0, kAny},
    {"fwd_pt16", &Tune::fwd_pt16, 1, kAny},       {"bwd_pt16", &Tune::bwd_pt16, 1, kAny},
    {"bwd_ring", &Tune::bwd_ring, 0, 4},          {"smem_kb", &Tune::smem_kb, 0, kAny},
    {"ln_one_pass", &Tune::ln_one_pass, 0, kAny}, {"fwd_r80", &Tune::fwd_r80, 0, kAny},
    {"bwd_r80", &Tune::bwd_r80, 0, kAny},         {"rms_short_pt16", &Tune::rms_short_pt16, 0, kAny},
    {"bwd_wide_pt16", &Tune::bwd_wide_pt16, 0, kAny}, {"bwd_lean", &Tune::bwd_lean, 0, kAny},
    {"fwd_mid_pt16", &Tune::fwd_mid_pt16, 0, kAny}, {"bwd_bias4", &Tune::bwd_bias4, 0, kAny},
    {"fwd_hint", &Tune::fwd_hint, 0, kAny},
    {"rms_fwd_hint", &Tune::rms_fwd_hint, 0, kAny},
    {"bwd_wide", &Tune::bwd_wide, 0, 3},
};

// APEX_NORM_TUNE read into a Tune, and what it gave that was not taken (one line each), which
// Python reads once the library is loaded (apex_norm_tune_notes, ops.py) and warns about. The
// lines are built by checks.h's fmt, not c10::str: its ostream formatting killed the process on
// the GPU machine's toolchain (SIGSEGV in this function, H100 and H200, torch 2.11; faulthandler,
// scripts/debug_tune_segv.sh, 12-05 14:0x), as apex-mta-kernels' checks.h found for its messages.
struct Parsed {
  Tune tune;
  std::string notes;
};

const Parsed& parsed() {
  static const Parsed p = [] {
    Parsed r;
    Tune& v = r.tune;
    auto note = [&](auto&&... parts) { r.notes += fmt("APEX_NORM_TUNE: ", parts..., "\n"); };
    const char* env = std::getenv("APEX_NORM_TUNE");
    if (env == nullptr) return r;
    const std::string str(env);
    size_t pos = 0;
    while (pos < str.size()) {
      size_t end = str.find(',', pos);
      if (end == std::string::npos) end = str.size();
      const std::string item = str.substr(pos, end - pos);
      const size_t eq = item.find('=');
      if (eq != std::string::npos) {
        const std::string key = item.substr(0, eq);
        const Knob* knob = std::find_if(std::begin(kKnobs), std::end(kKnobs),
                                        [&](const Knob& k) { return key == k.name; });
        if (knob == std::end(kKnobs)) {
          note("unknown knob '", key, "' ignored");
        } else {
          const char* text = item.c_str() + eq + 1;
          char* rest = nullptr;
          const long given = std::strtol(text, &rest, 10);
          while (rest != text && *rest == ' ') ++rest;  // "bwd_wide=1 ", as atoi took it
          if (rest == text || *rest != '\0') {
            note(key, "='", text, "' is not an integer: ignored");
          } else if (given < knob->least || given > knob->most) {
            // Not clamped: a bit mask's 4 (bwd_wide: 0-3) would become 3, both bits on.
            note(key, "=", given, " is outside ", knob->least, "..", knob->most, ": ignored");
          } else {
            v.*(knob->field) = int(given);
          }
        }
      }
      pos = end + 1;
    }
    // The forward's hint sets compiled (see fwd_hint): another value runs none.
    for (const auto& [name, value] :
         {std::pair{"fwd_hint", v.fwd_hint}, std::pair{"rms_fwd_hint", v.rms_fwd_hint}}) {
      if (value != 0 && value != kHintY && value != (kHintX | kHintParams | kHintY)) {
        note(name, "=", value, " is not a hint set built (0, 4, 7): none");
      }
    }
    return r;
  }();
  return p;
}

const Tune& tune() { return parsed().tune; }

// The most dynamic shared memory a block of these kernels may ask for: the device's opt-in limit
// (or APEX_NORM_TUNE's smem_kb, the tests' stand-in for a GPU with less) less the largest static
// slots (fwd_fast's).
size_t max_dyn_smem(int device) {
  size_t limit = size_t(device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device));
  if (tune().smem_kb > 0) limit = std::min(limit, size_t(std::max(tune().smem_kb, 16)) * 1024);
  return limit - sizeof(float4) * 2 * kMaxTY * kMaxWarps;
}

// Blocks of `threads` of `kernel` that fit on one SM of `device` (the current one) at once: the
// occupancy calculator, asked once per kernel, block size and device.
// Dynamic shared memory above 48 KB needs the kernel's opt-in first, a function attribute of
// each device's context: done once per kernel and device, for the most any launch can ask there
// (223 KB on sm_90, 159 KB on sm_80: max_dyn_smem).
int blocks_per_sm(const void* kernel, int threads, size_t smem, int device) {
  static std::mutex mu;
  static std::vector<std::tuple<const void*, int, size_t, int, int>> seen;  // ..., device, per SM
  static std::vector<std::pair<const void*, int>> opted;
  int per_sm = 0;
  const std::lock_guard<std::mutex> lock(mu);
  const std::pair<const void*, int> key{kernel, device};
  if (smem > 48 * 1024 && std::find(opted.begin(), opted.end(), key) == opted.end()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(max_dyn_smem(device))));
    opted.push_back(key);
  }
  for (const auto& [k, t, m, d, n] : seen) {
    if (k == kernel && t == threads && m == smem && d == device) per_sm = n;
  }
  if (per_sm == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    per_sm = std::max(per_sm, 1);
    seen.emplace_back(kernel, threads, smem, device, per_sm);
  }
  return per_sm;
}

// ... and on the whole device.
int64_t resident_blocks(const void* kernel, int threads, size_t smem, int device) {
  return int64_t(blocks_per_sm(kernel, threads, smem, device)) * sm_count(device);
}

// The ring's cap on its shared memory: two blocks per SM on sm_90.
constexpr size_t kRingSmemCap = 112 * 1024;

// The ring's stages for `want` (Tune's bwd_ring) given its shared memory for S stages,
// `smem(S)`: fewer where more would pass the cap or the device's limit; 0 where 2 do not fit.
template <typename F>
int ring_stages(int want, int device, F&& smem) {
  const size_t cap = std::min(kRingSmemCap, max_dyn_smem(device));
  while (want > 2 && smem(want) > cap) --want;
  return want >= 2 && smem(want) <= max_dyn_smem(device) ? want : 0;
}

template <typename F>
void dispatch_x(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: break;  // checked before
  }
}

void check_input(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  APEX_CHECK_VALUE(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  const int64_t k = static_cast<int64_t>(shape.size());
  APEX_CHECK_VALUE(k >= 1 && t.dim() >= k && t.sizes().slice(t.dim() - k).equals(shape), op,
                   ": normalized_shape ", shape, " does not match the trailing dimensions of ",
                   name, " with shape ", t.sizes());
}

void check_param(const char* op, const char* name, const std::optional<at::Tensor>& p,
                 const at::Tensor& x, int64_t H) {
  if (!p.has_value()) return;
  APEX_CHECK_VALUE(p->device() == x.device(), op, ": ", name, " is on ", p->device(),
                   " but the input is on ", x.device());
  APEX_CHECK_VALUE(p->numel() == H, op, ": ", name, " has ", p->numel(),
                   " elements but normalized_shape has ", H);
}

// Weight, bias (where given) and the output all in the input's dtype: the LEAN kernels may run.
bool all_in_dtype_of(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  const auto st = x.scalar_type();
  return (!weight || weight->scalar_type() == st) && (!bias || bias->scalar_type() == st) &&
         out.scalar_type() == st;
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

// The forward's vectors a thread (pick's per_thread): fwd_pt for float32; for 16-bit input
// fwd_pt16, but rms_short_pt16 for RMSNorm's rows of at most 256 vectors (H <= 2048) and
// fwd_mid_pt16 for rows of 257-512 (2048 < H <= 4096), each where its knob is not 0.
int fwd_per_thread(int64_t H, bool rms, bool sixteen_bit) {
  const Tune& t = tune();
  if (!sixteen_bit) return t.fwd_pt;
  if (rms && H <= 256 * kVec && t.rms_short_pt16 > 0) return t.rms_short_pt16;
  if (H > 256 * kVec && H <= 512 * kVec && t.fwd_mid_pt16 > 0) return t.fwd_mid_pt16;
  return t.fwd_pt16;
}

template <bool RMS>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_impl(
    const char* op, const at::Tensor& input_, const std::optional<at::Tensor>& weight_,
    const std::optional<at::Tensor>& bias_, at::IntArrayRef normalized_shape, double eps,
    std::optional<at::ScalarType> out_dtype) {
  check_input(op, "input", input_, normalized_shape);
  dt_of(op, "input", input_);  // refuses a dtype the kernels do not take
  const c10::cuda::CUDAGuard guard(input_.device());
  const int64_t H = c10::multiply_integers(normalized_shape);
  check_param(op, "weight", weight_, input_, H);
  check_param(op, "bias", bias_, input_, H);
  const at::Tensor input = input_.contiguous();
  std::optional<at::Tensor> weight, bias;
  if (weight_.has_value()) weight = weight_->contiguous();
  if (bias_.has_value()) bias = bias_->contiguous();
  const int wt = weight ? dt_of(op, "weight", *weight) : (bias ? dt_of(op, "bias", *bias) : kF32);
  APEX_CHECK_TYPE(!(weight && bias) || weight->scalar_type() == bias->scalar_type(), op,
                  ": weight has dtype ", weight ? weight->scalar_type() : at::kFloat,
                  " but bias has dtype ", bias ? bias->scalar_type() : at::kFloat,
                  "; they must match");
  const int64_t rows =
      c10::multiply_integers(input.sizes().slice(0, input.dim() - normalized_shape.size()));
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(out_dtype.value_or(input.scalar_type())));
  const int yt = dt_of(op, "out_dtype", out);
  // RMSNorm has no mean (its op returns none): no allocation for it.
  at::Tensor mean = RMS ? at::Tensor() : at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
  if (rows == 0) return {out, mean, rstd};
  if (H == 0) {
    if (!RMS) mean.fill_(std::numeric_limits<float>::quiet_NaN());
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return {out, mean, rstd};
  }
  FwdArgs a{input.data_ptr(), ptr_or_null(weight), RMS ? nullptr : ptr_or_null(bias), out.data_ptr(),
            RMS ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, H,
            static_cast<float>(eps), wt, yt, tune().ln_one_pass > 0};
  const bool aligned = vec_aligned(input) && vec_aligned(out) && (!weight || vec_aligned(*weight)) &&
                       (!bias || vec_aligned(*bias));
  const Config c = pick(H, aligned, 8, fwd_per_thread(H, RMS, input.element_size() == 2), 1);
  const dim3 block(c.tx, c.ty);
  const int64_t row_blocks = (rows + c.ty - 1) / c.ty;
  auto stream = c10::cuda::getCurrentCUDAStream();
  // fwd_fast's LEAN variant and fwd_fast_r80 (see Tune's fwd_r80).
  const bool same = all_in_dtype_of(input, weight, bias, out);
  dispatch_x(input.scalar_type(), [&](auto tag) {
    using Tx = decltype(tag);
    auto fast = [&](auto nv_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      auto kernel = fwd_fast<Tx, NV, RMS, false>;
      if constexpr (sizeof(Tx) == 2) {
        if (same) {
          // The cap only at 8 vectors a thread, where the row needs more than 80 registers.
          const bool r80 = NV == 8 && (tune().fwd_r80 & (RMS ? 2 : 1));
          auto lean = [&](auto hint_tag) {
            constexpr int HINT = decltype(hint_tag)::value;
            if constexpr (NV == 8) {
              if (r80) return fwd_fast_r80<Tx, NV, RMS, HINT>;
            }
            return fwd_fast<Tx, NV, RMS, true, HINT>;
          };
          // Tune's fwd_hint / rms_fwd_hint: the hint sets compiled (see kHintX), else none.
          switch (RMS ? tune().rms_fwd_hint : tune().fwd_hint) {
            case kHintX | kHintParams | kHintY:
              kernel = lean(std::integral_constant<int, kHintX | kHintParams | kHintY>{});
              break;
            case kHintY: kernel = lean(std::integral_constant<int, kHintY>{}); break;
            default: kernel = lean(std::integral_constant<int, 0>{}); break;
          }
        }
      }
      // A block per TY rows by default; with fwd_waves a persistent grid, each row group walking
      // its rows.
      const int64_t fit = tune().fwd_waves == 0
                              ? row_blocks
                              : resident_blocks(reinterpret_cast<const void*>(kernel), c.tx * c.ty,
                                                0, input.get_device()) * tune().fwd_waves;
      const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(row_blocks, fit)));
      kernel<<<blocks, block, 0, stream>>>(a);
    };
    switch (c.nv) {
      case 1: fast(std::integral_constant<int, 1>{}); break;
      case 2: fast(std::integral_constant<int, 2>{}); break;
      case 4: fast(std::integral_constant<int, 4>{}); break;
      case 8: fast(std::integral_constant<int, 8>{}); break;
      default:
        fwd_generic<Tx, RMS><<<static_cast<unsigned>(row_blocks), block, 0, stream>>>(a);
        break;
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, mean, rstd};
}

template <bool RMS>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_impl(
    const char* op, const at::Tensor& grad_output_, const std::optional<at::Tensor>& mean_,
    const at::Tensor& invvar_, const at::Tensor& xy_, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight_, const std::optional<at::Tensor>& bias_, double eps,
    bool memory_efficient, std::optional<at::ScalarType> grad_input_dtype) {
  check_input(op, "input_or_output", xy_, normalized_shape);
  dt_of(op, "input_or_output", xy_);
  const c10::cuda::CUDAGuard guard(xy_.device());
  const int64_t H = c10::multiply_integers(normalized_shape);
  check_param(op, "weight", weight_, xy_, H);
  check_param(op, "bias", bias_, xy_, H);
  APEX_CHECK_VALUE(grad_output_.sizes().equals(xy_.sizes()), op, ": grad_output has shape ",
                   grad_output_.sizes(), " but input_or_output has shape ", xy_.sizes());
  APEX_CHECK_VALUE(grad_output_.device() == xy_.device(), op, ": grad_output is on ",
                   grad_output_.device(), " but input_or_output is on ", xy_.device());
  const int dyt = dt_of(op, "grad_output", grad_output_);
  const at::Tensor xy = xy_.contiguous();
  const at::Tensor dy = grad_output_.contiguous();
  const int64_t rows = c10::multiply_integers(xy.sizes().slice(0, xy.dim() - normalized_shape.size()));
  APEX_CHECK_VALUE(invvar_.numel() == rows && invvar_.device() == xy.device(), op,
                   ": invvar must hold one value per row (", rows, ") on ", xy.device());
  const bool need_mean = !RMS && !memory_efficient;
  APEX_CHECK_VALUE(!need_mean || (mean_.has_value() && mean_->numel() == rows &&
                                  mean_->device() == xy.device()),
                   op, ": mean must hold one value per row (", rows, ") on ", xy.device(),
                   " unless memory_efficient");
  const at::Tensor rstd = invvar_.to(at::kFloat).contiguous();
  at::Tensor mean;
  if (need_mean) mean = mean_->to(at::kFloat).contiguous();
  std::optional<at::Tensor> weight, bias;
  if (weight_.has_value()) weight = weight_->contiguous();
  if (!RMS && bias_.has_value()) bias = bias_->contiguous();
  const int wt = weight ? dt_of(op, "weight", *weight) : (bias ? dt_of(op, "bias", *bias) : kF32);
  APEX_CHECK_TYPE(!(weight && bias) || weight->scalar_type() == bias->scalar_type(), op,
                  ": weight and bias must have one dtype");
  at::Tensor dx = at::empty(xy.sizes(), xy.options().dtype(grad_input_dtype.value_or(xy.scalar_type())));
  const int dxt = dt_of(op, "grad_input_dtype", dx);
  const auto f32 = xy.options().dtype(at::kFloat);
  at::Tensor gw = weight ? at::empty(weight->sizes(), weight->options()) : at::empty({0}, f32);
  // RMSNorm has no bias gradient (its op returns none): no allocation for it (one is a few us of
  // host time, which at small rows is the call's cost).
  at::Tensor gb = bias ? at::empty(bias->sizes(), bias->options()) : (RMS ? at::Tensor() : at::empty({0}, f32));
  if (rows == 0 || H == 0) {
    gw.zero_();
    if (gb.defined()) gb.zero_();
    return {dx, gw, gb};
  }
  const bool want_w = weight.has_value(), want_b = bias.has_value();
  BwdArgs a{dy.data_ptr(), xy.data_ptr(), need_mean ? mean.data_ptr<float>() : nullptr,
            rstd.data_ptr<float>(), ptr_or_null(weight), ptr_or_null(bias), dx.data_ptr(),
            nullptr, nullptr, rows, H, static_cast<float>(eps), dyt, wt, dxt, memory_efficient};
  const bool aligned = vec_aligned(xy) && vec_aligned(dy) && vec_aligned(dx) &&
                       (!weight || vec_aligned(*weight)) && (!bias || vec_aligned(*bias));
  int per_thread = xy.element_size() == 2 ? tune().bwd_pt16 : tune().bwd_pt;
  if (xy.element_size() == 2 && H > 512 * kVec && tune().bwd_wide_pt16 > 0) {
    // See Tune's bwd_wide_pt16: LayerNorm only where its ring at that shape (2 stages, bias sums
    // in shared memory) fits the device.
    const Config w = pick(H, aligned, 4, tune().bwd_wide_pt16, 32);
    const bool fits = RMS || !bias.has_value() || w.nv == 0 ||
                      bwd_ring_smem(2, w.nv, 1, w.tx * w.ty, ring_bias_in_smem(w.nv, false)) <=
                          max_dyn_smem(xy.get_device());
    if (fits) per_thread = tune().bwd_wide_pt16;
  }
  Config c = pick(H, aligned, 4, per_thread, 32);
  const int device = xy.get_device();
  const bool packed = dy.scalar_type() == xy.scalar_type();  // bwd_fast keeps both packed
  // The ring's LEAN variant (see Tune's bwd_lean): weight, bias and grad_input in the input's dtype.
  const bool lean = tune().bwd_lean > 0 && all_in_dtype_of(xy, weight, bias, dx);
  // Tune's bwd_wide: LayerNorm's 16-bit LEAN rows with a bias (not memory_efficient) past 4096
  // (bit 1) or of 1025-4096 (bit 2) through bwd_ring_wide, at 2 vectors a thread on up to 1024
  // threads, where every thread holds two vectors of the row (not H=12288's 1536 vectors on 1024
  // threads), its ring fits, and an SM holds 1024 of its threads (the occupancy calculator on
  // the real device: smem_kb caps a block's shared memory, not the SM's).
  bool wide = false;
  const int wide_bit = H > 512 * kVec ? 1 : (H > 128 * kVec ? 2 : 0);
  if (!RMS && xy.element_size() == 2 && (tune().bwd_wide & wide_bit) && bias.has_value() &&
      !memory_efficient && packed && lean) {
    const Config w = pick(H, aligned, 2, 2, 32, 1024);
    const int threads = w.tx * w.ty;
    auto smem = [&](int S) { return bwd_ring_smem(S, 2, 1, threads, true); };
    const int stages = ring_stages(tune().bwd_ring, device, smem);
    if (w.nv == 2 && int64_t(w.tx) * 2 == H / kVec && stages >= 2) {
      const void* kernel = nullptr;  // the one launched below (16-bit input here)
      dispatch_x(xy.scalar_type(), [&](auto tag) {
        using Tx = decltype(tag);
        if constexpr (sizeof(Tx) == 2) {
          kernel = reinterpret_cast<const void*>(bwd_ring_wide<Tx, 2, false, false, true>);
        }
      });
      if (blocks_per_sm(kernel, threads, smem(stages), device) * threads >= 1024) {
        c = w;
        wide = true;
      }
    }
  }
  // LayerNorm's row sums (GroupSum<true>'s butterfly) need a power of two of threads a row; a row
  // of more than kMaxTX threads fills its block (GroupSum's slots).
  TORCH_INTERNAL_ASSERT(c.nv == 0 || (c.tx >= 32 && (c.tx & (c.tx - 1)) == 0));
  TORCH_INTERNAL_ASSERT(c.tx <= kMaxTX || c.ty == 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 block(c.tx, c.ty);
  at::Tensor part_w, part_b;
  int64_t groups = 0;
  dispatch_x(xy.scalar_type(), [&](auto tag) {
    using Tx = decltype(tag);
    if (c.nv > 0) {
      const int threads = c.tx * c.ty;
      // 16-bit input with grad_output of its dtype takes bwd_ring where its sums fit the
      // registers (APEX_NORM_TUNE bwd_ring: its stages, fewer where the ring would cap the
      // blocks at one per SM; 0: off, see pick). float32 takes bwd_fast: the ring measured slower
      // there (RMSNorm H=4096 fwd+bwd 66.7 % of copy against 87.4 %).
      const int chunks = int(sizeof(Pack<Tx>) / 16);
      auto ring_smem = [&](int S) {
        return bwd_ring_smem(S, c.nv, chunks, threads, want_b && (ring_bias_in_smem(c.nv, RMS) || wide));
      };
      const int stages = packed && sizeof(Tx) == 2 && ring_fits(c.nv, RMS)
                             ? ring_stages(tune().bwd_ring, device, ring_smem)
                             : 0;
      a.stages = stages;
      const bool ring = stages >= 2;
      const size_t smem = ring ? ring_smem(stages) : bwd_fast_smem(c.nv, threads, want_w, want_b && !RMS);
      auto launch = [&](auto kernel, bool fast) {
        // A persistent grid: at most what fits on the GPU at once. With weight gradients each
        // row group also sums at least ~32 rows, so the float32 partials (written and read
        // again: 16 bytes per column per group for weight and bias) stay about 5 % of the
        // traffic of 16-bit tensors.
        const int64_t row_blocks = (rows + c.ty - 1) / c.ty;
        const int64_t fit = fast ? resident_blocks(reinterpret_cast<const void*>(kernel),
                                                   c.tx * c.ty, smem, device) * std::max(1, tune().bwd_waves)
                                 : int64_t(sm_count(device)) * std::max(1, 2048 / (c.tx * c.ty));
        int64_t blocks = std::min(row_blocks, fit);
        if (want_w || want_b) {
          blocks = std::min(blocks, std::max<int64_t>(sm_count(device), rows / (32 * int64_t(c.ty))));
        }
        blocks = std::max<int64_t>(blocks, 1);
        groups = blocks * c.ty;
        if (want_w || want_b) {
          part_w = at::empty({groups, H}, f32);
          a.part_w = part_w.data_ptr<float>();
          if (want_b) {
            part_b = at::empty({groups, H}, f32);
            a.part_b = part_b.data_ptr<float>();
          }
        }
        kernel<<<dim3(static_cast<unsigned>(blocks)), block, fast ? smem : 0, stream>>>(a);
      };
      // One of three kernels, each instantiated only where it can be picked: bwd_ring for 16-bit
      // input where its weight sums fit the registers; bwd_fast (the next row prefetched into
      // registers where two rows fit: 16 bytes of each per thread) for the other packed cases,
      // and for LayerNorm's 4-vector rows where the ring with its bias sums does not fit the
      // device; bwd_vec (no packing, a block per row groups) where grad_output has another
      // dtype, or where neither fits the device's shared memory (GPUs with ~100 KB a block:
      // sm_86, sm_89, sm_120 run the sm_80 build), or the ring is off.
      auto pick = [&](auto nv_tag) {
        constexpr int NV = decltype(nv_tag)::value;
        constexpr bool kRing = sizeof(Tx) == 2 && ring_fits(NV, RMS);
        constexpr bool kFast = !kRing || ring_bias_in_smem(NV, RMS);
        if constexpr (kRing) {
          if (packed && ring) {
            if constexpr (NV == 2 && !RMS) {
              // Tune's bwd_wide.
              if (wide) return launch(bwd_ring_wide<Tx, NV, RMS, false, true>, true);
            }
            // LayerNorm's 4-vector ring with its bias sums one float each (Tune's bwd_bias4).
            if constexpr (ring_bias_in_smem(NV, RMS)) {
              if (tune().bwd_bias4 == 0) {
                return memory_efficient ? launch(bwd_ring<Tx, NV, RMS, true, false, false>, true)
                                        : launch(bwd_ring<Tx, NV, RMS, false, false, false>, true);
              }
            }
            if (memory_efficient) return launch(bwd_ring<Tx, NV, RMS, true, false>, true);
            // LEAN (weight, bias and grad_input in the input's dtype): no run-time dtype branches.
            auto plain = [&](auto lean_tag) {
              constexpr bool L = decltype(lean_tag)::value;
              // Rows of 2 vectors only: at 4, 80 registers spilled (LayerNorm's LEAN ring 232
              // bytes, 18:1x build; memory_efficient, which takes bwd_ring above, 300+).
              if constexpr (NV == 2) {
                if ((tune().bwd_r80 & (RMS ? 2 : 1)) && c.tx <= 256) {
                  return launch(bwd_ring_r80<Tx, NV, RMS, false, L>, true);
                }
              }
              launch(bwd_ring<Tx, NV, RMS, false, L>, true);
            };
            // Rows of 1-2 vectors, and RMSNorm's 4-vector rows of 512 threads (8192 < H <=
            // 16384; measured at 16384): at 4 vectors LEAN measured slower elsewhere (H200
            // 18:1x, fwd+bwd ms, LEAN / general: RMSNorm H=8192 at 80 registers 0.853 /
            // 0.714-0.719, LayerNorm H=8192 0.926 / 0.865-0.869, H=16384 1.923 / 1.840-1.844)
            // but for those rows: 1.390-1.395 / 1.416-1.451. In the 19:5x A/B against 303a4bf
            // (LEAN with the new colsum / the general ring with the old): 1.4404, 1.4198 /
            // 1.4727, 1.4443.
            if constexpr (NV <= 2 || RMS) {
              if (lean && (NV <= 2 || c.tx > 256)) return plain(std::true_type{});
            }
            // LayerNorm's 4-vector rows through LEAN with the bias sums in shared memory measured
            // slower still (H200 2026-12-05 03:4x, bf16 fwd+bwd % of copy at H = 8192 / 12288 /
            // 16384, two runs: 67.3, 67.6 / 59.6, 60.3 / 55.8, 56.4 against 78.5, 78.2 / 68.3,
            // 68.3 / 69.1, 69.0 through the general ring), though it holds 2096 SASS
            // instructions to the general one's 8928: not built.
            return plain(std::false_type{});
          }
        }
        if constexpr (kFast) {
          constexpr bool PF = NV < 4 || sizeof(Tx) == 2;
          if (packed && smem <= max_dyn_smem(device)) {
            return launch(memory_efficient ? bwd_fast<Tx, NV, RMS, PF, true> : bwd_fast<Tx, NV, RMS, PF, false>,
                          true);
          }
        }
        launch(bwd_vec<Tx, NV, RMS>, false);
      };
      switch (c.nv) {
        case 1: pick(std::integral_constant<int, 1>{}); break;
        case 2: pick(std::integral_constant<int, 2>{}); break;
        default: pick(std::integral_constant<int, 4>{}); break;
      }
    } else {
      const dim3 grid(static_cast<unsigned>((rows + c.ty - 1) / c.ty));
      bwd_generic<Tx, RMS><<<grid, block, 0, stream>>>(a);
      if (want_w || want_b) {
        // Enough row ranges to fill the GPU; each has at least 32 rows.
        const int64_t col_blocks = (H + 255) / 256;
        const int64_t splits = std::max<int64_t>(
            1, std::min<int64_t>((rows + 31) / 32, (int64_t(sm_count(device)) * 8 + col_blocks - 1) / col_blocks));
        const int64_t per = (rows + splits - 1) / splits;
        groups = (rows + per - 1) / per;
        part_w = at::empty({groups, H}, f32);
        a.part_w = part_w.data_ptr<float>();
        if (want_b) {
          part_b = at::empty({groups, H}, f32);
          a.part_b = part_b.data_ptr<float>();
        }
        colpart<Tx, RMS><<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups)), 256, 0,
                            stream>>>(a, per);
      }
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ColSums sums{};
  unsigned n = 0;
  if (want_w) {
    sums.part[n] = part_w.data_ptr<float>();
    sums.out[n++] = gw.data_ptr();
  }
  if (want_b) {
    sums.part[n] = part_b.data_ptr<float>();
    sums.out[n++] = gb.data_ptr();
  }
  if (n > 0) {
    const int width = colsum_width(H);
    const dim3 grid(static_cast<unsigned>((H + width - 1) / width), n);
    auto kernel = width == 32 ? colsum<32> : width == 16 ? colsum<16> : colsum<8>;
    kernel<<<grid, kColsumThreads, 0, stream>>>(sums, groups, H, wt);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef normalized_shape, double eps,
    bool /*memory_efficient: what autograd saves*/, std::optional<at::ScalarType> out_dtype) {
  return fwd_impl<false>("layer_norm_fwd", input, weight, bias, normalized_shape, eps, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& weight,
                                                     at::IntArrayRef normalized_shape, double eps,
                                                     bool /*memory_efficient*/,
                                                     std::optional<at::ScalarType> out_dtype) {
  auto [out, mean, rstd] =
      fwd_impl<true>("rms_norm_fwd", input, weight, std::nullopt, normalized_shape, eps, out_dtype);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& mean, const at::Tensor& invvar,
    const at::Tensor& input_or_output, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool memory_efficient, std::optional<at::ScalarType> grad_input_dtype) {
  return bwd_impl<false>("layer_norm_bwd", grad_output, mean, invvar, input_or_output,
                         normalized_shape, weight, bias, eps, memory_efficient, grad_input_dtype);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(
    const at::Tensor& grad_output, const at::Tensor& invvar, const at::Tensor& input_or_output,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight, double eps,
    bool memory_efficient, std::optional<at::ScalarType> grad_input_dtype) {
  auto [dx, gw, gb] = bwd_impl<true>("rms_norm_bwd", grad_output, std::nullopt, invvar,
                                     input_or_output, normalized_shape, weight, std::nullopt, eps,
                                     memory_efficient, grad_input_dtype);
  return {dx, gw};
}

}  // namespace
}  // namespace apex_norm

TORCH_LIBRARY_IMPL(apex_norm, CUDA, m) {
  m.impl("layer_norm_fwd", &apex_norm::layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &apex_norm::layer_norm_bwd_cuda);
  m.impl("rms_norm_fwd", &apex_norm::rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &apex_norm::rms_norm_bwd_cuda);
}

// What APEX_NORM_TUNE gave that was not taken, one line each ("" when nothing), read through
// ctypes once the library is loaded (ops.py warns with each line). The first call reads the
// variable, before any kernel runs.
extern "C" __attribute__((visibility("default"))) const char* apex_norm_tune_notes() {
  return apex_norm::parsed().notes.c_str();
}
