// LayerNorm and RMSNorm, forward and backward, for float32, float16 and bfloat16 in any mix.
//
// One group of TX threads (a warp or more) owns a row; a block holds TY such groups. The input
// dtype is a template parameter; weight, bias, output and grad dtypes are read at run time
// (a uniform branch per access, free next to the memory traffic), which keeps the number of
// instantiations small while any dtype combination works. Statistics and sums are float32.
//
// Fast path ("vec"): H % 8 == 0 and every pointer aligned to 8 elements: each thread keeps its
// NV vectors of 8 elements of the row in registers, so the row is read from memory once.
// Otherwise ("generic"): scalar loops that read the row again for each pass (any H, any
// alignment). Indices are 64-bit throughout.
//
// Weight and bias gradients: a column reduction in two stages. Stage 1 writes float32 partial
// sums, one row of H per row group: the vec backward accumulates them in registers while it
// computes grad_input (grid-stride over rows, so each group sums many rows); the generic path
// runs a separate kernel over row ranges. Stage 2 sums the partials per column, in a fixed order
// (the result is the same on every run).
#include "checks.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

namespace apex_norm {
namespace {

enum Dt : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
constexpr int kVec = 8;        // elements per vector access (16 bytes of a 16-bit dtype)
constexpr int kMaxTX = 512;    // threads per row, at most (registers: see __launch_bounds__)

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T>
__device__ __forceinline__ void load_vec(const void* p, int64_t i, float (&o)[kVec]) {
  const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(static_cast<const T*>(p) + i);
#pragma unroll
  for (int k = 0; k < kVec; ++k) o[k] = static_cast<float>(pk.v[k]);
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
};

template <typename Tx, int NV, bool RMS>
__global__ void __launch_bounds__(kMaxTX) fwd_vec(FwdArgs a) {
  __shared__ float2 smem[32 * 32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < a.rows;
  const int64_t nvec = a.H / kVec;
  const int64_t base = row * a.H;
  float v[NV][kVec];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (live && j < nvec) {
      load_vec<Tx>(a.x, base + j * kVec, v[k]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) s += v[k][e];
    }
  }
  const float inv_h = 1.f / static_cast<float>(a.H);
  float mu = 0.f;
  if (!RMS) mu = row_sum(s, smem) * inv_h;
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (live && j < nvec) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = v[k][e] - mu;
        q += d * d;
      }
    }
  }
  const float r = rsqrtf(row_sum(q, smem) * inv_h + a.eps);
  if (!live) return;  // no barrier follows
  if (threadIdx.x == 0) {
    if (!RMS) a.mean[row] = mu;
    a.rstd[row] = r;
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nvec) {
      float w[kVec], b[kVec], o[kVec];
      if (a.w) load_vec_dt(a.w, a.wt, j * kVec, w);
      if (!RMS && a.b) load_vec_dt(a.b, a.wt, j * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float y = (v[k][e] - mu) * r;
        if (a.w) y *= w[e];
        if (!RMS && a.b) y += b[e];
        o[e] = y;
      }
      store_vec_dt(a.y, a.yt, base + j * kVec, o);
    }
  }
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
// (weight, then bias), so both gradients take one launch.
struct ColSums {
  const float* part[2];
  void* out[2];
};

__global__ void colsum(ColSums c, int64_t G, int64_t H, int ot) {
  __shared__ float s[8][33];
  const float* part = c.part[blockIdx.y];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float v = 0.f;
  if (col < H)
    for (int64_t g = threadIdx.y; g < G; g += 8) v += part[g * H + col];
  s[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
#pragma unroll
    for (int i = 1; i < 8; ++i) v += s[i][threadIdx.x];
    store_dt(c.out[blockIdx.y], ot, col, v);
  }
}

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

int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

bool vec_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (kVec * t.element_size()) == 0;
}

struct Config {
  int tx, ty, nv;  // nv == 0: the generic kernels
};

