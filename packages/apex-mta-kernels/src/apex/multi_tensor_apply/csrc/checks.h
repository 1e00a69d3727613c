// Argument checks shared by every launcher. They run before any kernel and raise the same
// exception types and words as the Python reference path (reference.py): ValueError for
// devices, lengths, sizes and layouts; TypeError for dtypes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace apex_mta {

// The name Python prints for a dtype, so both paths word their errors alike.
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// Error messages are built here, not with c10::str: on the GPU machine's toolchain, ostream
// number formatting instantiated inside this library crashed (SIGSEGV in num_put) while raising.
// Strings are concatenated and numbers go through std::to_string / snprintf, which need no locale.
namespace detail {
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
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

// TORCH_CHECK_* with the message built by apex_mta::fmt (see above).
#define APEX_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::apex_mta::fmt(__VA_ARGS__))
#define APEX_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::apex_mta::fmt(__VA_ARGS__))
#define APEX_CHECK(cond, ...) TORCH_CHECK(cond, ::apex_mta::fmt(__VA_ARGS__))

struct ListArg {
  const char* name;
  const std::vector<at::Tensor>* list;
};



// Bit mask of the memory formats `t` is dense in: 1 contiguous, 2 channels_last, 4 channels_last_3d.
inline int layouts(const at::Tensor& t) {
  const int dim = t.dim();
  return (t.is_contiguous() ? 1 : 0) |
         (dim == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) ? 2 : 0) |
         (dim == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d) ? 4 : 0);
}

inline bool float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}


// Checks DEPTH parallel lists and the int32 noop flag; returns the device they all live on.
inline void check_lists(const char* op, const std::vector<ListArg>& lists, const at::Tensor& noop_flag) {
  APEX_CHECK_TYPE(noop_flag.scalar_type() == at::kInt, op, ": noop_flag must be an int32 tensor, got ",
                   dtype_str(noop_flag.scalar_type()));
  APEX_CHECK_VALUE(noop_flag.numel() >= 1, op, ": noop_flag must have at least one element");
  APEX_CHECK_VALUE(noop_flag.is_cuda(), op, ": noop_flag is on ", noop_flag.device(),
                    " but the tensors are CUDA tensors; every tensor must be on one CUDA device");
  const at::Device dev = noop_flag.device();
  const auto& first = lists[0];
  const size_t n = first.list->size();
  for (const auto& l : lists) {
    APEX_CHECK_VALUE(l.list->size() == n, op, ": ", l.name, " has ", l.list->size(), " tensors but ",
                      first.name, " has ", n, "; the lists must be the same length");
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& ref = (*first.list)[i];
    for (const auto& l : lists) {
      const at::Tensor& t = (*l.list)[i];
      APEX_CHECK_VALUE(t.device() == dev, op, ": ", l.name, "[", i, "] is on ", t.device(),
                        " but noop_flag is on ", dev, "; every tensor must be on one CUDA device");
      APEX_CHECK_TYPE(float_dtype(t.scalar_type()), op, ": ", l.name, "[", i, "] has dtype ",
                       dtype_str(t.scalar_type()), "; supported: float32, float16, bfloat16");
      APEX_CHECK_VALUE(t.numel() == ref.numel(), op, ": ", l.name, "[", i, "] has ", t.numel(),
                        " elements but ", first.name, "[", i, "] has ", ref.numel());
      const int lay = layouts(t);
      APEX_CHECK_VALUE(lay != 0, op, ": ", l.name, "[", i,
                        "] is not contiguous (contiguous or channels_last memory format required)");
      APEX_CHECK_VALUE(t.numel() <= 1 || (lay & layouts(ref)) != 0, op, ": ", l.name, "[", i,
                        "] has strides ", t.strides(), " but ", first.name, "[", i, "] has ",
                        ref.strides(), "; tensors at one position must share a memory format");
    }
  }
}

// Positions of the lists grouped by the dtypes found at each position, one launch group each,
// so lists that mix dtypes are handled rather than misread.
inline std::map<std::vector<at::ScalarType>, std::vector<int64_t>> group_by_dtype(
    const std::vector<ListArg>& lists) {
  std::map<std::vector<at::ScalarType>, std::vector<int64_t>> groups;
  const size_t n = lists[0].list->size();
  if (n == 0) return groups;
  // Common case first, without a per-position allocation: every position has position 0's dtypes.
  std::vector<at::ScalarType> first;
  first.reserve(lists.size());
  for (const auto& l : lists) first.push_back((*l.list)[0].scalar_type());
  size_t same = 1;
  while (same < n) {
    bool ok = true;
    for (size_t d = 0; d < lists.size() && ok; ++d) ok = (*lists[d].list)[same].scalar_type() == first[d];
    if (!ok) break;
    ++same;
  }
  auto& head = groups[first];
  head.reserve(same);
  for (size_t i = 0; i < same; ++i) head.push_back(static_cast<int64_t>(i));
  for (size_t i = same; i < n; ++i) {
    std::vector<at::ScalarType> key;
    key.reserve(lists.size());
    for (const auto& l : lists) key.push_back((*l.list)[i].scalar_type());
    groups[key].push_back(static_cast<int64_t>(i));
  }
  return groups;
}

// lr, step and inv_scale of the capturable ops: one element, an accepted dtype, on the lists' device.
inline void check_scalar(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& noop_flag, bool integral_ok) {
  const at::ScalarType st = t.scalar_type();
  const bool ok = st == at::kFloat || st == at::kDouble ||
                  (integral_ok && (st == at::kInt || st == at::kLong));
  APEX_CHECK_TYPE(ok, op, ": ", name, " has dtype ", dtype_str(st), "; supported: ",
                  integral_ok ? "int32, int64, float32, float64" : "float32, float64");
  APEX_CHECK_VALUE(t.numel() == 1, op, ": ", name, " must have exactly one element, got ", t.numel());
  APEX_CHECK_VALUE(t.device() == noop_flag.device(), op, ": ", name, " is on ", t.device(),
                   " but noop_flag is on ", noop_flag.device(), "; every tensor must be on one device");
}

}  // namespace apex_mta



// Calls BODY with `scalar_t_<N>` bound to the C++ type of float dtype `st`.
#define APEX_DISPATCH_FLOAT(st, NAME, ...)                                     \
  [&] {                                                                        \
    switch (st) {                                                              \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }           \
      case at::kHalf: { using NAME = at::Half; return __VA_ARGS__(); }         \
      case at::kBFloat16: { using NAME = at::BFloat16; return __VA_ARGS__(); } \
      default: APEX_CHECK_TYPE(false, "unsupported dtype ", st);              \
    }                                                                          \
  }()
