// SyncBatchNorm's kernels: per-channel Welford statistics, the cross-rank merge, the forward
// normalisation (optional residual and fused ReLU), the backward reductions and the backward
// elementwise pass. Inputs are contiguous, in one of two layouts (see ops.py):
//   NCL (N, C, L): channels first; a channel is N runs of L contiguous elements.
//   MC  (M, C):    channels last; a row holds every channel.
// Statistics and reductions are float32. Reductions run in two launches: blocks write float32
// partials to a workspace, a second kernel merges them per channel (no atomics, so results are
// the same bit for bit on every run). Indexing is 64-bit; loads are 16-byte vectors where the
// layout and alignment allow.
#include "par_checks.h"

#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace apex_parallel {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsMC = 8;  // threadIdx.y extent of the channels-last reductions

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// ---- Welford helpers ---------------------------------------------------------------------------

__device__ __forceinline__ void welford_add(float& mean, float& m2, float inv_n, float x) {
  // inv_n = 1 / n, where n already counts x (one reciprocal serves a whole row of channels).
  const float delta = x - mean;
  mean += delta * inv_n;
  m2 += delta * (x - mean);
}

// Chan et al.: merge (mean_b, m2_b, n_b) into (mean, m2, n).
__device__ __forceinline__ void chan_merge(float& mean, float& m2, float& n, float mean_b, float m2_b,
                                           float n_b) {
  if (n_b == 0.f) return;
  if (n == 0.f) {
    mean = mean_b;
    m2 = m2_b;
    n = n_b;
    return;
  }
  const float total = n + n_b;
  const float delta = mean_b - mean;
  const float r = n_b / total;
  mean += delta * r;
  m2 += m2_b + delta * delta * n * r;
  n = total;
}

// Merges the (mean, m2, n) of every thread of a 1-D block; thread 0 holds the result.
__device__ void block_welford(float& mean, float& m2, float& n) {
  __shared__ float sh[3][32];
  for (int off = 16; off > 0; off >>= 1) {
    const float mb = __shfl_down_sync(0xffffffff, mean, off);
    const float m2b = __shfl_down_sync(0xffffffff, m2, off);
    const float nb = __shfl_down_sync(0xffffffff, n, off);
    chan_merge(mean, m2, n, mb, m2b, nb);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sh[0][warp] = mean;
    sh[1][warp] = m2;
    sh[2][warp] = n;
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x >> 5;
    mean = lane < nwarps ? sh[0][lane] : 0.f;
    m2 = lane < nwarps ? sh[1][lane] : 0.f;
    n = lane < nwarps ? sh[2][lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) {
      const float mb = __shfl_down_sync(0xffffffff, mean, off);
      const float m2b = __shfl_down_sync(0xffffffff, m2, off);
      const float nb = __shfl_down_sync(0xffffffff, n, off);
      chan_merge(mean, m2, n, mb, m2b, nb);
    }
  }
}

