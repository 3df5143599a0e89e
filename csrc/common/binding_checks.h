// What the ops of the torch binding check and convert, each failure a ValueError naming the argument, and the two
// bridges to the drivers: torch's thread pool as their ParallelFor, their errors as ValueError.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>

#include "microkernel.h"
#include "parallel.h"

namespace w8a8_cpu {

// torch's one pool, with the thread count it has at this call (torch.set_num_threads may change it between calls).
ParallelFor torch_parallel_for();

// Driver errors (std::invalid_argument) surface in Python as ValueError with the driver's message.
template <typename F>
auto as_value_errors(F&& f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// The FloatKind of a float32, bfloat16 or float16 tensor's dtype.
FloatKind float_kind(at::ScalarType t, const char* arg);

void check_cpu(const at::Tensor& t, const char* arg);

// A 2-D row-major operand: last dim contiguous (rows may be strided).
void check_rows(const at::Tensor& t, const char* arg);

// 0 < k <= kMaxK.
void check_k(int64_t k, const char* arg);

// A tensor whose data pointer is a multiple of its element size (a copy when it is not): a tensor made over raw bytes
// (torch.frombuffer, a safetensors file whose header length is not a multiple of 4, a view at an odd byte offset)
// can start anywhere, and the kernels read elements through typed pointers.
at::Tensor aligned(const at::Tensor& t);

// Per-row fp32 scales given as [rows] or [rows, 1].
at::Tensor checked_scales(const at::Tensor& s, int64_t rows, const char* arg, const char* what);

// Weight-side fp32 values (weight scales, bias) must be finite: one NaN there poisons a column of every output row,
// which the activation-side rule (a non-finite row of x gives that row NaN, every other row exact) cannot express.
// O(N) per call against the O(N * K) weight read.
void check_finite_weight_side(const at::Tensor& fp32, const char* arg);

// Strict mode, W8A8_CPU_CHECK_FINITE=1 (read once): a NaN/Inf activation row raises instead of giving a NaN output
// row (quantize_rows). Off by default, as nn.Linear: one bad request must not fail a whole serving batch.
bool reject_non_finite();

// Raises for row `bad` (>= 0, quantize_rows' first non-finite row) in strict mode.
void check_finite_rows(int64_t bad, const char* arg);

}  // namespace w8a8_cpu