// Threads per row: enough that each holds about `per_thread` vectors (a warp at least, kMaxTX at
// most); rows per block: up to 256 threads a block. The backward keeps four arrays of NV vectors
// per thread, so it asks for 2 (at NV=4 ptxas spills under the 128-register cap of 512 threads).
Config pick(int64_t H, bool aligned, int max_nv, int per_thread) {
  if (aligned && H % kVec == 0 && H > 0) {
    const int64_t nvec = H / kVec;
    int tx = 32;
    while (tx < kMaxTX && int64_t(tx) * per_thread < nvec) tx *= 2;
    int nv = 1;
    while (int64_t(tx) * nv < nvec) nv *= 2;
    if (nv <= max_nv) return {tx, std::max(1, 256 / tx), nv};
  }
  int tx = 32;
  while (tx < kMaxTX && int64_t(tx) * 4 < H) tx *= 2;
  return {tx, std::max(1, 256 / tx), 0};
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

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

template <bool RMS>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_impl(
    const char* op, const at::Tensor& input_, const std::optional<at::Tensor>& weight_,
    const std::optional<at::Tensor>& bias_, at::IntArrayRef normalized_shape, double eps,
    std::optional<at::ScalarType> out_dtype) {
  check_input(op, "input", input_, normalized_shape);
  dt_of(op, "input", input_);
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
  at::Tensor mean = at::empty({RMS ? 0 : rows}, input.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
  if (rows == 0) return {out, mean, rstd};
  if (H == 0) {
    mean.fill_(std::numeric_limits<float>::quiet_NaN());
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return {out, mean, rstd};
  }
  FwdArgs a{input.data_ptr(), ptr_or_null(weight), RMS ? nullptr : ptr_or_null(bias), out.data_ptr(),
            RMS ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, H,
            static_cast<float>(eps), wt, yt};
  const bool aligned = vec_aligned(input) && vec_aligned(out) && (!weight || vec_aligned(*weight)) &&
                       (!bias || vec_aligned(*bias));
  const Config c = pick(H, aligned, 8, 4);
  const dim3 block(c.tx, c.ty);
  const dim3 grid(static_cast<unsigned>((rows + c.ty - 1) / c.ty));
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_x(input.scalar_type(), [&](auto tag) {
    using Tx = decltype(tag);
    switch (c.nv) {
      case 1: fwd_vec<Tx, 1, RMS><<<grid, block, 0, stream>>>(a); break;
      case 2: fwd_vec<Tx, 2, RMS><<<grid, block, 0, stream>>>(a); break;
      case 4: fwd_vec<Tx, 4, RMS><<<grid, block, 0, stream>>>(a); break;
      case 8: fwd_vec<Tx, 8, RMS><<<grid, block, 0, stream>>>(a); break;
      default: fwd_generic<Tx, RMS><<<grid, block, 0, stream>>>(a); break;
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
  at::Tensor gb = bias ? at::empty(bias->sizes(), bias->options()) : at::empty({0}, f32);
  if (rows == 0 || H == 0) {
    gw.zero_();
    gb.zero_();
    return {dx, gw, gb};
  }
  const bool want_w = weight.has_value(), want_b = bias.has_value();
  BwdArgs a{dy.data_ptr(), xy.data_ptr(), need_mean ? mean.data_ptr<float>() : nullptr,
            rstd.data_ptr<float>(), ptr_or_null(weight), ptr_or_null(bias), dx.data_ptr(),
            nullptr, nullptr, rows, H, static_cast<float>(eps), dyt, wt, dxt, memory_efficient};
  const bool aligned = vec_aligned(xy) && vec_aligned(dy) && vec_aligned(dx) &&
                       (!weight || vec_aligned(*weight)) && (!bias || vec_aligned(*bias));
  const Config c = pick(H, aligned, 4, 2);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 block(c.tx, c.ty);
  const int sms = sm_count(xy.get_device());
  at::Tensor part_w, part_b;
  int64_t groups = 0;
  dispatch_x(xy.scalar_type(), [&](auto tag) {
    using Tx = decltype(tag);
    if (c.nv > 0) {
      auto launch = [&](auto kernel) {
        // A persistent grid: at most what fits on the GPU at once (by threads; registers may
        // allow fewer, which only adds waves). With weight gradients each row group also sums at
        // least ~32 rows, so the float32 partials (written and read again: 16 bytes per column
        // per group for weight and bias) stay about 5 % of the traffic of 16-bit tensors.
        const int64_t row_blocks = (rows + c.ty - 1) / c.ty;
        const int64_t resident = int64_t(sms) * std::max(1, 2048 / (c.tx * c.ty));
        int64_t blocks = std::min(row_blocks, resident);
        if (want_w || want_b) {
          blocks = std::min(blocks, std::max<int64_t>(sms, rows / (32 * int64_t(c.ty))));
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
        kernel<<<dim3(static_cast<unsigned>(blocks)), block, 0, stream>>>(a);
      };
      switch (c.nv) {
        case 1: launch(bwd_vec<Tx, 1, RMS>); break;
        case 2: launch(bwd_vec<Tx, 2, RMS>); break;
        default: launch(bwd_vec<Tx, 4, RMS>); break;
      }
    } else {
      const dim3 grid(static_cast<unsigned>((rows + c.ty - 1) / c.ty));
      bwd_generic<Tx, RMS><<<grid, block, 0, stream>>>(a);
      if (want_w || want_b) {
        // Enough row ranges to fill the GPU; each has at least 32 rows.
        const int64_t col_blocks = (H + 255) / 256;
        const int64_t splits = std::max<int64_t>(
            1, std::min<int64_t>((rows + 31) / 32, (int64_t(sms) * 8 + col_blocks - 1) / col_blocks));
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
    colsum<<<dim3(static_cast<unsigned>((H + 31) / 32), n), dim3(32, 8), 0, stream>>>(sums, groups,
                                                                                     H, wt);
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