// Sums a and b over a 1-D block; thread 0 holds the result.
__device__ void block_sum2(float& a, float& b) {
  __shared__ float sh[2][32];
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_down_sync(0xffffffff, a, off);
    b += __shfl_down_sync(0xffffffff, b, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sh[0][warp] = a;
    sh[1][warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x >> 5;
    a = lane < nwarps ? sh[0][lane] : 0.f;
    b = lane < nwarps ? sh[1][lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_down_sync(0xffffffff, a, off);
      b += __shfl_down_sync(0xffffffff, b, off);
    }
  }
}

// A per-channel parameter of any float dtype (0 float32, 1 float16, 2 bfloat16), or `dflt`.
__device__ __forceinline__ float load_param(const void* p, int dtype, int64_t c, float dflt) {
  if (p == nullptr) return dflt;
  if (dtype == 0) return static_cast<const float*>(p)[c];
  if (dtype == 1) return static_cast<float>(static_cast<const at::Half*>(p)[c]);
  return static_cast<float>(static_cast<const at::BFloat16*>(p)[c]);
}

// ---- statistics ------------------------------------------------------------------------------

// Channel c's packs form one flat range k = row * Lv + pack (Lv = L / VEC); block (c, s) takes
// the s-th of S equal pieces and writes its partial (mean, m2, n) to ws[s][c]. Short rows (small
// L) keep every thread busy, one huge row still spreads over S blocks, and the (row, pack)
// cursor advances by additions.
template <typename T, int VEC>
__global__ void stats_ncl_kernel(const T* __restrict__ x, int64_t N, int64_t C, int64_t L, int S,
                                 float* __restrict__ ws) {
  const int64_t c = blockIdx.x;
  const int s = blockIdx.y;
  float mean = 0.f, m2 = 0.f, n = 0.f;
  const int64_t Lv = L / VEC;
  const int64_t step = blockDim.x;
  const int64_t step_rows = step / Lv, step_rem = step % Lv;
  const int64_t total = N * Lv, chunk = (total + S - 1) / S;
  const int64_t k_end = std::min<int64_t>(total, (s + 1) * chunk);
  int64_t k = s * chunk + threadIdx.x;
  int64_t row = k / Lv, j = k % Lv;
  for (; k < k_end; k += step) {
    const Pack<T, VEC> p = reinterpret_cast<const Pack<T, VEC>*>(x + (row * C + c) * L)[j];
    // The pack's own mean and m2 first, then one Chan merge: one division per pack.
    float f[VEC], pmean = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      f[v] = static_cast<float>(p.v[v]);
      pmean += f[v];
    }
    pmean *= 1.f / VEC;
    float pm2 = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) pm2 += (f[v] - pmean) * (f[v] - pmean);
    chan_merge(mean, m2, n, pmean, pm2, static_cast<float>(VEC));
    j += step_rem;
    row += step_rows;
    if (j >= Lv) {
      j -= Lv;
      ++row;
    }
  }
  block_welford(mean, m2, n);
  if (threadIdx.x == 0) {
    float* out = ws + (static_cast<int64_t>(s) * C + c) * 3;
    out[0] = mean;
    out[1] = m2;
    out[2] = n;
  }
}

// Block (bx, s): threads (tx, ty) cover channels (bx * 32 + tx) * VEC .. + VEC - 1 of rows
// s * 8 + ty, stepping by S * 8 rows; writes partial (mean, m2, n) to ws[s][c].
template <typename T, int VEC>
__global__ void stats_mc_kernel(const T* __restrict__ x, int64_t M, int64_t C, int S,
                                float* __restrict__ ws) {
  __shared__ float sh[kRowsMC][32 * VEC][2];
  __shared__ float shn[kRowsMC][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * 32 + tx) * VEC;
  const int s = blockIdx.y;
  float mean[VEC], m2[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) mean[v] = m2[v] = 0.f;
  float n = 0.f;
  if (c0 < C) {
    for (int64_t r = static_cast<int64_t>(s) * kRowsMC + ty; r < M; r += static_cast<int64_t>(S) * kRowsMC) {
      const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(x + r * C + c0);
      n += 1.f;
      const float inv_n = 1.f / n;
#pragma unroll
      for (int v = 0; v < VEC; ++v) welford_add(mean[v], m2[v], inv_n, static_cast<float>(p.v[v]));
    }
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    sh[ty][tx * VEC + v][0] = mean[v];
    sh[ty][tx * VEC + v][1] = m2[v];
  }
  shn[ty][tx] = n;
  __syncthreads();
  if (ty == 0 && c0 < C) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float mm = mean[v], mm2 = m2[v], nn = n;
      for (int k = 1; k < kRowsMC; ++k) chan_merge(mm, mm2, nn, sh[k][tx * VEC + v][0], sh[k][tx * VEC + v][1], shn[k][tx]);
      if (c0 + v < C) {
        float* out = ws + (static_cast<int64_t>(s) * C + c0 + v) * 3;
        out[0] = mm;
        out[1] = mm2;
        out[2] = nn;
      }
    }
  }
}

