// multi_tensor_l2norm and its variants: the L2 norm of a list of tensors, in total and per tensor.
//
//   multi_tensor_l2norm          ||x||
//   multi_tensor_l2norm_mp       ||x||, nothing read and zeros returned once noop_flag is set
//   multi_tensor_l2norm_scale    ||in||, and out = in * scale on the way
//   multi_tensor_unscale_l2norm  ||x * inv_scale||, inv_scale a device scalar (capturable)
//
// Two passes, no atomics, so a result is bitwise the same on every run. Pass 1 is the harness's
// launch, one block per 65536-element chunk; each block writes its chunk's float32 sum of squares
// to its own slot of a workspace, and sets noop_flag when that sum is not finite (apex's rule: an
// inf or nan element, or squares that overflow float32). A tensor's slots are contiguous and in
// chunk order, and the host knows where each tensor's run of slots starts, since the harness
// numbers blocks in the order of the positions it is given. Pass 2 sums the slots in a fixed
// order, one block per tensor plus one for the total, and takes the square roots.
#include "checks.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace apex_mta {
namespace {

enum class Norm {
  kPlain,      // ||x||
  kMp,         // ||x||, skipped when noop_flag is already set
  kScaleOut,   // ||in||, out = in * scale
  kUnscale,    // ||x * inv_scale||
};

// Sum of `v` over the block, in a fixed order; the result is valid in thread 0.
template <int NT>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(NT % 32 == 0 && NT <= 1024, "whole warps");
  __shared__ float warp_sums[NT / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += warp_sums[w];
  }
  return s;
}

