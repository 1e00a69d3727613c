// The multi-tensor-apply harness: one launch covers many tensors.
//
// Tensor addresses, sizes and the block -> (tensor, chunk) map travel as one kernel parameter
// (a __grid_constant__ struct of up to ~32 KB, the limit since CUDA 12.1 on sm_70+), so there is
// no device-side metadata buffer to allocate, upload or keep alive, and a captured CUDA graph
// carries its own copy. Each block finds its tensor by binary search over a prefix sum of chunk
// counts, so the map costs 4 bytes per tensor rather than per block.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace apex_mta {

// Elements per block. Large enough that the per-block binary search and tail handling vanish
// next to the traffic; a multiple of every vector width so chunk starts stay 16-byte aligned.
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;
constexpr int kParamBytes = 32000;  // under the 32764-byte kernel parameter limit

template <int DEPTH>
struct TensorListMeta {
  static constexpr int kMaxTensors = (kParamBytes - 64) / (DEPTH * 8 + 8 + 4 + 4);
  void* ptr[DEPTH][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t block_start[kMaxTensors + 1];  // block_start[t] = first block of tensor t
  int32_t position[kMaxTensors];         // index in the caller's lists of tensor t of this launch
  int32_t ntensors;
  int32_t block_offset;  // blocks launched before this launch in the same launch() call
};

// Which tensor of this launch block `b` works on.
template <int DEPTH>
__device__ __forceinline__ int locate(const TensorListMeta<DEPTH>& m, int32_t b) {
  int lo = 0, hi = m.ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (m.block_start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <int DEPTH, typename Functor, typename... Args>
__global__ void __launch_bounds__(kThreads)
mta_kernel(const __grid_constant__ TensorListMeta<DEPTH> meta, Functor f, Args... args) {
  const int32_t b = blockIdx.x;
  const int t = locate(meta, b);
  const int64_t chunk = b - meta.block_start[t];
  const int64_t start = chunk * kChunk;
  const int64_t n = meta.numel[t];
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  f(meta, t, chunk, start, end, args...);
}

// Launch `f` over positions `idx` of DEPTH parallel tensor lists (all checked beforehand).
// Zero-size tensors are skipped. Returns the number of launches.
template <int DEPTH, typename Functor, typename... Args>
int launch(const std::array<const std::vector<at::Tensor>*, DEPTH>& lists,
           const std::vector<int64_t>& idx, Functor f, Args... args) {
  using Meta = TensorListMeta<DEPTH>;
  if (idx.empty()) return 0;
  const at::Tensor& first = (*lists[0])[idx[0]];
  const c10::cuda::CUDAGuard guard(first.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Meta meta;
  meta.ntensors = 0;
  meta.block_start[0] = 0;
  meta.block_offset = 0;
  int launches = 0;
  auto flush = [&]() {
    if (meta.ntensors == 0) return;
    const int32_t blocks = meta.block_start[meta.ntensors];
    mta_kernel<DEPTH, Functor, Args...><<<blocks, kThreads, 0, stream>>>(meta, f, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ++launches;
    meta.block_offset += blocks;
    meta.ntensors = 0;
  };
  for (int64_t i : idx) {
    const int64_t n = (*lists[0])[i].numel();
    if (n == 0) continue;
    const int64_t nblocks = (n + kChunk - 1) / kChunk;
    if (meta.ntensors == Meta::kMaxTensors ||
        int64_t(meta.block_start[meta.ntensors]) + nblocks > INT32_MAX) {
      flush();
    }
    const int t = meta.ntensors;
    meta.position[t] = static_cast<int32_t>(i);
    for (int d = 0; d < DEPTH; ++d) meta.ptr[d][t] = (*lists[d])[i].data_ptr();
    meta.numel[t] = n;
    meta.block_start[t + 1] = meta.block_start[t] + static_cast<int32_t>(nblocks);
    meta.ntensors = t + 1;
  }
  flush();
  return launches;
}

// ---- vector access -------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }

// E elements of T moved as E*sizeof(T)/16 16-byte words (E*sizeof(T) must be a multiple of 16).
template <int E, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[E]) {
  static_assert((E * sizeof(T)) % 16 == 0, "vector must be whole 16-byte words");
  constexpr int W = E * sizeof(T) / 16;
  uint4 raw[W];
#pragma unroll
  for (int j = 0; j < W; ++j) raw[j] = reinterpret_cast<const uint4*>(p)[j];
  const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int k = 0; k < E; ++k) v[k] = to_float(e[k]);
}

template <int E, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[E]) {
  static_assert((E * sizeof(T)) % 16 == 0, "vector must be whole 16-byte words");
  constexpr int W = E * sizeof(T) / 16;
  uint4 raw[W];
  T* e = reinterpret_cast<T*>(raw);
#pragma unroll
  for (int k = 0; k < E; ++k) e[k] = from_float<T>(v[k]);
#pragma unroll
  for (int j = 0; j < W; ++j) reinterpret_cast<uint4*>(p)[j] = raw[j];
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Elements per thread per step: enough that the narrowest type moves 16 bytes.
template <typename... Ts>
constexpr int vec_elems() {
  constexpr size_t sizes[] = {sizeof(Ts)...};
  size_t m = 16;
  for (size_t s : sizes) m = s < m ? s : m;
  return static_cast<int>(16 / m);
}

// ---- shared by the kernels: widths, element and scalar access ---------------------------------

// Input bytes in flight per thread and iteration: four 16-byte loads (as many 8-byte loads of a
// 16-bit list beside a float32 one).
constexpr int kBytesInFlight = 64;

// E elements of T as one machine word: 16 bytes, or 8 for a 16-bit role beside a 32-bit one.
template <int E, typename T>
using Word = std::conditional_t<E * sizeof(T) == 16, uint4, uint2>;

template <typename... Ts>
constexpr int max_size() {
  constexpr size_t sizes[] = {sizeof(Ts)...};
  size_t m = 0;
  for (size_t s : sizes) m = s > m ? s : m;
  return static_cast<int>(m);
}

// E elements of T as one 16-byte word (load_vec/store_vec) or, for a 16-bit T beside 32-bit
// roles, one 8-byte word.
template <int E, typename T>
__device__ __forceinline__ void load_elems(const T* p, float (&v)[E]) {
  if constexpr (E * sizeof(T) % 16 == 0) {
    load_vec<E>(p, v);
  } else {
    static_assert(E * sizeof(T) == 8, "a vector is 8 or 16 bytes");
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < E; ++k) v[k] = to_float(e[k]);
  }
}

template <int E, typename T>
__device__ __forceinline__ void store_elems(T* p, const float (&v)[E]) {
  if constexpr (E * sizeof(T) % 16 == 0) {
    store_vec<E>(p, v);
  } else {
    static_assert(E * sizeof(T) == 8, "a vector is 8 or 16 bytes");
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < E; ++k) e[k] = from_float<T>(v[k]);
    *reinterpret_cast<uint2*>(p) = raw;
  }
}

// x as it reads back after being stored as T.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return to_float(from_float<T>(x));
  }
}