// One warp per channel merges its S partials (S reaches about a thousand on channels-last
// input, too many for one thread to walk): lanes take every 32nd partial, then shuffle-merge.
__global__ void stats_finalize_kernel(const float* __restrict__ ws, int S, int64_t C, float* __restrict__ mean_out,
                                      float* __restrict__ var_out) {
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;  // c is the same for the whole warp
  float mean = 0.f, m2 = 0.f, n = 0.f;
  for (int s = lane; s < S; s += 32) {
    const float* p = ws + (static_cast<int64_t>(s) * C + c) * 3;
    chan_merge(mean, m2, n, p[0], p[1], p[2]);
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float mb = __shfl_down_sync(0xffffffff, mean, off);
    const float m2b = __shfl_down_sync(0xffffffff, m2, off);
    const float nb = __shfl_down_sync(0xffffffff, n, off);
    chan_merge(mean, m2, n, mb, m2b, nb);
  }
  if (lane == 0) {
    mean_out[c] = mean;
    var_out[c] = n > 0.f ? m2 / n : 0.f;
  }
}

// One thread per channel: merges W ranks' (mean, biased var, count).
__global__ void welford_parallel_kernel(const float* __restrict__ means, const float* __restrict__ vars,
                                        const float* __restrict__ counts, int64_t W, int64_t C, float eps,
                                        float* __restrict__ mean_out, float* __restrict__ var_out,
                                        float* __restrict__ inv_std_out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float mean = 0.f, m2 = 0.f, n = 0.f;
  for (int64_t w = 0; w < W; ++w) {
    const float nb = counts[w];
    chan_merge(mean, m2, n, means[w * C + c], vars[w * C + c] * nb, nb);
  }
  mean_out[c] = mean;
  var_out[c] = m2 / (n - 1.f);
  inv_std_out[c] = rsqrtf(m2 / fmaxf(n, 1.f) + eps);
}

// ---- backward reductions ---------------------------------------------------------------------

template <typename T, int VEC>
__global__ void reduce_ncl_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean_p,
                                  int64_t N, int64_t C, int64_t L, int S, float* __restrict__ ws) {
  const int64_t c = blockIdx.x;
  const int s = blockIdx.y;
  const float mean = mean_p[c];
  float sdy = 0.f, sdyx = 0.f;
  const int64_t Lv = L / VEC;
  const int64_t step = blockDim.x;
  const int64_t step_rows = step / Lv, step_rem = step % Lv;
  const int64_t total = N * Lv, chunk = (total + S - 1) / S;  // as in stats_ncl_kernel
  const int64_t k_end = std::min<int64_t>(total, (s + 1) * chunk);
  int64_t k = s * chunk + threadIdx.x;
  int64_t row = k / Lv, j = k % Lv;
  for (; k < k_end; k += step) {
    const int64_t off = (row * C + c) * L;
    const Pack<T, VEC> px = reinterpret_cast<const Pack<T, VEC>*>(x + off)[j];
    const Pack<T, VEC> pg = reinterpret_cast<const Pack<T, VEC>*>(dy + off)[j];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float g = static_cast<float>(pg.v[v]);
      sdy += g;
      sdyx += g * (static_cast<float>(px.v[v]) - mean);
    }
    j += step_rem;
    row += step_rows;
    if (j >= Lv) {
      j -= Lv;
      ++row;
    }
  }
  block_sum2(sdy, sdyx);
  if (threadIdx.x == 0) {
    float* out = ws + (static_cast<int64_t>(s) * C + c) * 2;
    out[0] = sdy;
    out[1] = sdyx;
  }
}

template <typename T, int VEC>
__global__ void reduce_mc_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean_p,
                                 int64_t M, int64_t C, int S, float* __restrict__ ws) {
  __shared__ float sh[kRowsMC][32 * VEC][2];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * 32 + tx) * VEC;
  const int s = blockIdx.y;
  float sdy[VEC], sdyx[VEC], mean[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    sdy[v] = sdyx[v] = 0.f;
    mean[v] = c0 + v < C ? mean_p[c0 + v] : 0.f;
  }
  if (c0 < C) {
    for (int64_t r = static_cast<int64_t>(s) * kRowsMC + ty; r < M; r += static_cast<int64_t>(S) * kRowsMC) {
      const Pack<T, VEC> px = *reinterpret_cast<const Pack<T, VEC>*>(x + r * C + c0);
      const Pack<T, VEC> pg = *reinterpret_cast<const Pack<T, VEC>*>(dy + r * C + c0);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float g = static_cast<float>(pg.v[v]);
        sdy[v] += g;
        sdyx[v] += g * (static_cast<float>(px.v[v]) - mean[v]);
      }
    }
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    sh[ty][tx * VEC + v][0] = sdy[v];
    sh[ty][tx * VEC + v][1] = sdyx[v];
  }
  __syncthreads();
  if (ty == 0 && c0 < C) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float a = sdy[v], b = sdyx[v];
      for (int k = 1; k < kRowsMC; ++k) {
        a += sh[k][tx * VEC + v][0];
        b += sh[k][tx * VEC + v][1];
      }
      if (c0 + v < C) {
        float* out = ws + (static_cast<int64_t>(s) * C + c0 + v) * 2;
        out[0] = a;
        out[1] = b;
      }
    }
  }
}

