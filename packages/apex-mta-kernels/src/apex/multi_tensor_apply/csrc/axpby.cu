// multi_tensor_axpby: outputs[i] = a * x[i] + b * y[i]; noop_flag = 1 if the checked input holds
// an inf or nan (arg_to_check: -1 both x and y, 0 x only, 1 y only).
#include "checks.h"
#include "multi_tensor_apply.cuh"

#include <torch/library.h>

#include <type_traits>

namespace apex_mta {
namespace {

// a*x + b*y rounded after each step, as torch computes it, so the kernel and the reference agree
// to the bit (--use_fast_math would otherwise contract it into an fma).
__device__ __forceinline__ float axpby(float a, float x, float b, float y) {
  return __fadd_rn(__fmul_rn(a, x), __fmul_rn(b, y));
}

template <typename Tx, typename Ty, typename Tout>
struct AxpbyFunctor {
  __device__ __forceinline__ void operator()(const TensorListMeta<3>& m, int t, int64_t /*chunk*/,
                                             int64_t start, int64_t end, float a, float b, bool check_x,
                                             bool check_y, int* noop) const {
    const Tx* x = static_cast<const Tx*>(m.ptr[0][t]);
    const Ty* y = static_cast<const Ty*>(m.ptr[1][t]);
    Tout* out = static_cast<Tout*>(m.ptr[2][t]);  // may be x or y (in place): no __restrict__
    // E elements per vector: the widest role moves one 16-byte word, a 16-bit role beside a
    // float32 one 8 bytes, so every warp access of every list is one contiguous run (as adam.cu
    // and scale.cu). Inputs stay raw words until used: fewer registers than E floats.
    constexpr int E = 16 / max_size<Tx, Ty, Tout>();
    using WX = Word<E, Tx>;
    using WY = Word<E, Ty>;
    using WOut = Word<E, Tout>;
    static_assert(sizeof(WX) == E * sizeof(Tx) && sizeof(WY) == E * sizeof(Ty) &&
                      sizeof(WOut) == E * sizeof(Tout),
                  "word size");
    constexpr int U = kBytesInFlight / (sizeof(WX) > sizeof(WY) ? sizeof(WX) : sizeof(WY));
    constexpr int64_t kStride = int64_t(kThreads) * E;
    bool finite = true;
    int64_t i = start;
    if (aligned16(x) && aligned16(y) && aligned16(out)) {
      const int64_t vec_end = start + (end - start) / E * E;
      for (int64_t base = start + int64_t(threadIdx.x) * E; base < vec_end; base += kStride * U) {
        WX rx[U];
        WY ry[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every load of the iteration before any store
          const int64_t j = base + u * kStride;
          if (j < vec_end) {
            rx[u] = *reinterpret_cast<const WX*>(x + j);
            ry[u] = *reinterpret_cast<const WY*>(y + j);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = base + u * kStride;
          if (j < vec_end) {
            const Tx* ex = reinterpret_cast<const Tx*>(&rx[u]);
            const Ty* ey = reinterpret_cast<const Ty*>(&ry[u]);
            WOut o;
            Tout* eo = reinterpret_cast<Tout*>(&o);
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float xv = to_float(ex[k]), yv = to_float(ey[k]);
              if (check_x) finite &= isfinite(xv);
              if (check_y) finite &= isfinite(yv);
              eo[k] = from_float<Tout>(axpby(a, xv, b, yv));
            }
            *reinterpret_cast<WOut*>(out + j) = o;
          }
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      const float xv = to_float(x[j]), yv = to_float(y[j]);
      if (check_x) finite &= isfinite(xv);
      if (check_y) finite &= isfinite(yv);
      out[j] = from_float<Tout>(axpby(a, xv, b, yv));
    }
    if (!finite) *noop = 1;  // racy but idempotent, as in apex
  }
};

void multi_tensor_axpby_cuda(at::TensorList x_, at::TensorList y_, at::TensorList outputs_,
                             const at::Tensor& noop_flag, double a, double b, int64_t arg_to_check) {
  const char* op = "multi_tensor_axpby";
  const std::vector<at::Tensor> x = x_.vec(), y = y_.vec(), outputs = outputs_.vec();
  const std::vector<ListArg> lists{{"x", &x}, {"y", &y}, {"outputs", &outputs}};
  APEX_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, op,
                    ": arg_to_check must be -1 (check x and y), 0 (x) or 1 (y), got ", arg_to_check);
  check_lists(op, lists, noop_flag);
  const bool check_x = arg_to_check != 1, check_y = arg_to_check != 0;
  int* noop = noop_flag.data_ptr<int>();
  for (const auto& group : group_by_dtype(lists)) {
    // (no structured binding: a lambda capturing one is C++20, nvcc warns #3357-D)
    const auto& dtypes = group.first;
    const auto& idx = group.second;
    APEX_DISPATCH_FLOAT(dtypes[0], Tx, [&] {
      APEX_DISPATCH_FLOAT(dtypes[1], Ty, [&] {
        APEX_DISPATCH_FLOAT(dtypes[2], Tout, [&] {
          launch<3>({&x, &y, &outputs}, idx, AxpbyFunctor<Tx, Ty, Tout>{}, static_cast<float>(a),
                    static_cast<float>(b), check_x, check_y, noop);
        });
      });
    });
  }
}

}  // namespace
}  // namespace apex_mta

TORCH_LIBRARY_IMPL(apex_mta, CUDA, m) {
  m.impl("multi_tensor_axpby", &apex_mta::multi_tensor_axpby_cuda);
}
