// The argument checks of binding_checks.h.
#include "binding_checks.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace w8a8_cpu {

ParallelFor torch_parallel_for() {
  return ParallelFor(
      [](int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
        at::parallel_for(begin, end, grain, body);
      },
      at::get_num_threads());
}

FloatKind float_kind(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return FloatKind::f32;
    case at::kBFloat16: return FloatKind::bf16;
    case at::kHalf: return FloatKind::f16;
    default: TORCH_CHECK_VALUE(false, arg, ": dtype must be float32, bfloat16 or float16, got ", t);
  }
}

void check_cpu(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), arg, ": expected a CPU tensor, got device ", t.device());
}

void check_rows(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.dim() == 2, arg, ": expected a 2-D tensor, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, arg,
                    ": last dimension must be contiguous (stride 1), got strides ", t.strides(),
                    "; call .contiguous() first");
}

void check_k(int64_t k, const char* arg) {
  TORCH_CHECK_VALUE(k > 0, arg, ": K (last dim) must be > 0");
  TORCH_CHECK_VALUE(k <= kMaxK, arg, ": K = ", k, " exceeds ", kMaxK,
                    ", the largest K whose int32 accumulation cannot overflow");
}

at::Tensor aligned(const at::Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  return address % static_cast<uintptr_t>(t.element_size()) == 0 ? t : t.clone(at::MemoryFormat::Contiguous);
}

at::Tensor checked_scales(const at::Tensor& s, int64_t rows, const char* arg, const char* what) {
  check_cpu(s, arg);
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE((s.dim() == 1 && s.size(0) == rows) || (s.dim() == 2 && s.size(0) == rows && s.size(1) == 1),
                    arg, ": expected shape [", rows, "] or [", rows, ", 1] (one scale per ", what, "), got ",
                    s.sizes());
  return aligned(s.contiguous());
}

void check_finite_weight_side(const at::Tensor& fp32, const char* arg) {
  const float* p = fp32.data_ptr<float>();
  const int64_t n = fp32.numel();
  uint32_t all_exponents = 0;  // exponent bits all ones in any value: NaN or Inf (a branch-free, vectorized pass)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    all_exponents |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (all_exponents == 0) return;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(std::isfinite(p[i]), arg, ": element ", i, " is ", p[i],
                      "; weight scales and bias must be finite");
}

bool reject_non_finite() {
  static const bool strict = [] {
    const char* v = std::getenv("W8A8_CPU_CHECK_FINITE");
    return v != nullptr && std::string(v) == "1";
  }();
  return strict;
}

void check_finite_rows(int64_t bad, const char* arg) {
  TORCH_CHECK_VALUE(bad < 0 || !reject_non_finite(), arg, ": row ", bad, " contains NaN or Inf (rejected because "
                    "W8A8_CPU_CHECK_FINITE=1; without it the row's output is NaN and the other rows are exact)");
}

}  // namespace w8a8_cpu