// One warp per channel, as stats_finalize_kernel.
__global__ void reduce_finalize_kernel(const float* __restrict__ ws, int S, int64_t C,
                                       const float* __restrict__ inv_std, float* __restrict__ sum_dy,
                                       float* __restrict__ sum_dy_xmu, float* __restrict__ grad_weight,
                                       float* __restrict__ grad_bias) {
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;  // c is the same for the whole warp
  float a = 0.f, b = 0.f;
  for (int s = lane; s < S; s += 32) {
    a += ws[(static_cast<int64_t>(s) * C + c) * 2];
    b += ws[(static_cast<int64_t>(s) * C + c) * 2 + 1];
  }
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_down_sync(0xffffffff, a, off);
    b += __shfl_down_sync(0xffffffff, b, off);
  }
  if (lane == 0) {
    sum_dy[c] = a;
    sum_dy_xmu[c] = b;
    grad_weight[c] = b * inv_std[c];
    grad_bias[c] = a;
  }
}

// ---- elementwise -----------------------------------------------------------------------------

struct Params {
  const float* mean;
  const float* inv_std;
  const void* weight;
  const void* bias;
  int wdtype;
  int bdtype;
};

// Where a thread's element i lies: channel c of plane i / L, at l = i % L (MC: L = 1). Divides
// once; each grid-stride step then moves by additions (the kernels would otherwise spend more
// time on 64-bit division than on memory). The elementwise kernels walk the tensor from its end
// back to its start: the reduction launched just before them read it front to back, so its
// last tens of megabytes are still in L2 when they begin.
struct ChannelCursor {
  int64_t c, l, L, C, step_l, step_c;
  __device__ ChannelCursor(int64_t i, int64_t stride, int64_t L_, int64_t C_) : L(L_), C(C_) {
    const int64_t plane = i / L;
    l = i - plane * L;
    c = plane % C;
    step_l = stride % L;
    step_c = (stride / L) % C;
  }
  // Moves back by `stride` elements.
  __device__ __forceinline__ void retreat() {
    l -= step_l;
    c -= step_c;
    if (l < 0) {
      l += L;
      --c;
    }
    if (c < 0) c += C;
  }
};

// y = (x - mean) * scale + bias (+ z), ReLU optional. NCL: channel (i / L) % C; MC: i % C.
// x - mean first (not x * scale + shift): a near-constant channel, where inv_std is as large as
// 1/sqrt(eps), must come out as the bias, not as the rounding error of two large products.
template <typename T, int VEC, bool NCL>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ z, T* __restrict__ y, Params p,
                               int64_t numel, int64_t C, int64_t L, bool relu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  const int64_t last = numel - VEC;  // the last pack's first element
  const int64_t first = last - (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  ChannelCursor cur(first < 0 ? 0 : first, stride, NCL ? L : 1, C);
  for (int64_t i = first; i >= 0; i -= stride, cur.retreat()) {
    const Pack<T, VEC> px = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    Pack<T, VEC> pz;
    if (z != nullptr) pz = *reinterpret_cast<const Pack<T, VEC>*>(z + i);
    Pack<T, VEC> out;
    const int64_t c_first = cur.c;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int64_t c = NCL ? c_first : c_first + v;
      const float scale = p.inv_std[c] * load_param(p.weight, p.wdtype, c, 1.f);
      const float bias = load_param(p.bias, p.bdtype, c, 0.f);
      float r = (static_cast<float>(px.v[v]) - p.mean[c]) * scale + bias;
      if (z != nullptr) r += static_cast<float>(pz.v[v]);
      if (relu) r = fmaxf(r, 0.f);
      out.v[v] = static_cast<T>(r);
    }
    *reinterpret_cast<Pack<T, VEC>*>(y + i) = out;
  }
}

