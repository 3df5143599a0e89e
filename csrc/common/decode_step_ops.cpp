// decode_step_: one decode step through every layer of a pre-norm decoder, in one op.
#include <ATen/MemoryOverlap.h>

#include <limits>
#include <utility>

#include "binding_checks.h"
#include "gemm_ops.h"
#include "norm_rotary_ops.h"
#include "torch_ops.h"

namespace w8a8_cpu {

namespace {

// The weights of one layer in decode_step_'s `weights`, in this order (biases may be None); the final norm's weight
// follows the last layer's.
enum DecodeStepWeight : int64_t {
  kInputNorm, kQkv, kQkvScale, kQkvBias, kOut, kOutScale, kOutBias, kPostNorm, kGateUp, kGateUpScale, kGateUpBias,
  kDown, kDownScale, kDownBias, kWeightsPerLayer
};

}  // namespace

// One decode step of a pre-norm decoder (Llama family) through every layer, in one op: what the lean decoder's Python
// loop calls as eight ops a layer (w8a8_cpu.llm.decoder), the same functions in the same order, so the same bits; the
// per-op dispatch from Python (~8-20 us each, ~240 a token: ~25% of SmolLM2's 1-thread decode time) is paid once. h
// [1, H] (or [1, 1, H]) fp32: the token's embedding, the residual stream, updated in place (as the caches: a step
// that fails on a layer's input leaves the layers before it applied). Per layer: x = norm(h) (the
// previous add_rms_norm_'s), qkv = the fused q/k/v GEMM (quantized_linear), rotary on its query and key heads,
// decode_attention_ at `position` (writing the layer's caches), h += o_proj(attention), x = norm(h), the gated
// gate/up GEMM, h += down_proj, x = the next norm of h. Returns the final norm's output (the lm_head's input).
at::Tensor decode_step_op(at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t position,
                          int64_t heads, double scale, double eps, c10::optional<at::TensorList> k_scales,
                          c10::optional<at::TensorList> v_scales) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers,
                    "v_caches: expected one cache per layer of k_caches (", layers, "), got ", v_caches.size());
  const at::TensorList no_scales;
  const at::TensorList k_scale_list = k_scales.value_or(no_scales), v_scale_list = v_scales.value_or(no_scales);
  for (const auto& [list, arg] : {std::pair<const at::TensorList&, const char*>{k_scale_list, "k_scales"},
                                  {v_scale_list, "v_scales"}})
    TORCH_CHECK_VALUE(list.empty() || static_cast<int64_t>(list.size()) == layers, arg,
                      ": expected none or one per layer of k_caches (", layers, "), got ", list.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers + 1, "weights: expected ",
                    kWeightsPerLayer, " a layer (", layers, " layers) and the final norm's, ",
                    kWeightsPerLayer * layers + 1, " in all, got ", weights.size());
  check_cpu(h, "h");
  TORCH_CHECK_VALUE(h.scalar_type() == at::kFloat && h.dim() >= 1 && h.numel() == h.size(-1),
                    "h: expected one fp32 row [..., H] (a decode step's embedding), got ", h.scalar_type(), " ",
                    h.sizes());
  TORCH_CHECK_VALUE(heads >= 1 && heads <= std::numeric_limits<int32_t>::max(), "heads: expected 1 <= heads <= ",
                    std::numeric_limits<int32_t>::max(), ", got ", heads);
  TORCH_CHECK_VALUE(cos.dim() == 2 && position >= 0 && position < cos.size(0), "position: expected 0 <= position < ",
                    cos.dim() == 2 ? cos.size(0) : 0, " (the rows of cos [positions, head_dim]), got ", position,
                    " with cos of shape ", cos.sizes());
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "sin: expected the shape of cos, ", cos.sizes(), ", got ",
                    sin.sizes());
  const at::Tensor cos_row = cos.narrow(0, position, 1), sin_row = sin.narrow(0, position, 1);
  auto weight = [&](int64_t i) -> at::Tensor {
    const c10::optional<at::Tensor> t = weights.get(i);
    TORCH_CHECK_VALUE(t.has_value(), "weights[", i, "] is None (only biases may be)");
    return *t;
  };
  auto bias = [&](int64_t i) -> c10::optional<at::Tensor> { return weights.get(i); };
  at::Tensor x;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const char* part = "k_cache";  // what the layer is computing, for its errors
    try {
      const int64_t w0 = layer * kWeightsPerLayer;
      at::Tensor k_cache = k_caches[layer], v_cache = v_caches[layer];
      TORCH_CHECK_VALUE((k_cache.scalar_type() == at::kChar) == !k_scale_list.empty() &&
                            (k_cache.scalar_type() == at::kChar) == !v_scale_list.empty(),
                        "k_scales, v_scales: expected one per layer with int8 caches and none otherwise, got ",
                        k_scale_list.size(), " and ", v_scale_list.size(), " with a ", k_cache.scalar_type(),
                        " cache");
      const c10::optional<at::Tensor> k_scale = k_scale_list.empty() ? c10::nullopt
                                                                      : c10::optional<at::Tensor>(k_scale_list[layer]);
      const c10::optional<at::Tensor> v_scale = v_scale_list.empty() ? c10::nullopt
                                                                      : c10::optional<at::Tensor>(v_scale_list[layer]);
      // (kv_heads bounded before heads + kv_heads below; decode_attention_op checks the rest of both caches)
      TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.numel() > 0 &&
                            k_cache.size(0) <= std::numeric_limits<int32_t>::max() && k_cache.is_contiguous() &&
                            v_cache.is_contiguous(),
                        "expected contiguous, non-empty caches [kv_heads, length, head_dim] (kv_heads < 2^31), got "
                        "k_cache of shape ", k_cache.sizes(), " and strides ", k_cache.strides());
      // h is updated in place while the caches are written: an h inside one would take the cache's writes
      for (const c10::optional<at::Tensor>& cache : {c10::optional<at::Tensor>(k_cache),
                                                     c10::optional<at::Tensor>(v_cache), k_scale, v_scale})
        TORCH_CHECK_VALUE(!cache.has_value() || at::get_overlap_status(h, *cache) == at::MemOverlapStatus::No,
                          "h: overlaps the layer's k_cache, v_cache or their scales (written in place); pass a copy");
      if (layer == 0) {
        part = "input norm";
        x = rms_norm_rows(h, nullptr, weight(kInputNorm), eps);
      }
      part = "q/k/v projection";
      at::Tensor qkv = quantized_linear(x, weight(w0 + kQkv), weight(w0 + kQkvScale), bias(w0 + kQkvBias),
                                        c10::nullopt, c10::nullopt, false);
      part = "rotary embedding";
      rotary_embedding_op(qkv, cos_row, sin_row, heads + k_cache.size(0));
      part = "attention";
      const int64_t d = k_cache.size(2);
      TORCH_CHECK_VALUE(qkv.numel() % d == 0, "qkv: ", qkv.numel(), " outputs are not whole heads of ", d);
      const at::Tensor attention =
          decode_attention_op(qkv.view({-1, d}), k_cache, v_cache, position, heads, scale, k_scale, v_scale);
      part = "o_proj";
      const at::Tensor out = quantized_linear(attention.view({1, -1}), weight(w0 + kOut), weight(w0 + kOutScale),
                                              bias(w0 + kOutBias), c10::nullopt, c10::nullopt, false);
      TORCH_CHECK_VALUE(out.numel() == h.numel(), "expected ", h.numel(), " outputs (h's), got ", out.numel());
      part = "post-attention norm";
      const at::Tensor out_as_h = out.view(h.sizes());
      x = rms_norm_rows(h, &out_as_h, weight(w0 + kPostNorm), eps);
      part = "gate/up projection";
      const at::Tensor act = quantized_linear(x, weight(w0 + kGateUp), weight(w0 + kGateUpScale),
                                              bias(w0 + kGateUpBias), c10::nullopt, c10::nullopt, true);
      part = "down_proj";
      const at::Tensor down = quantized_linear(act, weight(w0 + kDown), weight(w0 + kDownScale), bias(w0 + kDownBias),
                                               c10::nullopt, c10::nullopt, false);
      TORCH_CHECK_VALUE(down.numel() == h.numel(), "expected ", h.numel(), " outputs (h's), got ", down.numel());
      part = layer + 1 < layers ? "the next layer's input norm" : "the final norm";
      const at::Tensor down_as_h = down.view(h.sizes());
      x = rms_norm_rows(h, &down_as_h, weight(w0 + kWeightsPerLayer), eps);  // the next kInputNorm, or the final one
    } catch (const c10::ValueError& e) {
      TORCH_CHECK_VALUE(false, "layer ", layer, ", ", part, ": ", e.what_without_backtrace());
    }
  }
  return x;
}

}  // namespace w8a8_cpu
