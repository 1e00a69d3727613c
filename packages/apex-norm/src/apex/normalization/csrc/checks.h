// Argument checks of the apex_norm launchers: TORCH_CHECK_* with messages built by plain string
// concatenation. apex-mta-kernels' checks.h explains why (c10::str formatting numbers crashed
// inside these libraries on the GPU machine's toolchain); this is the small part of it that the
// norm kernels need, kept beside them because the builder compiles each package's csrc on its
// own (a relative include into apex-mta-kernels breaks in source checkouts).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace apex_norm {

inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

namespace detail {
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
// Without these a double would take IntArrayRef's one-element constructor ("[3]" for 3.5).
inline void put(std::string& s, double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
inline void put(std::string& s, float v) { put(s, static_cast<double>(v)); }
inline void put(std::string& s, const c10::Device& d) { s += d.str(); }
inline void put(std::string& s, at::ScalarType t) { s += dtype_str(t); }
inline void put(std::string& s, c10::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  s += "]";
}
}  // namespace detail

template <typename... Args>
std::string fmt(const Args&... args) {
  std::string s;
  (detail::put(s, args), ...);
  return s;
}

#define APEX_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::apex_norm::fmt(__VA_ARGS__))
#define APEX_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::apex_norm::fmt(__VA_ARGS__))

}  // namespace apex_norm
