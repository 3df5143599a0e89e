// The packed weight ops: pack_weight, pack_weight_int4, _verify_packed_weight, and the GEMM ops' weight operand as a
// checked packed view.
#include "packed_weight_ops.h"

#include "binding_checks.h"
#include "registry.h"
#include "torch_ops.h"
#include "verified_blobs.h"

namespace w8a8_cpu {

namespace {

bool is_packed(const at::Tensor& w) { return w.dim() == 1 && w.scalar_type() == at::kByte; }

// A raw int8 [N, K] weight to pack (int8 values, or int4 values held in int8: `what` says which).
void check_raw_weight(const at::Tensor& w, const char* arg, const char* what) {
  check_cpu(w, arg);
  TORCH_CHECK_VALUE(w.scalar_type() == at::kChar, arg, ": dtype must be int8 ", what, ", got ", w.scalar_type());
  check_rows(w, arg);
  TORCH_CHECK_VALUE(w.size(0) > 0, arg, ": N (dim 0) must be > 0");
  check_k(w.size(1), arg);
}

at::Tensor pack_weight_tensor(const at::Tensor& w) {
  check_raw_weight(w, "w", "(a raw [N, K] weight)");
  const MicroKernel& kernel = active_kernel();
  const int64_t nbytes =
      as_value_errors([&] { return packed_weight_nbytes(w.size(0), w.size(1), kernel.geometry().layout, "w"); });
  auto blob = at::empty({nbytes}, w.options().dtype(at::kByte));
  pack_weight(kernel, w.data_ptr<int8_t>(), w.size(0), w.size(1), w.stride(0), blob.data_ptr<uint8_t>(),
              torch_parallel_for());
  return blob;
}

}  // namespace

// The public op: the blob is correct by construction, so its first use need not verify it.
at::Tensor pack_weight_op(const at::Tensor& w) {
  at::Tensor blob = pack_weight_tensor(w);
  verified_blobs().insert(blob);
  return blob;
}

// int4 weights: q int8 [N, K] holding values in [-8, 7], scale (and minimum) fp32 [N, groups] per group of group_size
// k (a power of two, 32 .. 65536) or per channel (group_size 0, one group); half_scales: the scales stored as fp16
// (each must be an fp16 value).
at::Tensor pack_weight_int4_op(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& minimum,
                               int64_t group_size, bool half_scales) {
  check_raw_weight(q, "q", "holding int4 values in [-8, 7] ([N, K])");
  int group_log2 = 0;
  if (group_size != 0) {
    while (group_log2 < kMaxGroupLog2 && (int64_t{1} << group_log2) < group_size) ++group_log2;
    TORCH_CHECK_VALUE(group_size >= (int64_t{1} << kMinGroupLog2) && group_size == (int64_t{1} << group_log2),
                      "group_size: expected 0 (per channel) or a power of two in [", int64_t{1} << kMinGroupLog2, ", ",
                      int64_t{1} << kMaxGroupLog2, "], got ", group_size);
  }
  const int64_t n = q.size(0), k = q.size(1);
  const int64_t groups = group_size ? (k + group_size - 1) / group_size : 1;
  auto checked_values = [&](const at::Tensor& t, const char* arg) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, arg, ": expected shape [", n, ", ",
                      groups, "] (one value per output channel and group of ", group_size ? group_size : k,
                      " k), got ", t.sizes());
    const at::Tensor c = aligned(t.contiguous());
    check_finite_weight_side(c, arg);
    return c;
  };
  const at::Tensor s = checked_values(scale, "scale");
  const at::Tensor mn = minimum ? checked_values(*minimum, "minimum") : at::Tensor();
  const WeightFormat format{mn.defined() ? WeightScheme::int4_min : WeightScheme::int4, group_log2,
                            half_scales ? ScaleStorage::f16 : ScaleStorage::f32};
  const MicroKernel& kernel = active_kernel();
  const at::Tensor qc = q.contiguous();  // (int8: any address is aligned)
  const int64_t nbytes = as_value_errors(
      [&] { return packed_weight_nbytes(n, k, kernel.geometry().layout, "q", format); });
  auto blob = at::empty({nbytes}, q.options().dtype(at::kByte));
  as_value_errors([&] {
    pack_weight_int4(kernel, qc.data_ptr<int8_t>(), n, k, k, s.data_ptr<float>(),
                     mn.defined() ? mn.data_ptr<float>() : nullptr, format, blob.data_ptr<uint8_t>(),
                     torch_parallel_for());
    return 0;
  });
  verified_blobs().insert(blob);
  return blob;
}

namespace {

// A 1-D uint8 blob from the caller as a view: its header checked on every call, its contents once per tensor version.
PackedWeightView checked_blob(const at::Tensor& blob, const char* arg) {
  return as_value_errors([&] {
    const PackedWeightView v = view_packed_weight(blob.data_ptr<uint8_t>(), blob.numel(), arg);
    verified_blobs().ensure(blob, [&] { verify_packed_weight(v, arg); });
    return v;
  });
}

}  // namespace

PackedWeightView weight_view(const at::Tensor& w, int64_t k, at::Tensor& storage) {
  check_cpu(w, "w");
  if (is_packed(w)) {
    TORCH_CHECK_VALUE(w.is_contiguous(), "w: packed weight must be contiguous");
    const PackedWeightView view = checked_blob(w, "w");
    TORCH_CHECK_VALUE(view.header.k == k, "w: packed weight has K = ", view.header.k, " but the activations have K = ",
                      k);
    return view;
  }
  TORCH_CHECK_VALUE(w.scalar_type() == at::kChar,
                    "w: expected a raw int8 [N, K] weight or a packed weight (1-D uint8 from pack_weight), got dtype ",
                    w.scalar_type(), " and shape ", w.sizes());
  check_rows(w, "w");
  TORCH_CHECK_VALUE(w.size(1) == k, "w: K mismatch: weight has K = ", w.size(1), " but the activations have K = ", k);
  TORCH_CHECK_VALUE(w.size(0) > 0, "w: N (dim 0) must be > 0");
  storage = pack_weight_tensor(w);
  return view_packed_weight(storage.data_ptr<uint8_t>(), storage.numel(), "w");
}

// Validation of a blob without a matmul, for Python code that reads blobs itself (unpack_weight): the same header
// and content checks as the ops (cached the same way), ValueError naming `blob`.
void verify_packed_weight_op(const at::Tensor& blob) {
  check_cpu(blob, "blob");
  TORCH_CHECK_VALUE(is_packed(blob) && blob.is_contiguous(), "blob: expected a contiguous 1-D uint8 packed weight (the "
                    "output of pack_weight), got dtype ", blob.scalar_type(), " and shape ", blob.sizes());
  checked_blob(blob, "blob");
}

}  // namespace w8a8_cpu
