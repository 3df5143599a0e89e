// The GEMM ops' weight operand (packed_weight_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "packed_weight.h"

namespace w8a8_cpu {

// The weight as a packed view; raw int8 [N, K] weights are packed into `storage` for this call.
// A packed blob's header is checked on every call, its contents once per tensor version (verified_blobs.h).
PackedWeightView weight_view(const at::Tensor& w, int64_t k, at::Tensor& storage);

}  // namespace w8a8_cpu