// Pass 1. DEPTH 1 reads one list; DEPTH 2 (kScaleOut) reads list 0 and writes list 1.
template <Norm K, int DEPTH, typename Tin, typename Tout>
struct NormFunctor {
  __device__ __forceinline__ void operator()(const TensorListMeta<DEPTH>& m, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, float* partials, int64_t base,
                                             int* noop, float scale, const float* inv_scale) const {
    const Tin* in = static_cast<const Tin*>(m.ptr[0][t]);
    Tout* out = static_cast<Tout*>(m.ptr[DEPTH - 1][t]);
    constexpr int E = vec_elems<Tin, Tout>();
    float mul = 1.f;  // applied before squaring
    if constexpr (K == Norm::kUnscale) mul = *inv_scale;
    // kMp: a set flag means the result is thrown away; still take part in the block sum below.
    bool skip = false;
    if constexpr (K == Norm::kMp) skip = *static_cast<volatile int*>(noop) != 0;

    // kAcc running sums per thread: shorter dependency chains, smaller rounding error.
    constexpr int kAcc = 4;
    float acc[kAcc];
#pragma unroll
    for (int k = 0; k < kAcc; ++k) acc[k] = 0.f;

    int64_t i = skip ? end : start;
    if (!skip && aligned16(in) && (K != Norm::kScaleOut || aligned16(out))) {
      // The loads stay raw 16-byte words until used (4 registers per vector rather than E
      // floats): at most 40 registers, so three or four 512-thread blocks fit on an SM.
      constexpr int W = E * sizeof(Tin) / 16;
      constexpr int U = kBytesInFlight / (16 * W);
      const int64_t vec_end = start + (end - start) / E * E;
      const int64_t stride = int64_t(kThreads) * E;
      for (int64_t b = start + threadIdx.x * E; b < vec_end; b += stride * U) {
        uint4 raw[U][W];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = b + u * stride;
          if (j < vec_end) {
#pragma unroll
            for (int w = 0; w < W; ++w) raw[u][w] = reinterpret_cast<const uint4*>(in + j)[w];
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = b + u * stride;
          if (j < vec_end) {
            const Tin* e = reinterpret_cast<const Tin*>(raw[u]);
            float o[E];
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float x = to_float(e[k]);
              const float xm = x * mul;
              acc[k % kAcc] = fmaf(xm, xm, acc[k % kAcc]);
              if constexpr (K == Norm::kScaleOut) o[k] = x * scale;
            }
            if constexpr (K == Norm::kScaleOut) store_vec<E>(out + j, o);
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      const float x = to_float(in[j]);
      const float xm = x * mul;
      acc[0] = fmaf(xm, xm, acc[0]);
      if constexpr (K == Norm::kScaleOut) out[j] = from_float<Tout>(x * scale);
    }

    float s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    s = block_sum<kThreads>(s);
    if (threadIdx.x == 0) {
      partials[base + m.block_offset + blockIdx.x] = s;
      if (!isfinite(s)) *noop = 1;  // racy but idempotent, as in apex
    }
  }
};

// ---- pass 2 ----------------------------------------------------------------------------------

constexpr int kFinalThreads = 512;

// Sum of partials[0, n) over the block in a fixed order (valid in thread 0).
__device__ __forceinline__ float sum_slots(const float* p, int64_t n) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t j = threadIdx.x;
  for (; j + 3 * kFinalThreads < n; j += 4 * kFinalThreads) {
#pragma unroll
    for (int u = 0; u < 4; ++u) a[u] += p[j + u * kFinalThreads];
  }
  for (; j < n; j += kFinalThreads) a[0] += p[j];
  return block_sum<kFinalThreads>((a[0] + a[1]) + (a[2] + a[3]));
}

// One launch's share of the per-tensor norms: block b < count sums the slots of tensor
// first_position + b; with `with_total`, block `count` sums every slot into the total.
struct FinalMeta {
  static constexpr int kMax = (kParamBytes - 64) / 8;
  int32_t first_slot[kMax];
  int32_t nslots[kMax];
  int64_t first_position;
  int32_t count;
};

__device__ __forceinline__ bool zeroed(bool skip_if_flagged, const int* noop) {
  return skip_if_flagged && *noop != 0;
}

__global__ void __launch_bounds__(kFinalThreads)
per_tensor_kernel(const __grid_constant__ FinalMeta fm, const float* partials, int64_t npartials,
                  float* per_tensor, float* total, bool with_total, const int* noop, bool skip_if_flagged) {
  const bool zero = zeroed(skip_if_flagged, noop);
  const int b = blockIdx.x;
  if (b < fm.count) {
    const float s = zero ? 0.f : sum_slots(partials + fm.first_slot[b], fm.nslots[b]);
    if (threadIdx.x == 0) per_tensor[fm.first_position + b] = __fsqrt_rn(s);
  } else if (with_total) {
    const float s = zero ? 0.f : sum_slots(partials, npartials);
    if (threadIdx.x == 0) total[0] = __fsqrt_rn(s);
  }
}

__global__ void __launch_bounds__(kFinalThreads)
total_kernel(const float* partials, int64_t npartials, float* total, const int* noop, bool skip_if_flagged) {
  const float s = zeroed(skip_if_flagged, noop) ? 0.f : sum_slots(partials, npartials);
  if (threadIdx.x == 0) total[0] = __fsqrt_rn(s);
}

// ---- host ------------------------------------------------------------------------------------

template <Norm K>
std::tuple<at::Tensor, at::Tensor> norms(const std::vector<ListArg>& lists, const at::Tensor& noop_flag,
                                         bool per_tensor, float scale, const float* inv_scale) {
  const std::vector<at::Tensor>& first = *lists[0].list;
  const int64_t n = static_cast<int64_t>(first.size());
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(noop_flag.device());
  const auto groups = group_by_dtype(lists);

  // Slot of each tensor's first chunk, in the order the launches below number their blocks.
  std::vector<int32_t> first_slot(n, 0), nslots(n, 0);
  std::vector<int64_t> group_base;
  int64_t nparts = 0;
  for (const auto& [dtypes, idx] : groups) {
    group_base.push_back(nparts);
    for (int64_t i : idx) {
      const int64_t nb = (first[i].numel() + kChunk - 1) / kChunk;
      first_slot[i] = static_cast<int32_t>(nparts);
      nslots[i] = static_cast<int32_t>(nb);
      nparts += nb;
    }
  }
  at::Tensor total = at::empty({1}, fopts);
  at::Tensor per = at::empty({per_tensor ? n : 0}, fopts);
  if (nparts == 0) {  // no tensors, or only empty ones: every norm is 0
    total.zero_();
    per.zero_();
    return {total, per};
  }
  APEX_CHECK(nparts <= INT32_MAX, "multi_tensor_l2norm: too many chunks");

  at::Tensor ws = at::empty({nparts}, fopts);
  float* partials = ws.data_ptr<float>();
  int* noop = noop_flag.data_ptr<int>();
  size_t g = 0;
  for (const auto& [dtypes, idx] : groups) {
    const int64_t base = group_base[g++];
    APEX_DISPATCH_FLOAT(dtypes[0], Tin, [&] {
      if constexpr (K == Norm::kScaleOut) {
        APEX_DISPATCH_FLOAT(dtypes[1], Tout, [&] {
          launch<2>({lists[0].list, lists[1].list}, idx, NormFunctor<K, 2, Tin, Tout>{}, partials, base,
                    noop, scale, inv_scale);
        });
      } else {
        launch<1>({lists[0].list}, idx, NormFunctor<K, 1, Tin, Tin>{}, partials, base, noop, scale,
                  inv_scale);
      }
    });
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool skip = K == Norm::kMp;
  if (!per_tensor) {
    total_kernel<<<1, kFinalThreads, 0, stream>>>(partials, nparts, total.data_ptr<float>(), noop, skip);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {total, per};
  }
  FinalMeta fm;
  for (int64_t p0 = 0; p0 < n; p0 += FinalMeta::kMax) {
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(FinalMeta::kMax, n - p0));
    for (int32_t b = 0; b < count; ++b) {
      fm.first_slot[b] = first_slot[p0 + b];
      fm.nslots[b] = nslots[p0 + b];
    }
    fm.first_position = p0;
    fm.count = count;
    const bool with_total = p0 + count == n;
    per_tensor_kernel<<<count + (with_total ? 1 : 0), kFinalThreads, 0, stream>>>(
        fm, partials, nparts, per.data_ptr<float>(), total.data_ptr<float>(), with_total, noop, skip);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {total, per};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors_, const at::Tensor& noop_flag,
                                                            bool per_tensor) {
  const std::vector<at::Tensor> tensors = tensors_.vec();
  const std::vector<ListArg> lists{{"tensors", &tensors}};
  check_lists("multi_tensor_l2norm", lists, noop_flag);
  return norms<Norm::kPlain>(lists, noop_flag, per_tensor, 1.f, nullptr);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_mp_cuda(at::TensorList tensors_,
                                                               const at::Tensor& noop_flag, bool per_tensor) {
  const std::vector<at::Tensor> tensors = tensors_.vec();
  const std::vector<ListArg> lists{{"tensors", &tensors}};
  check_lists("multi_tensor_l2norm_mp", lists, noop_flag);
  return norms<Norm::kMp>(lists, noop_flag, per_tensor, 1.f, nullptr);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_scale_cuda(at::TensorList inputs_, at::TensorList outputs_,
                                                                  const at::Tensor& noop_flag, double scale,
                                                                  bool per_tensor) {
  const std::vector<at::Tensor> inputs = inputs_.vec(), outputs = outputs_.vec();
  const std::vector<ListArg> lists{{"inputs", &inputs}, {"outputs", &outputs}};
  check_lists("multi_tensor_l2norm_scale", lists, noop_flag);
  return norms<Norm::kScaleOut>(lists, noop_flag, per_tensor, static_cast<float>(scale), nullptr);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(at::TensorList tensors_,
                                                                    const at::Tensor& noop_flag,
                                                                    const at::Tensor& inv_scale, bool per_tensor) {
  const char* op = "multi_tensor_unscale_l2norm";
  const std::vector<at::Tensor> tensors = tensors_.vec();
  const std::vector<ListArg> lists{{"tensors", &tensors}};
  check_lists(op, lists, noop_flag);
  APEX_CHECK_TYPE(inv_scale.scalar_type() == at::kFloat, op, ": inv_scale must be a float32 tensor, got ",
                   dtype_str(inv_scale.scalar_type()));
  APEX_CHECK_VALUE(inv_scale.numel() == 1, op, ": inv_scale must have exactly one element, got ",
                    inv_scale.numel());
  APEX_CHECK_VALUE(inv_scale.device() == noop_flag.device(), op, ": inv_scale is on ", inv_scale.device(),
                    " but noop_flag is on ", noop_flag.device(), "; every tensor must be on one device");
  return norms<Norm::kUnscale>(lists, noop_flag, per_tensor, 1.f, inv_scale.data_ptr<float>());
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_l2norm", &apex_mta::multi_tensor_l2norm_cuda);
  m.impl("multi_tensor_l2norm_mp", &apex_mta::multi_tensor_l2norm_mp_cuda);
  m.impl("multi_tensor_l2norm_scale", &apex_mta::multi_tensor_l2norm_scale_cuda);
  m.impl("multi_tensor_unscale_l2norm", &apex_mta::multi_tensor_unscale_l2norm_cuda);
}