// dx = (dy - sum_dy / n - (x - mean) * inv_std^2 * sum_dy_xmu / n) * inv_std * weight.
template <typename T, int VEC, bool NCL>
__global__ void backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, Params p,
                                const float* __restrict__ sum_dy, const float* __restrict__ sum_dy_xmu,
                                const float* __restrict__ counts, int64_t ncounts, int64_t numel, int64_t C,
                                int64_t L) {
  __shared__ float inv_total;
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int64_t k = 0; k < ncounts; ++k) t += counts[k];
    inv_total = 1.f / fmaxf(t, 1.f);
  }
  __syncthreads();
  const float inv_n = inv_total;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  const int64_t last = numel - VEC;  // the last pack's first element
  const int64_t first = last - (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  ChannelCursor cur(first < 0 ? 0 : first, stride, NCL ? L : 1, C);
  for (int64_t i = first; i >= 0; i -= stride, cur.retreat()) {
    const Pack<T, VEC> px = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    const Pack<T, VEC> pg = *reinterpret_cast<const Pack<T, VEC>*>(dy + i);
    Pack<T, VEC> out;
    const int64_t c_first = cur.c;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int64_t c = NCL ? c_first : c_first + v;
      const float inv = p.inv_std[c];
      const float mean_dy = sum_dy[c] * inv_n;
      const float mean_dy_xmu = sum_dy_xmu[c] * inv_n;
      const float scale = inv * load_param(p.weight, p.wdtype, c, 1.f);
      const float xmu = static_cast<float>(px.v[v]) - p.mean[c];
      const float g = static_cast<float>(pg.v[v]) - mean_dy - xmu * inv * inv * mean_dy_xmu;
      out.v[v] = static_cast<T>(g * scale);
    }
    *reinterpret_cast<Pack<T, VEC>*>(dx + i) = out;
  }
}

// ---- launchers -------------------------------------------------------------------------------

// Multiprocessors of the current device, looked up once per device (ATen/cuda/CUDAContext.h
// would pull in cuSPARSE headers, which the pip CUDA toolkits may lack).
int sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

