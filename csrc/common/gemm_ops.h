// The fused linear ops' one implementation (gemm_ops.cpp), for decode_step_ too.
#pragma once

#include <ATen/ATen.h>

namespace w8a8_cpu {

// The fused linear ops: per-token quantization of x [..., K] and one GEMM with the weight; gated (SwiGLU's gate/up
// projection, w holding gate rows then up rows): silu(gate) * up, [..., N / 2].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype,
                            const c10::optional<at::Tensor>& amax, bool gated);

}  // namespace w8a8_cpu
