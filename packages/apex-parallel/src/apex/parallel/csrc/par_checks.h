// Argument checks for apex_parallel's launchers: a small copy of apex-mta-kernels'
// csrc/checks.h (whose relative path differs between the source tree and installed wheels).
// Messages are built by concatenation and std::to_string/snprintf, never c10::str/ostream:
// ostream number formatting inside these libraries crashed on the GPU machine's toolchain.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace apex_parallel {

inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return "another dtype";
  }
}

namespace detail {
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
inline void put(std::string& s, double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }
inline void put(std::string& s, at::ScalarType t) { s += dtype_str(t); }
}  // namespace detail

template <typename... Args>
std::string fmt(const Args&... args) {
  std::string s;
  (detail::put(s, args), ...);
  return s;
}

#define APEX_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::apex_parallel::fmt(__VA_ARGS__))
#define APEX_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::apex_parallel::fmt(__VA_ARGS__))

}  // namespace apex_parallel

// Calls BODY with NAME bound to the C++ type of float dtype `st`.
#define APEX_PAR_DISPATCH_FLOAT(st, NAME, ...)                                 \
  [&] {                                                                        \
    switch (st) {                                                              \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }           \
      case at::kHalf: { using NAME = at::Half; return __VA_ARGS__(); }         \
      case at::kBFloat16: { using NAME = at::BFloat16; return __VA_ARGS__(); } \
      default: APEX_CHECK_TYPE(false, "unsupported dtype ", st);               \
    }                                                                          \
  }()