bool aligned16(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int param_dtype(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return 0;
  switch (t->scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    default: return 2;
  }
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

void check_input(const char* op, const char* name, const at::Tensor& t) {
  APEX_CHECK_VALUE(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  APEX_CHECK_VALUE(t.dim() == 2 || t.dim() == 3, op, ": ", name, " must be (N, C, L) or (M, C), got ", t.dim(),
                   " dimensions");
  APEX_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  const auto st = t.scalar_type();
  APEX_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": ", name, " has dtype ", st,
                  "; supported: float32, float16, bfloat16");
}

void check_same(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  check_input(op, name, t);
  APEX_CHECK_VALUE(t.sizes() == input.sizes(), op, ": ", name, " must have the input's shape");
  APEX_CHECK_TYPE(t.scalar_type() == input.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
                  " but input has ", input.scalar_type());
  APEX_CHECK_VALUE(t.device() == input.device(), op, ": ", name, " is on ", t.device(), " but input is on ",
                   input.device());
}

void check_vec(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input, bool fp32) {
  const int64_t C = input.size(1);
  APEX_CHECK_VALUE(t.dim() == 1 && t.numel() == C, op, ": ", name, " must have shape [", C, "]");
  APEX_CHECK_VALUE(t.device() == input.device(), op, ": ", name, " is on ", t.device(), " but input is on ",
                   input.device());
  APEX_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  const auto st = t.scalar_type();
  if (fp32) {
    APEX_CHECK_TYPE(st == at::kFloat, op, ": ", name, " must be float32, got ", st);
  } else {
    APEX_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": ", name, " has dtype ", st,
                    "; supported: float32, float16, bfloat16");
  }
}

void check_opt(const char* op, const char* name, const std::optional<at::Tensor>& t, const at::Tensor& input) {
  if (t.has_value()) check_vec(op, name, *t, input, false);
}

// Splits of the reduction dimension: enough blocks to fill the device a few times over.
int splits(int64_t blocks_per_split, int64_t max_splits) {
  const int64_t target = static_cast<int64_t>(sm_count()) * 8;
  int64_t s = (target + blocks_per_split - 1) / std::max<int64_t>(blocks_per_split, 1);
  s = std::min<int64_t>(std::max<int64_t>(s, 1), std::max<int64_t>(max_splits, 1));
  return static_cast<int>(std::min<int64_t>(s, 65535));
}

template <typename T>
constexpr int vec_of() {
  return 16 / static_cast<int>(sizeof(T));
}

std::tuple<at::Tensor, at::Tensor> welford_mean_var_cuda(const at::Tensor& input) {
  constexpr const char* op = "welford_mean_var";
  check_input(op, "input", input);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t C = input.size(1);
  auto fopts = input.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({C}, fopts), var = at::empty({C}, fopts);
  if (C == 0) return {mean, var};
  if (input.numel() == 0) {
    mean.zero_();
    var.zero_();
    return {mean, var};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool ncl = input.dim() == 3;
  int S;
  at::Tensor ws;
  APEX_PAR_DISPATCH_FLOAT(input.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* x = input.data_ptr<T>();
    if (ncl) {
      const int64_t N = input.size(0), L = input.size(2);
      const bool vec = L % V == 0 && aligned16(x);
      S = splits(C, (N * (vec ? L / V : L) + kThreads - 1) / kThreads);
      ws = at::empty({S, C, 3}, fopts);
      const dim3 grid(static_cast<unsigned>(C), S);
      if (vec) {
        stats_ncl_kernel<T, V><<<grid, kThreads, 0, stream>>>(x, N, C, L, S, ws.data_ptr<float>());
      } else {
        stats_ncl_kernel<T, 1><<<grid, kThreads, 0, stream>>>(x, N, C, L, S, ws.data_ptr<float>());
      }
    } else {
      const int64_t M = input.size(0);
      const bool vec = C % V == 0 && aligned16(x);
      const int64_t gx = (C + 32 * (vec ? V : 1) - 1) / (32 * (vec ? V : 1));
      S = splits(gx, (M + kRowsMC - 1) / kRowsMC);
      ws = at::empty({S, C, 3}, fopts);
      const dim3 grid(static_cast<unsigned>(gx), S), block(32, kRowsMC);
      if (vec) {
        stats_mc_kernel<T, V><<<grid, block, 0, stream>>>(x, M, C, S, ws.data_ptr<float>());
      } else {
        stats_mc_kernel<T, 1><<<grid, block, 0, stream>>>(x, M, C, S, ws.data_ptr<float>());
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  stats_finalize_kernel<<<static_cast<unsigned>((C + 7) / 8), 256, 0, stream>>>(
      ws.data_ptr<float>(), S, C, mean.data_ptr<float>(), var.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mean, var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> welford_parallel_cuda(const at::Tensor& mean, const at::Tensor& var_biased,
                                                                     const at::Tensor& count, double eps) {
  constexpr const char* op = "welford_parallel";
  APEX_CHECK_VALUE(mean.is_cuda() && mean.dim() == 2, op, ": mean must be a [W, C] CUDA tensor");
  APEX_CHECK_VALUE(var_biased.sizes() == mean.sizes(), op, ": var_biased must have mean's shape");
  APEX_CHECK_VALUE(count.numel() == mean.size(0), op, ": count must have ", mean.size(0), " elements");
  APEX_CHECK_TYPE(mean.scalar_type() == at::kFloat && var_biased.scalar_type() == at::kFloat &&
                      count.scalar_type() == at::kFloat,
                  op, ": mean, var_biased and count must be float32");
  APEX_CHECK_VALUE(mean.is_contiguous() && var_biased.is_contiguous() && count.is_contiguous(), op,
                   ": mean, var_biased and count must be contiguous");
  APEX_CHECK_VALUE(var_biased.device() == mean.device() && count.device() == mean.device(), op,
                   ": mean, var_biased and count must be on one device");
  const c10::cuda::CUDAGuard guard(mean.device());
  const int64_t W = mean.size(0), C = mean.size(1);
  auto fopts = mean.options();
  at::Tensor m = at::empty({C}, fopts), v = at::empty({C}, fopts), inv = at::empty({C}, fopts);
  if (C == 0) return {m, v, inv};
  welford_parallel_kernel<<<static_cast<unsigned>((C + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      mean.data_ptr<float>(), var_biased.data_ptr<float>(), count.data_ptr<float>(), W, C, static_cast<float>(eps),
      m.data_ptr<float>(), v.data_ptr<float>(), inv.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {m, v, inv};
}

unsigned elementwise_blocks(int64_t numel, int vec) {
  const int64_t needed = (numel / vec + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap)));
}

at::Tensor batchnorm_forward_cuda(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& inv_std,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& z, bool fuse_relu) {
  constexpr const char* op = "batchnorm_forward";
  check_input(op, "input", input);
  check_vec(op, "mean", mean, input, true);
  check_vec(op, "inv_std", inv_std, input, true);
  check_opt(op, "weight", weight, input);
  check_opt(op, "bias", bias, input);
  if (z.has_value()) check_same(op, "z", *z, input);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty_like(input);
  const int64_t numel = input.numel();
  if (numel == 0) return out;
  const int64_t C = input.size(1);
  const bool ncl = input.dim() == 3;
  const int64_t L = ncl ? input.size(2) : 1;
  const Params p{mean.data_ptr<float>(), inv_std.data_ptr<float>(), ptr_or_null(weight), ptr_or_null(bias),
                 param_dtype(weight), param_dtype(bias)};
  auto stream = c10::cuda::getCurrentCUDAStream();
  APEX_PAR_DISPATCH_FLOAT(input.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* x = input.data_ptr<T>();
    const T* zp = z.has_value() ? z->data_ptr<T>() : nullptr;
    T* y = out.data_ptr<T>();
    const bool vec = (ncl ? L % V == 0 : C % V == 0) && aligned16(x) && aligned16(zp) && aligned16(y);
    if (vec) {
      const unsigned blocks = elementwise_blocks(numel, V);
      if (ncl) forward_kernel<T, V, true><<<blocks, kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      else forward_kernel<T, V, false><<<blocks, kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
    } else {
      const unsigned blocks = elementwise_blocks(numel, 1);
      if (ncl) forward_kernel<T, 1, true><<<blocks, kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      else forward_kernel<T, 1, false><<<blocks, kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batchnorm_backward_reduce_cuda(const at::Tensor& grad_out,
                                                                                          const at::Tensor& input,
                                                                                          const at::Tensor& mean,
                                                                                          const at::Tensor& inv_std) {
  constexpr const char* op = "batchnorm_backward_reduce";
  check_input(op, "input", input);
  check_same(op, "grad_out", grad_out, input);
  check_vec(op, "mean", mean, input, true);
  check_vec(op, "inv_std", inv_std, input, true);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t C = input.size(1);
  auto fopts = input.options().dtype(at::kFloat);
  at::Tensor sum_dy = at::empty({C}, fopts), sum_dy_xmu = at::empty({C}, fopts);
  at::Tensor gw = at::empty({C}, fopts), gb = at::empty({C}, fopts);
  if (C == 0) return {sum_dy, sum_dy_xmu, gw, gb};
  if (input.numel() == 0) {
    for (auto* t : {&sum_dy, &sum_dy_xmu, &gw, &gb}) t->zero_();
    return {sum_dy, sum_dy_xmu, gw, gb};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool ncl = input.dim() == 3;
  int S;
  at::Tensor ws;
  APEX_PAR_DISPATCH_FLOAT(input.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* x = input.data_ptr<T>();
    const T* g = grad_out.data_ptr<T>();
    const float* m = mean.data_ptr<float>();
    if (ncl) {
      const int64_t N = input.size(0), L = input.size(2);
      const bool vec = L % V == 0 && aligned16(x) && aligned16(g);
      S = splits(C, (N * (vec ? L / V : L) + kThreads - 1) / kThreads);
      ws = at::empty({S, C, 2}, fopts);
      const dim3 grid(static_cast<unsigned>(C), S);
      if (vec) {
        reduce_ncl_kernel<T, V><<<grid, kThreads, 0, stream>>>(g, x, m, N, C, L, S, ws.data_ptr<float>());
      } else {
        reduce_ncl_kernel<T, 1><<<grid, kThreads, 0, stream>>>(g, x, m, N, C, L, S, ws.data_ptr<float>());
      }
    } else {
      const int64_t M = input.size(0);
      const bool vec = C % V == 0 && aligned16(x) && aligned16(g);
      const int64_t gx = (C + 32 * (vec ? V : 1) - 1) / (32 * (vec ? V : 1));
      S = splits(gx, (M + kRowsMC - 1) / kRowsMC);
      ws = at::empty({S, C, 2}, fopts);
      const dim3 grid(static_cast<unsigned>(gx), S), block(32, kRowsMC);
      if (vec) {
        reduce_mc_kernel<T, V><<<grid, block, 0, stream>>>(g, x, m, M, C, S, ws.data_ptr<float>());
      } else {
        reduce_mc_kernel<T, 1><<<grid, block, 0, stream>>>(g, x, m, M, C, S, ws.data_ptr<float>());
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  reduce_finalize_kernel<<<static_cast<unsigned>((C + 7) / 8), 256, 0, stream>>>(
      ws.data_ptr<float>(), S, C, inv_std.data_ptr<float>(), sum_dy.data_ptr<float>(), sum_dy_xmu.data_ptr<float>(),
      gw.data_ptr<float>(), gb.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sum_dy, sum_dy_xmu, gw, gb};
}

at::Tensor batchnorm_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
                                   const at::Tensor& inv_std, const std::optional<at::Tensor>& weight,
                                   const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  constexpr const char* op = "batchnorm_backward";
  check_input(op, "input", input);
  check_same(op, "grad_out", grad_out, input);
  check_vec(op, "mean", mean, input, true);
  check_vec(op, "inv_std", inv_std, input, true);
  check_vec(op, "sum_dy", sum_dy, input, true);
  check_vec(op, "sum_dy_xmu", sum_dy_xmu, input, true);
  check_opt(op, "weight", weight, input);
  APEX_CHECK_TYPE(count.scalar_type() == at::kFloat, op, ": count must be float32, got ", count.scalar_type());
  APEX_CHECK_VALUE(count.device() == input.device() && count.is_contiguous(), op,
                   ": count must be a contiguous tensor on the input's device");
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty_like(input);
  const int64_t numel = input.numel();
  if (numel == 0) return out;
  const int64_t C = input.size(1);
  const bool ncl = input.dim() == 3;
  const int64_t L = ncl ? input.size(2) : 1;
  const Params p{mean.data_ptr<float>(), inv_std.data_ptr<float>(), ptr_or_null(weight), nullptr,
                 param_dtype(weight), 0};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float* sd = sum_dy.data_ptr<float>();
  const float* sdx = sum_dy_xmu.data_ptr<float>();
  const float* cnt = count.data_ptr<float>();
  const int64_t K = count.numel();
  APEX_PAR_DISPATCH_FLOAT(input.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* x = input.data_ptr<T>();
    const T* g = grad_out.data_ptr<T>();
    T* dx = out.data_ptr<T>();
    const bool vec = (ncl ? L % V == 0 : C % V == 0) && aligned16(x) && aligned16(g) && aligned16(dx);
    if (vec) {
      const unsigned blocks = elementwise_blocks(numel, V);
      if (ncl) backward_kernel<T, V, true><<<blocks, kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      else backward_kernel<T, V, false><<<blocks, kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
    } else {
      const unsigned blocks = elementwise_blocks(numel, 1);
      if (ncl) backward_kernel<T, 1, true><<<blocks, kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      else backward_kernel<T, 1, false><<<blocks, kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace apex_parallel

TORCH_LIBRARY_IMPL(apex_parallel, CUDA, m) {
  m.impl("welford_mean_var", &apex_parallel::welford_mean_var_cuda);
  m.impl("welford_parallel", &apex_parallel::welford_parallel_cuda);
  m.impl("batchnorm_forward", &apex_parallel::batchnorm_forward_cuda);
  m.impl("batchnorm_backward_reduce", &apex_parallel::batchnorm_backward_reduce_cuda);
  m.impl("batchnorm_backward", &apex_parallel::batchnorm_backward_cuda);
}
