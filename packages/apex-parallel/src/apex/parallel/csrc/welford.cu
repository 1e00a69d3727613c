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
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace apex_parallel {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsMC = 8;  // threadIdx.y extent of the channels-last reductions
constexpr int kUnroll = 4;  // rows a thread of reduce_mc_kernel loads before it sums them

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
    // Two rows per iteration: two independent 16-byte loads in flight per thread.
    const int64_t rs = static_cast<int64_t>(S) * kRowsMC;
    int64_t r = static_cast<int64_t>(s) * kRowsMC + ty;
    for (; r + rs < M; r += 2 * rs) {
      const Pack<T, VEC> p0 = *reinterpret_cast<const Pack<T, VEC>*>(x + r * C + c0);
      const Pack<T, VEC> p1 = *reinterpret_cast<const Pack<T, VEC>*>(x + (r + rs) * C + c0);
      n += 1.f;
      float inv_n = 1.f / n;
#pragma unroll
      for (int v = 0; v < VEC; ++v) welford_add(mean[v], m2[v], inv_n, static_cast<float>(p0.v[v]));
      n += 1.f;
      inv_n = 1.f / n;
#pragma unroll
      for (int v = 0; v < VEC; ++v) welford_add(mean[v], m2[v], inv_n, static_cast<float>(p1.v[v]));
    }
    if (r < M) {
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

// ---- merging the partials ----------------------------------------------------------------------
// A reduction leaves S partials per channel in a [S, C, k] workspace (S reaches about a thousand
// on channels-last input). A block of (kFinCH, kFinTY) threads merges kFinCH channels: lane tx is
// channel fin_channel(), row ty takes partials ty, ty + kFinTY, ... (a warp reads four partials'
// runs of kFinCH consecutive channels), and the rows then merge in shared memory as a tree of
// fixed shape (no atomics: the same bits on every run). Many rows of few channels: each thread's
// chain of dependent loads and merges is short (S / kFinTY), and C / kFinCH blocks spread over
// the SMs. H200, S = 528, C = 256 (bf16 channels-last [200704, 256]): 4.3 us for the statistics'
// merge, 3.0 us for the backward's sums; 7.4 and 4.0 us with blocks of 32 channels x 16 rows.
constexpr int kFinCH = 8;
constexpr int kFinTY = 128;

const dim3 kFinBlock(kFinCH, kFinTY);

unsigned fin_blocks(int64_t C) { return static_cast<unsigned>((C + kFinCH - 1) / kFinCH); }

__device__ __forceinline__ int64_t fin_channel() {
  return static_cast<int64_t>(blockIdx.x) * kFinCH + threadIdx.x;
}

// (mean, m2, n) of channel c from its Welford partials ws[s][c][0..2]; valid in row 0 of the block.
__device__ void merge_welford_partials(const float* __restrict__ ws, int S, int64_t C, int64_t c, float& mean,
                                       float& m2, float& n) {
  __shared__ float sh[3][kFinTY][kFinCH];
  const int tx = threadIdx.x, ty = threadIdx.y;
  mean = m2 = n = 0.f;
  if (c < C) {
#pragma unroll 4
    for (int s = ty; s < S; s += kFinTY) {
      const float* p = ws + (static_cast<int64_t>(s) * C + c) * 3;
      chan_merge(mean, m2, n, p[0], p[1], p[2]);
    }
  }
  for (int w = kFinTY / 2; w > 0; w >>= 1) {
    if (ty >= w && ty < 2 * w) {
      sh[0][ty][tx] = mean;
      sh[1][ty][tx] = m2;
      sh[2][ty][tx] = n;
    }
    __syncthreads();
    // No barrier after the reads: the next level writes rows [w / 2, w), this one reads [w, 2w).
    if (ty < w) chan_merge(mean, m2, n, sh[0][ty + w][tx], sh[1][ty + w][tx], sh[2][ty + w][tx]);
  }
}

// The sums (a, b) of channel c from its partials ws[s][c][0..1]; valid in row 0 of the block.
__device__ void sum_partials(const float* __restrict__ ws, int S, int64_t C, int64_t c, float& a, float& b) {
  __shared__ float sh[2][kFinTY][kFinCH];
  const int tx = threadIdx.x, ty = threadIdx.y;
  a = b = 0.f;
  if (c < C) {
#pragma unroll 4
    for (int s = ty; s < S; s += kFinTY) {
      const float* p = ws + (static_cast<int64_t>(s) * C + c) * 2;
      a += p[0];
      b += p[1];
    }
  }
  for (int w = kFinTY / 2; w > 0; w >>= 1) {
    if (ty >= w && ty < 2 * w) {
      sh[0][ty][tx] = a;
      sh[1][ty][tx] = b;
    }
    __syncthreads();
    if (ty < w) {  // no barrier after the reads, as in merge_welford_partials
      a += sh[0][ty + w][tx];
      b += sh[1][ty + w][tx];
    }
  }
}

// Mean and biased variance per channel from the statistics partials; count_out (optional)
// receives `count`: the packed [mean, var, count] buffer of syncbn_stats.
__global__ void __launch_bounds__(kFinCH * kFinTY)
    stats_finalize_kernel(const float* __restrict__ ws, int S, int64_t C, float* __restrict__ mean_out,
                          float* __restrict__ var_out, float* __restrict__ count_out = nullptr, float count = 0.f) {
  if (count_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) *count_out = count;
  const int64_t c = fin_channel();
  float mean, m2, n;
  merge_welford_partials(ws, S, C, c, mean, m2, n);
  if (threadIdx.y == 0 && c < C) {
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
                                  int64_t N, int64_t C, int64_t L, int S, float* __restrict__ ws,
                                  const T* __restrict__ relu = nullptr) {
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
    Pack<T, VEC> pr;
    if (relu != nullptr) pr = reinterpret_cast<const Pack<T, VEC>*>(relu + off)[j];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float g = relu != nullptr && !(static_cast<float>(pr.v[v]) > 0.f) ? 0.f : static_cast<float>(pg.v[v]);
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
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks per SM: 80 registers (at 64, kUnroll 4 spills)
    reduce_mc_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean_p, int64_t M,
                     int64_t C, int S, float* __restrict__ ws, const T* __restrict__ relu = nullptr) {
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
    // kUnroll rows per step: 2 * kUnroll independent 16-byte loads in flight per thread (H200,
    // bf16 channels-last [200704, 256]: 55.4 us; two rows a step at 4 blocks per SM 56.7 us).
    using P = Pack<T, VEC>;
    const int64_t rs = static_cast<int64_t>(S) * kRowsMC;
    auto add = [&](const P& px, const P& pg, int64_t r) {
      P pr;
      if (relu != nullptr) pr = *reinterpret_cast<const P*>(relu + r * C + c0);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float g =
            relu != nullptr && !(static_cast<float>(pr.v[v]) > 0.f) ? 0.f : static_cast<float>(pg.v[v]);
        sdy[v] += g;
        sdyx[v] = fmaf(g, static_cast<float>(px.v[v]) - mean[v], sdyx[v]);
      }
    };
    int64_t r = static_cast<int64_t>(s) * kRowsMC + ty;
    for (; r + (kUnroll - 1) * rs < M; r += kUnroll * rs) {
      P px[kUnroll], pg[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        px[u] = *reinterpret_cast<const P*>(x + (r + u * rs) * C + c0);
        pg[u] = *reinterpret_cast<const P*>(dy + (r + u * rs) * C + c0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(px[u], pg[u], r + u * rs);
    }
    for (; r < M; r += rs) {
      add(*reinterpret_cast<const P*>(x + r * C + c0), *reinterpret_cast<const P*>(dy + r * C + c0), r);
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

// The backward sums and parameter gradients per channel from the reduction's partials.
__global__ void __launch_bounds__(kFinCH * kFinTY)
    reduce_finalize_kernel(const float* __restrict__ ws, int S, int64_t C, const float* __restrict__ inv_std,
                           float* __restrict__ sum_dy, float* __restrict__ sum_dy_xmu,
                           float* __restrict__ grad_weight, float* __restrict__ grad_bias) {
  const int64_t c = fin_channel();
  float a, b;
  sum_partials(ws, S, C, c, a, b);
  if (threadIdx.y == 0 && c < C) {
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

// ---- SyncBatchNorm's fused path (syncbn_* ops) ----------------------------------------------------
// Packed buffers (reference.py): stats [mean C | var C | count], saved [mean C | inv_std C | n],
// sums [sum_dy C | sum_dy_xmu C].

__device__ __forceinline__ void store_param(void* p, int dtype, int64_t c, float v) {
  if (dtype == 0) static_cast<float*>(p)[c] = v;
  else if (dtype == 1) static_cast<at::Half*>(p)[c] = static_cast<at::Half>(v);
  else static_cast<at::BFloat16*>(p)[c] = static_cast<at::BFloat16>(v);
}

// torch.lerp's formula, so running estimates match the reference bit for bit in float32.
__device__ __forceinline__ float lerp_f(float a, float b, float w) {
  return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w);
}

// What the merge writes: saved [mean | inv_std | n], the running estimates and
// num_batches_tracked (each optional).
struct RunningArgs {
  float eps;
  bool has_momentum;
  float momentum;
  int64_t* nbt;
  void* rmean;
  int rm_dtype;
  void* rvar;
  int rv_dtype;
  float* saved;
};

// The running estimates' factor: momentum when has_momentum, else 1 / (num_batches_tracked + 1)
// when it is given (read before anyone increments it), else 0.
__device__ __forceinline__ float running_factor(const RunningArgs& r) {
  if (r.has_momentum) return r.momentum;
  if (r.nbt != nullptr) return 1.f / static_cast<float>(*r.nbt + 1);
  return 0.f;
}

// Channel c's merged (mean, m2, n): saved's mean and inv_std, the running estimates (left as
// they are where no rank had a row, n == 0, as torch's BatchNorm leaves them).
__device__ __forceinline__ void merge_out(const RunningArgs& r, int64_t C, int64_t c, float mean, float m2, float n,
                                          float factor) {
  r.saved[c] = mean;
  r.saved[C + c] = rsqrtf(m2 / fmaxf(n, 1.f) + r.eps);
  if (!(n > 0.f)) return;
  if (r.rmean != nullptr)
    store_param(r.rmean, r.rm_dtype, c, lerp_f(load_param(r.rmean, r.rm_dtype, c, 0.f), mean, factor));
  if (r.rvar != nullptr)
    store_param(r.rvar, r.rv_dtype, c, lerp_f(load_param(r.rvar, r.rv_dtype, c, 0.f), m2 / (n - 1.f), factor));
}

// Merges W ranks' packed stats into saved, updates the running estimates and
// num_batches_tracked. With momentum=None and num_batches_tracked given the grid is one block
// (thread 0 reads the count before it increments it).
__global__ void merge_kernel(const float* __restrict__ stats, int64_t W, int64_t C, RunningArgs r) {
  __shared__ float factor_sh;
  if (threadIdx.x == 0) factor_sh = running_factor(r);
  __syncthreads();
  const float factor = factor_sh;
  const int64_t P = 2 * C + 1;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float mean = 0.f, m2 = 0.f, n = 0.f;
    for (int64_t w = 0; w < W; ++w) {
      const float* s = stats + w * P;
      const float nb = s[2 * C];
      chan_merge(mean, m2, n, s[c], s[C + c] * nb, nb);
    }
    merge_out(r, C, c, mean, m2, n, factor);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    float total = 0.f;
    for (int64_t w = 0; w < W; ++w) total += stats[w * P + 2 * C];
    r.saved[2 * C] = total;
    if (r.nbt != nullptr) *r.nbt += 1;
  }
}

// One rank alone: its statistics partials merged straight into saved and the running estimates
// (stats_finalize_kernel and merge_kernel in one launch). Not for momentum=None with
// num_batches_tracked, whose factor must be read before the count is incremented: that takes
// the two launches.
__global__ void __launch_bounds__(kFinCH * kFinTY)
    stats_merge_kernel(const float* __restrict__ ws, int S, int64_t C, float count, RunningArgs r) {
  const int64_t c = fin_channel();
  float mean, m2, n;
  merge_welford_partials(ws, S, C, c, mean, m2, n);
  if (threadIdx.y == 0 && c < C) {
    // Through the packed buffer's numbers (var = m2 / n, then m2 = var * count) as the two
    // launches take them: the same bits as syncbn_stats + syncbn_forward.
    const float var = n > 0.f ? m2 / n : 0.f;
    merge_out(r, C, c, mean, var * count, count, r.has_momentum ? r.momentum : 0.f);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    r.saved[2 * C] = count;
    if (r.nbt != nullptr) *r.nbt += 1;
  }
}

// sums and the local parameter gradients (in the parameters' dtype P) from the reduction's
// partials.
template <typename P>
__global__ void __launch_bounds__(kFinCH * kFinTY)
    reduce_pack_kernel(const float* __restrict__ ws, int S, int64_t C, const float* __restrict__ saved,
                       float* __restrict__ sums, P* __restrict__ grad_weight, P* __restrict__ grad_bias) {
  const int64_t c = fin_channel();
  float a, b;
  sum_partials(ws, S, C, c, a, b);
  if (threadIdx.y == 0 && c < C) {
    sums[c] = a;
    sums[C + c] = b;
    grad_weight[c] = static_cast<P>(b * saved[C + c]);
    grad_bias[c] = static_cast<P>(a);
  }
}

// Per-channel coefficients of the elementwise passes.
//   forward:  y  = (x - mean) * a + b                      a = inv_std * w, b = bias
//   backward: dx = (g - mean_dy - (x - mean) * k) * a      k = inv_std^2 * sum_dy_xmu / n
struct Coef {
  float mean, a, b, k;
};

struct FusedParams {
  const float* saved;  // mean | inv_std | n
  const float* sums;   // backward only: sum_dy | sum_dy_xmu
  const void* weight;
  const void* bias;
  int wdtype, bdtype;
  int64_t C;
};

template <bool BACKWARD>
__device__ __forceinline__ Coef coef_of(const FusedParams& p, int64_t c, float inv_n) {
  const float inv = p.saved[p.C + c];
  Coef k;
  k.mean = p.saved[c];
  k.a = inv * load_param(p.weight, p.wdtype, c, 1.f);
  if (BACKWARD) {
    k.b = p.sums[c] * inv_n;  // mean_dy
    k.k = inv * inv * p.sums[p.C + c] * inv_n;
  } else {
    k.b = load_param(p.bias, p.bdtype, c, 0.f);
    k.k = 0.f;
  }
  return k;
}

// The fused elementwise pass, forward (y from x, z) or backward (dx from dy, x), with the ReLU
// mask of fuse_relu. Walks the tensor from its end back to its start (the reduction before it
// read front to back, so its tail is still in L2). MODE 0: channels first (one channel per
// pack); 1: channels last; 2: channels last where the grid stride is a multiple of C, so each
// thread's VEC channels never change and their coefficients live in registers.
template <typename T, int VEC, int MODE, bool BACKWARD>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks per SM: up to 80 registers for the U packs
    fused_elementwise_kernel(const T* __restrict__ a_in,  // forward: x; backward: dy
                             const T* __restrict__ x,     // backward: x
                             const T* __restrict__ z,     // forward: residual (or null)
                             const T* __restrict__ relu,  // backward: forward's output (or null)
                             bool relu_fwd, T* __restrict__ out, FusedParams p, int64_t numel, int64_t L) {
  const int64_t C = p.C;
  const float inv_n = BACKWARD ? 1.f / fmaxf(p.saved[2 * C], 1.f) : 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  const int64_t first = numel - VEC - (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (first < 0) return;
  ChannelCursor cur(first, stride, MODE == 0 ? L : 1, C);
  Coef fixed[MODE == 2 ? VEC : 1];
  if constexpr (MODE == 2) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) fixed[v] = coef_of<BACKWARD>(p, cur.c + v, inv_n);
  }
  // U packs a step, all loaded before any is used: more bytes in flight per thread. H200, bf16
  // channels-last [200704, 256] forward: 52.7 us at two packs, 53.7 us at one; four spill. The
  // backward, with two tensors in, moves 98 % of the copy rate at one pack and spills at two.
  constexpr int U = BACKWARD ? 1 : 2;
  using P = Pack<T, VEC>;
  for (int64_t i0 = first; i0 >= 0; i0 -= U * stride) {
    P pa[U], px[U], pz[U], pr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 - u * stride;
      if (i < 0) continue;
      pa[u] = *reinterpret_cast<const P*>(a_in + i);
      if (BACKWARD) px[u] = *reinterpret_cast<const P*>(x + i);
      if (!BACKWARD && z != nullptr) pz[u] = *reinterpret_cast<const P*>(z + i);
      if (BACKWARD && relu != nullptr) pr[u] = *reinterpret_cast<const P*>(relu + i);
    }
#pragma unroll
    for (int u = 0; u < U; ++u, cur.retreat()) {
      const int64_t i = i0 - u * stride;
      if (i < 0) continue;
      Coef k0{};
      if constexpr (MODE == 0) k0 = coef_of<BACKWARD>(p, cur.c, inv_n);
      P o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        Coef k;
        if constexpr (MODE == 0) k = k0;
        else if constexpr (MODE == 2) k = fixed[v];
        else k = coef_of<BACKWARD>(p, cur.c + v, inv_n);
        float r;
        if (BACKWARD) {
          float g = static_cast<float>(pa[u].v[v]);
          if (relu != nullptr && !(static_cast<float>(pr[u].v[v]) > 0.f)) g = 0.f;
          r = (g - k.b - (static_cast<float>(px[u].v[v]) - k.mean) * k.k) * k.a;
        } else {
          r = (static_cast<float>(pa[u].v[v]) - k.mean) * k.a + k.b;
          if (z != nullptr) r += static_cast<float>(pz[u].v[v]);
          if (relu_fwd) r = fmaxf(r, 0.f);
        }
        o.v[v] = static_cast<T>(r);
      }
      *reinterpret_cast<P*>(out + i) = o;
    }
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

// `s` splits, within [1, max_splits] and the grid's y limit.
int clamp_splits(int64_t s, int64_t max_splits) {
  s = std::min<int64_t>(std::max<int64_t>(s, 1), std::max<int64_t>(max_splits, 1));
  return static_cast<int>(std::min<int64_t>(s, 65535));
}

// Splits of the reduction dimension: enough blocks to fill the device a few times over.
int splits(int64_t blocks_per_split, int64_t max_splits) {
  const int64_t target = static_cast<int64_t>(sm_count()) * 8;
  return clamp_splits((target + blocks_per_split - 1) / std::max<int64_t>(blocks_per_split, 1), max_splits);
}

template <typename K>
const void* kaddr(K* kernel) {
  return reinterpret_cast<const void*>(kernel);
}

// Blocks of `kernel` (`threads` threads, static shared memory only) that the whole device
// holds at once, looked up once per kernel and device.
int resident_blocks(const void* kernel, int threads) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  int& n = cache[{kernel, dev}];
  if (n == 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    n = std::max(per_sm, 1) * sm_count();
  }
  return n;
}

// Splits of the channels-last reductions: gx * S blocks in one wave, so that every block runs
// from the start and the grid sweeps the rows front to back together (a second, partial wave
// would idle SMs and leave the tensor's end only partly in L2 for the reversed pass after).
int one_wave_splits(const void* kernel, int64_t gx, int64_t max_splits) {
  return clamp_splits(resident_blocks(kernel, kThreads) / std::max<int64_t>(gx, 1), max_splits);
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
      S = one_wave_splits(vec ? kaddr(stats_mc_kernel<T, V>) : kaddr(stats_mc_kernel<T, 1>), gx,
                          (M + kRowsMC - 1) / kRowsMC);
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
  stats_finalize_kernel<<<fin_blocks(C), kFinBlock, 0, stream>>>(
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

// Blocks of an elementwise pass (grid-stride, walking the tensor from its end): at most one
// wave, so that every thread starts at the end together and the whole grid sweeps back to the
// front once (with more blocks than fit, each later wave would sweep the tensor again, from an
// end long gone from L2).
unsigned elementwise_blocks(int64_t numel, int vec, const void* kernel) {
  const int64_t needed = (numel / vec + kThreads - 1) / kThreads;
  const int64_t cap = resident_blocks(kernel, kThreads);
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
      if (ncl) {
        auto* k = forward_kernel<T, V, true>;
        k<<<elementwise_blocks(numel, V, kaddr(k)), kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      } else {
        auto* k = forward_kernel<T, V, false>;
        k<<<elementwise_blocks(numel, V, kaddr(k)), kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      }
    } else {
      if (ncl) {
        auto* k = forward_kernel<T, 1, true>;
        k<<<elementwise_blocks(numel, 1, kaddr(k)), kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      } else {
        auto* k = forward_kernel<T, 1, false>;
        k<<<elementwise_blocks(numel, 1, kaddr(k)), kThreads, 0, stream>>>(x, zp, y, p, numel, C, L, fuse_relu);
      }
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
      S = one_wave_splits(vec ? kaddr(reduce_mc_kernel<T, V>) : kaddr(reduce_mc_kernel<T, 1>), gx,
                          (M + kRowsMC - 1) / kRowsMC);
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
  reduce_finalize_kernel<<<fin_blocks(C), kFinBlock, 0, stream>>>(
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
      if (ncl) {
        auto* k = backward_kernel<T, V, true>;
        k<<<elementwise_blocks(numel, V, kaddr(k)), kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      } else {
        auto* k = backward_kernel<T, V, false>;
        k<<<elementwise_blocks(numel, V, kaddr(k)), kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      }
    } else {
      if (ncl) {
        auto* k = backward_kernel<T, 1, true>;
        k<<<elementwise_blocks(numel, 1, kaddr(k)), kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      } else {
        auto* k = backward_kernel<T, 1, false>;
        k<<<elementwise_blocks(numel, 1, kaddr(k)), kThreads, 0, stream>>>(g, x, dx, p, sd, sdx, cnt, K, numel, C, L);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---- syncbn_* launchers -----------------------------------------------------------------------------

bool aligned32(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 32 == 0; }

// How the kernels read an (N, C, *) tensor in place: channels first (contiguous; `ncl`) or
// channels last ((N, C) contiguous, or 4-D/5-D in torch's channels_last formats). False: neither.
bool layout_of(const at::Tensor& t, bool& ncl) {
  if (t.dim() == 2) {
    ncl = false;
    return t.is_contiguous();
  }
  if (t.is_contiguous()) {
    ncl = true;
    return true;
  }
  ncl = false;
  return (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
         (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d));
}

at::MemoryFormat format_of(const at::Tensor& t, bool ncl) {
  if (ncl || t.dim() < 4) return at::MemoryFormat::Contiguous;
  return t.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
}

// `t` as it is when the kernels can read it, else a dense copy.
at::Tensor readable(const at::Tensor& t, bool& ncl) {
  if (layout_of(t, ncl)) return t;
  at::Tensor d = t.contiguous(t.dim() >= 4 ? t.suggest_memory_format() : at::MemoryFormat::Contiguous);
  if (!layout_of(d, ncl)) {
    d = t.contiguous();
    ncl = true;
  }
  return d;
}

// `t` (x's shape) in x's layout: as it is, or a copy.
at::Tensor in_layout(const at::Tensor& t, const at::Tensor& x, bool ncl) {
  bool n2 = false;
  if (layout_of(t, n2) && n2 == ncl) return t;
  return t.contiguous(format_of(x, ncl));
}

// The tensor an elementwise kernel writes: empty_like(input) (the strides the fake promises)
// when it is in x's layout, else a scratch tensor copied into it afterwards.
std::pair<at::Tensor, at::Tensor> output_for(const at::Tensor& input, const at::Tensor& x, bool ncl) {
  at::Tensor result = at::empty_like(input);
  bool n2 = false;
  if (layout_of(result, n2) && n2 == ncl) return {result, result};
  return {result, at::empty_like(x, x.options(), format_of(x, ncl))};
}

struct Dims {
  int64_t N, C, L;  // channels last: N = rows, L = 1
};

Dims dims_of(const at::Tensor& x, bool ncl) {
  const int64_t C = x.size(1), numel = x.numel();
  if (!ncl) return {C ? numel / C : 0, C, 1};
  const int64_t N = x.size(0);
  return {N, C, N * C ? numel / (N * C) : 0};
}

void check_cuda_float(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  APEX_CHECK_VALUE(t.dim() >= 2, op, ": ", name, " must be (N, C, *), got ", t.dim(), " dimensions");
  APEX_CHECK_VALUE(t.device() == input.device(), op, ": ", name, " is on ", t.device(), " but input is on ",
                   input.device());
  APEX_CHECK_VALUE(t.sizes() == input.sizes(), op, ": ", name, " must have the input's shape");
  APEX_CHECK_TYPE(t.scalar_type() == input.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
                  " but input has ", input.scalar_type());
}

void check_packed(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input, int64_t per,
                  bool exact) {
  APEX_CHECK_VALUE(t.device() == input.device() && t.is_contiguous(), op, ": ", name,
                   " must be a contiguous tensor on the input's device");
  APEX_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  APEX_CHECK_VALUE(exact ? t.numel() == per : (t.numel() > 0 && t.numel() % per == 0), op, ": ", name, " must hold ",
                   exact ? "" : "a multiple of ", per, " values");
}

void check_input_nd(const char* op, const at::Tensor& input) {
  APEX_CHECK_VALUE(input.is_cuda(), op, ": input must be a CUDA tensor, got one on ", input.device());
  APEX_CHECK_VALUE(input.dim() >= 2, op, ": input must be (N, C, *), got ", input.dim(), " dimensions");
  const auto st = input.scalar_type();
  APEX_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": input has dtype ", st,
                  "; supported: float32, float16, bfloat16");
}

// Statistics partials of x into a [S, C, 3] workspace (returned, S = its first size).
at::Tensor launch_stats_partials(const at::Tensor& x, bool ncl, const Dims& d, cudaStream_t stream) {
  const int64_t C = d.C;
  int S = 1;
  at::Tensor ws;
  auto fopts = x.options().dtype(at::kFloat);
  APEX_PAR_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* xp = x.data_ptr<T>();
    if (ncl) {
      // Two 16-byte packs per thread and step where the rows allow (more loads in flight).
      const int vec = (d.L % (2 * V) == 0 && aligned32(xp)) ? 2 * V : (d.L % V == 0 && aligned16(xp)) ? V : 1;
      S = splits(C, (d.N * (d.L / vec) + kThreads - 1) / kThreads);
      ws = at::empty({S, C, 3}, fopts);
      const dim3 grid(static_cast<unsigned>(C), S);
      if (vec == 2 * V) stats_ncl_kernel<T, 2 * V><<<grid, kThreads, 0, stream>>>(xp, d.N, C, d.L, S, ws.data_ptr<float>());
      else if (vec == V) stats_ncl_kernel<T, V><<<grid, kThreads, 0, stream>>>(xp, d.N, C, d.L, S, ws.data_ptr<float>());
      else stats_ncl_kernel<T, 1><<<grid, kThreads, 0, stream>>>(xp, d.N, C, d.L, S, ws.data_ptr<float>());
    } else {
      const bool vec = C % V == 0 && aligned16(xp);
      const int64_t gx = (C + 32 * (vec ? V : 1) - 1) / (32 * (vec ? V : 1));
      S = one_wave_splits(vec ? kaddr(stats_mc_kernel<T, V>) : kaddr(stats_mc_kernel<T, 1>), gx,
                          (d.N + kRowsMC - 1) / kRowsMC);
      ws = at::empty({S, C, 3}, fopts);
      const dim3 grid(static_cast<unsigned>(gx), S), block(32, kRowsMC);
      if (vec) stats_mc_kernel<T, V><<<grid, block, 0, stream>>>(xp, d.N, C, S, ws.data_ptr<float>());
      else stats_mc_kernel<T, 1><<<grid, block, 0, stream>>>(xp, d.N, C, S, ws.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return ws;
}

// The packed [mean | var | count] of x's statistics partials.
void launch_stats_packed(const at::Tensor& x, bool ncl, const Dims& d, float* out, cudaStream_t stream) {
  const int64_t C = d.C;
  const at::Tensor ws = launch_stats_partials(x, ncl, d, stream);
  stats_finalize_kernel<<<fin_blocks(C), kFinBlock, 0, stream>>>(ws.data_ptr<float>(), static_cast<int>(ws.size(0)), C,
                                                                 out, out + C, out + 2 * C,
                                                                 static_cast<float>(d.N * d.L));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The packed [mean | var | count] of x (in layout `ncl`); zeros for an empty x.
at::Tensor packed_stats(const at::Tensor& x, bool ncl, cudaStream_t stream) {
  at::Tensor out = at::empty({2 * x.size(1) + 1}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return out.zero_();
  launch_stats_packed(x, ncl, dims_of(x, ncl), out.data_ptr<float>(), stream);
  return out;
}

at::Tensor syncbn_stats_cuda(const at::Tensor& input) {
  check_input_nd("syncbn_stats", input);
  const c10::cuda::CUDAGuard guard(input.device());
  bool ncl = false;
  const at::Tensor x = readable(input, ncl);
  return packed_stats(x, ncl, c10::cuda::getCurrentCUDAStream());
}

// Channels last: the grid stride, blocks * kThreads * vec elements, is a multiple of C (so each
// thread's channels never change, MODE 2) when blocks is a multiple of this.
int64_t fixed_channels_multiple(int64_t C, int vec) {
  int64_t a = C, b = static_cast<int64_t>(kThreads) * vec;
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return C / a;
}

template <typename T, int VV, bool BACKWARD>
void launch_fused_vec(const T* a_in, const T* x, const T* z, const T* relu, bool relu_fwd, T* out,
                      const FusedParams& p, int64_t numel, bool ncl, int64_t L, cudaStream_t stream) {
  auto launch = [&](auto* kernel, int64_t blocks) {
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a_in, x, z, relu, relu_fwd, out, p, numel, L);
  };
  if (ncl) {
    auto* k = fused_elementwise_kernel<T, VV, 0, BACKWARD>;
    launch(k, elementwise_blocks(numel, VV, kaddr(k)));
    return;
  }
  auto* k2 = fused_elementwise_kernel<T, VV, 2, BACKWARD>;
  const int64_t blocks = elementwise_blocks(numel, VV, kaddr(k2));
  const int64_t g = fixed_channels_multiple(p.C, VV);
  if (g <= blocks) {
    launch(k2, blocks / g * g);
  } else {
    auto* k1 = fused_elementwise_kernel<T, VV, 1, BACKWARD>;
    launch(k1, elementwise_blocks(numel, VV, kaddr(k1)));
  }
}

template <typename T, bool BACKWARD>
void launch_fused_elementwise(const T* a_in, const T* x, const T* z, const T* relu, bool relu_fwd, T* out,
                              const FusedParams& p, int64_t numel, bool ncl, int64_t L, cudaStream_t stream) {
  constexpr int V = vec_of<T>();
  const bool al = aligned16(a_in) && aligned16(x) && aligned16(z) && aligned16(relu) && aligned16(out);
  if (al && (ncl ? L % V == 0 : p.C % V == 0)) {
    launch_fused_vec<T, V, BACKWARD>(a_in, x, z, relu, relu_fwd, out, p, numel, ncl, L, stream);
  } else {
    launch_fused_vec<T, 1, BACKWARD>(a_in, x, z, relu, relu_fwd, out, p, numel, ncl, L, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> syncbn_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& stats_opt, const std::optional<at::Tensor>& z,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, double eps, std::optional<double> momentum,
    bool fuse_relu) {
  constexpr const char* op = "syncbn_forward";
  check_input_nd(op, input);
  const int64_t C = input.size(1);
  if (stats_opt.has_value()) check_packed(op, "stats", *stats_opt, input, 2 * C + 1, false);
  if (z.has_value()) check_cuda_float(op, "z", *z, input);
  check_opt(op, "weight", weight, input);
  check_opt(op, "bias", bias, input);
  check_opt(op, "running_mean", running_mean, input);
  check_opt(op, "running_var", running_var, input);
  if (num_batches_tracked.has_value()) {
    const auto& t = *num_batches_tracked;
    APEX_CHECK_TYPE(t.scalar_type() == at::kLong && t.numel() == 1 && t.device() == input.device(), op,
                    ": num_batches_tracked must be one int64 value on the input's device");
  }
  const c10::cuda::CUDAGuard guard(input.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  bool ncl = false;
  const at::Tensor x = readable(input, ncl);
  at::Tensor saved = at::empty({2 * C + 1}, x.options().dtype(at::kFloat));
  at::Tensor result, out;
  std::tie(result, out) = output_for(input, x, ncl);
  if (C == 0) return {result, saved.zero_()};
  const bool has_nbt = num_batches_tracked.has_value();
  const bool has_m = momentum.has_value();
  const RunningArgs r{static_cast<float>(eps),
                      has_m,
                      has_m ? static_cast<float>(*momentum) : 0.f,
                      has_nbt ? num_batches_tracked->data_ptr<int64_t>() : nullptr,
                      running_mean.has_value() ? running_mean->data_ptr() : nullptr,
                      param_dtype(running_mean),
                      running_var.has_value() ? running_var->data_ptr() : nullptr,
                      param_dtype(running_var),
                      saved.data_ptr<float>()};
  const bool alone = !stats_opt.has_value() && x.numel() > 0;
  if (alone && (has_m || !has_nbt)) {
    // This rank alone, in two launches: its statistics partials, merged straight into saved.
    const Dims d = dims_of(x, ncl);
    const at::Tensor ws = launch_stats_partials(x, ncl, d, stream);
    stats_merge_kernel<<<fin_blocks(C), kFinBlock, 0, stream>>>(ws.data_ptr<float>(), static_cast<int>(ws.size(0)), C,
                                                                static_cast<float>(d.N * d.L), r);
  } else {
    // The ranks' packed stats (given, or this rank's taken here with syncbn_stats's launches),
    // merged.
    const at::Tensor stats = stats_opt.has_value() ? *stats_opt : packed_stats(x, ncl, stream);
    const int64_t W = stats.numel() / (2 * C + 1);
    const unsigned mblocks = (!has_m && has_nbt) ? 1u : static_cast<unsigned>(std::min<int64_t>((C + 255) / 256, 1024));
    merge_kernel<<<mblocks, 256, 0, stream>>>(stats.data_ptr<float>(), W, C, r);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t numel = x.numel();
  if (numel > 0) {
    const Dims d = dims_of(x, ncl);
    const FusedParams p{saved.data_ptr<float>(), nullptr, ptr_or_null(weight), ptr_or_null(bias),
                        param_dtype(weight), param_dtype(bias), C};
    at::Tensor zz = z.has_value() ? in_layout(*z, x, ncl) : at::Tensor();
    APEX_PAR_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
      launch_fused_elementwise<T, false>(x.data_ptr<T>(), nullptr, zz.defined() ? zz.data_ptr<T>() : nullptr,
                                         nullptr, fuse_relu, out.data_ptr<T>(), p, numel, ncl, d.L, stream);
    });
    if (!out.is_same(result)) result.copy_(out);
  }
  return {result, saved};
}

// The backward reduction of x (in layout `ncl`) and dy, relu_out in the same layout: sums
// [sum_dy | sum_dy_xmu] and this rank's parameter gradients in the weight's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_backward_reduce(const at::Tensor& dy, const at::Tensor& x,
                                                                      const at::Tensor& ro, bool ncl,
                                                                      const at::Tensor& saved,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      cudaStream_t stream) {
  const int64_t C = x.size(1);
  auto fopts = x.options().dtype(at::kFloat);
  const auto pdtype = weight.has_value() ? weight->scalar_type() : at::kFloat;
  at::Tensor sums = at::empty({2 * C}, fopts);
  at::Tensor gw = at::empty({C}, fopts.dtype(pdtype)), gb = at::empty({C}, fopts.dtype(pdtype));
  if (C == 0) return {sums, gw, gb};
  if (x.numel() == 0) return {sums.zero_(), gw.zero_(), gb.zero_()};
  const Dims d = dims_of(x, ncl);
  int S = 1;
  at::Tensor ws;
  const float* m = saved.data_ptr<float>();
  APEX_PAR_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
    constexpr int V = vec_of<T>();
    const T* xp = x.data_ptr<T>();
    const T* g = dy.data_ptr<T>();
    const T* r = ro.defined() ? ro.data_ptr<T>() : nullptr;
    if (ncl) {
      const bool a32 = aligned32(xp) && aligned32(g) && aligned32(r);
      const bool a16 = aligned16(xp) && aligned16(g) && aligned16(r);
      const int vec = (d.L % (2 * V) == 0 && a32) ? 2 * V : (d.L % V == 0 && a16) ? V : 1;
      S = splits(C, (d.N * (d.L / vec) + kThreads - 1) / kThreads);
      ws = at::empty({S, C, 2}, fopts);
      const dim3 grid(static_cast<unsigned>(C), S);
      float* w = ws.data_ptr<float>();
      if (vec == 2 * V) reduce_ncl_kernel<T, 2 * V><<<grid, kThreads, 0, stream>>>(g, xp, m, d.N, C, d.L, S, w, r);
      else if (vec == V) reduce_ncl_kernel<T, V><<<grid, kThreads, 0, stream>>>(g, xp, m, d.N, C, d.L, S, w, r);
      else reduce_ncl_kernel<T, 1><<<grid, kThreads, 0, stream>>>(g, xp, m, d.N, C, d.L, S, w, r);
    } else {
      const bool vec = C % V == 0 && aligned16(xp) && aligned16(g) && aligned16(r);
      const int64_t gx = (C + 32 * (vec ? V : 1) - 1) / (32 * (vec ? V : 1));
      const int64_t rows = (d.N + kRowsMC - 1) / kRowsMC;
      S = one_wave_splits(vec ? kaddr(reduce_mc_kernel<T, V>) : kaddr(reduce_mc_kernel<T, 1>), gx, rows);
      ws = at::empty({S, C, 2}, fopts);
      const dim3 grid(static_cast<unsigned>(gx), S), block(32, kRowsMC);
      float* w = ws.data_ptr<float>();
      if (vec) reduce_mc_kernel<T, V><<<grid, block, 0, stream>>>(g, xp, m, d.N, C, S, w, r);
      else reduce_mc_kernel<T, 1><<<grid, block, 0, stream>>>(g, xp, m, d.N, C, S, w, r);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  APEX_PAR_DISPATCH_FLOAT(pdtype, P, [&] {
    reduce_pack_kernel<P><<<fin_blocks(C), kFinBlock, 0, stream>>>(ws.data_ptr<float>(), S, C, m, sums.data_ptr<float>(),
                                                        gw.data_ptr<P>(), gb.data_ptr<P>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {sums, gw, gb};
}

// The input gradient (empty_like(input)) from x (in layout `ncl`), dy and relu_out in x's layout.
at::Tensor launch_backward_elementwise(const at::Tensor& input, const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& ro, bool ncl, const at::Tensor& saved,
                                       const std::optional<at::Tensor>& weight, const at::Tensor& sums,
                                       cudaStream_t stream) {
  const int64_t C = x.size(1);
  at::Tensor result, out;
  std::tie(result, out) = output_for(input, x, ncl);
  const int64_t numel = x.numel();
  if (numel == 0 || C == 0) return result;
  const Dims d = dims_of(x, ncl);
  const FusedParams p{saved.data_ptr<float>(), sums.data_ptr<float>(), ptr_or_null(weight), nullptr,
                      param_dtype(weight), 0, C};
  APEX_PAR_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
    launch_fused_elementwise<T, true>(dy.data_ptr<T>(), x.data_ptr<T>(), nullptr,
                                      ro.defined() ? ro.data_ptr<T>() : nullptr, false, out.data_ptr<T>(), p, numel,
                                      ncl, d.L, stream);
  });
  if (!out.is_same(result)) result.copy_(out);
  return result;
}

void check_backward_args(const char* op, const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& saved,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& relu_out) {
  check_input_nd(op, input);
  const int64_t C = input.size(1);
  check_cuda_float(op, "grad_out", grad_out, input);
  check_packed(op, "saved", saved, input, 2 * C + 1, true);
  check_opt(op, "weight", weight, input);
  if (relu_out.has_value()) check_cuda_float(op, "relu_out", *relu_out, input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> syncbn_backward_reduce_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& saved,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& relu_out) {
  check_backward_args("syncbn_backward_reduce", grad_out, input, saved, weight, relu_out);
  const c10::cuda::CUDAGuard guard(input.device());
  bool ncl = false;
  const at::Tensor x = readable(input, ncl);
  const at::Tensor dy = in_layout(grad_out, x, ncl);
  const at::Tensor ro = relu_out.has_value() ? in_layout(*relu_out, x, ncl) : at::Tensor();
  return launch_backward_reduce(dy, x, ro, ncl, saved, weight, c10::cuda::getCurrentCUDAStream());
}

at::Tensor syncbn_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& saved,
                                const std::optional<at::Tensor>& weight, const at::Tensor& sums,
                                const std::optional<at::Tensor>& relu_out) {
  constexpr const char* op = "syncbn_backward";
  check_backward_args(op, grad_out, input, saved, weight, relu_out);
  check_packed(op, "sums", sums, input, 2 * input.size(1), true);
  const c10::cuda::CUDAGuard guard(input.device());
  bool ncl = false;
  const at::Tensor x = readable(input, ncl);
  if (x.numel() == 0 || x.size(1) == 0) return at::empty_like(input);
  const at::Tensor dy = in_layout(grad_out, x, ncl);
  const at::Tensor ro = relu_out.has_value() ? in_layout(*relu_out, x, ncl) : at::Tensor();
  return launch_backward_elementwise(input, dy, x, ro, ncl, saved, weight, sums, c10::cuda::getCurrentCUDAStream());
}

// One rank's whole backward: the reduction, then the input gradient from its sums.
std::tuple<at::Tensor, at::Tensor, at::Tensor> syncbn_backward_local_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& saved,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& relu_out) {
  check_backward_args("syncbn_backward_local", grad_out, input, saved, weight, relu_out);
  const c10::cuda::CUDAGuard guard(input.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  bool ncl = false;
  const at::Tensor x = readable(input, ncl);
  const at::Tensor dy = in_layout(grad_out, x, ncl);
  const at::Tensor ro = relu_out.has_value() ? in_layout(*relu_out, x, ncl) : at::Tensor();
  at::Tensor sums, gw, gb;
  std::tie(sums, gw, gb) = launch_backward_reduce(dy, x, ro, ncl, saved, weight, stream);
  return {launch_backward_elementwise(input, dy, x, ro, ncl, saved, weight, sums, stream), gw, gb};
}

}  // namespace
}  // namespace apex_parallel

TORCH_LIBRARY_IMPL(apex_parallel, CUDA, m) {
  m.impl("welford_mean_var", &apex_parallel::welford_mean_var_cuda);
  m.impl("welford_parallel", &apex_parallel::welford_parallel_cuda);
  m.impl("batchnorm_forward", &apex_parallel::batchnorm_forward_cuda);
  m.impl("batchnorm_backward_reduce", &apex_parallel::batchnorm_backward_reduce_cuda);
  m.impl("batchnorm_backward", &apex_parallel::batchnorm_backward_cuda);
  m.impl("syncbn_stats", &apex_parallel::syncbn_stats_cuda);
  m.impl("syncbn_forward", &apex_parallel::syncbn_forward_cuda);
  m.impl("syncbn_backward_reduce", &apex_parallel::syncbn_backward_reduce_cuda);
  m.impl("syncbn_backward", &apex_parallel::syncbn_backward_cuda);
  m.impl("syncbn_backward_local", &apex_parallel::syncbn_backward_local_cuda);
}
