// The RMSNorm ops' one implementation (norm_rotary_ops.cpp), for decode_step_ too.
#pragma once

#include <ATen/ATen.h>

namespace w8a8_cpu {

// RMSNorm of each row of x [..., N] by weight [N]; with delta (x's shape and dtype), x += delta first, in place.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps);

}  // namespace w8a8_cpu