// dtype codes of device scalars (lr, step, inv_scale) and of the roles of the generic paths,
// whose dtypes are known only at run time.
enum Kind : int { kF32 = 0, kF64 = 1, kI32 = 2, kI64 = 3, kF16 = 4, kBF16 = 5 };

inline int kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return -1;
  }
}

// A one-element device tensor of dtype `kind` (float32, float64, int32 or int64) as a float.
__device__ __forceinline__ float read_scalar(const void* p, int kind) {
  switch (kind) {
    case kF64: return static_cast<float>(*static_cast<const double*>(p));
    case kI32: return static_cast<float>(*static_cast<const int32_t*>(p));
    case kI64: return static_cast<float>(*static_cast<const int64_t*>(p));
    default: return *static_cast<const float*>(p);
  }
}

// Element i of a float32, float16 or bfloat16 list whose dtype is `kind`, and back.
__device__ __forceinline__ float load_any(const void* p, int kind, int64_t i) {
  switch (kind) {
    case kF16: return to_float(static_cast<const at::Half*>(p)[i]);
    case kBF16: return to_float(static_cast<const at::BFloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ float round_any(float x, int kind) {
  switch (kind) {
    case kF16: return round_to<at::Half>(x);
    case kBF16: return round_to<at::BFloat16>(x);
    default: return x;
  }
}

__device__ __forceinline__ void store_any(void* p, int kind, int64_t i, float x) {
  switch (kind) {
    case kF16: static_cast<at::Half*>(p)[i] = from_float<at::Half>(x); break;
    case kBF16: static_cast<at::BFloat16*>(p)[i] = from_float<at::BFloat16>(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

}  // namespace apex_mta
