// The thin torch layer: validates inputs, allocates, parallelises with at::parallel_for, registers
// torch.ops.w8a8_cpu.*. All arithmetic lives in the driver and the micro-kernels.
#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "cpu_features.h"
#include "gemm_driver.h"
#include "layer_ops.h"
#include "moe_driver.h"
#include "registry.h"

namespace w8a8_cpu {
namespace {

// torch's one pool, with the thread count it has at this call (torch.set_num_threads may change it between calls).
ParallelFor torch_parallel_for() {
  return ParallelFor(
      [](int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
        at::parallel_for(begin, end, grain, body);
      },
      at::get_num_threads());
}

// Driver errors (std::invalid_argument) surface in Python as ValueError with the driver's message.
template <typename F>
auto as_value_errors(F&& f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
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

// A 2-D row-major operand: last dim contiguous (rows may be strided).
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

// A tensor whose data pointer is a multiple of its element size (a copy when it is not): a tensor made over raw bytes
// (torch.frombuffer, a safetensors file whose header length is not a multiple of 4, a view at an odd byte offset)
// can start anywhere, and the kernels read elements through typed pointers.
at::Tensor aligned(const at::Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  return address % static_cast<uintptr_t>(t.element_size()) == 0 ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Per-row fp32 scales given as [rows] or [rows, 1].
at::Tensor checked_scales(const at::Tensor& s, int64_t rows, const char* arg, const char* what) {
  check_cpu(s, arg);
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE((s.dim() == 1 && s.size(0) == rows) || (s.dim() == 2 && s.size(0) == rows && s.size(1) == 1),
                    arg, ": expected shape [", rows, "] or [", rows, ", 1] (one scale per ", what, "), got ",
                    s.sizes());
  return aligned(s.contiguous());
}

// Weight-side fp32 values (weight scales, bias) must be finite: one NaN there poisons a column of every output row,
// which the activation-side rule (a non-finite row of x gives that row NaN, every other row exact) cannot express.
// O(N) per call against the O(N * K) weight read.
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

// Driver scratch: a buffer of the calling thread, grown on demand and kept between calls (a fresh multi-MB buffer
// per call would page-fault through every page again; ops never nest, so one per thread is enough). What all
// threads keep together is bounded by kRetainedScratchBytes: a request that would cross it (big MoE prefills, or
// many threads calling at once) gets a buffer of its own, freed after the call. A thread's buffer is freed (and
// leaves the budget) when the thread exits: it is a thread_local with a destructor.
constexpr int64_t kRetainedScratchBytes = int64_t{256} << 20;
std::atomic<int64_t> g_retained_scratch_bytes{0};

struct RetainedScratch {
  at::Tensor buffer;
  ~RetainedScratch() { g_retained_scratch_bytes -= buffer.defined() ? buffer.numel() : 0; }
};

// Adds `delta` bytes to the retained total if that stays within the budget.
bool claim_retained(int64_t delta) {
  int64_t total = g_retained_scratch_bytes.load();
  do {
    if (total + delta > kRetainedScratchBytes) return false;
  } while (!g_retained_scratch_bytes.compare_exchange_weak(total, total + delta));
  return true;
}

at::Tensor scratch_buffer(int64_t nbytes) {
  thread_local RetainedScratch mine;
  nbytes = std::max<int64_t>(nbytes, 1);
  if (mine.buffer.defined() && mine.buffer.numel() >= nbytes) return mine.buffer;
  const int64_t held = mine.buffer.defined() ? mine.buffer.numel() : 0;
  if (!claim_retained(nbytes - held)) return at::empty({nbytes}, at::kByte);
  mine.buffer = at::Tensor();  // free the old one before allocating the new one
  mine.buffer = at::empty({nbytes}, at::kByte);
  return mine.buffer;
}

// Packed blobs are verified (verify_packed_weight: checksum, channel sums, padding; one pass over the blob) once
// per tensor contents, not on every call: the pass costs about as much as an M = 1 GEMV over the same weight
// (docs/ARCHITECTURE.md). The contents are identified as far as torch can tell: the storage, the byte range and
// the tensor's version counter, which every in-place op bumps (views share it). A weak reference keeps the storage
// object's address from being reused by a new storage while the entry exists. A blob in file-backed storage
// (torch.from_file, torch.load(mmap=True), UntypedStorage.from_file) is verified on every call instead: another
// process can rewrite the file under the mapping, and no counter sees that. Writes that bypass the counter within
// the process (through numpy, .data, raw pointers, a second tensor made with set_() on the same storage, which has a
// counter of its own, or in-place edits of inference tensors, which have none) are not seen: they are the process's
// own edits, not input; the header is still validated on every call, so memory safety never depends on this cache.
class VerifiedBlobs {
 public:
  template <typename Verify>
  void ensure(const at::Tensor& t, Verify&& verify) {
    const Key key = key_of(t);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = entries_.find(key.data);
      if (it != entries_.end() && it->second.matches(key) && !it->second.file_backed) return;
    }
    verify();  // throws for a bad blob; outside the lock, so threads verifying different blobs do not wait
    insert(t, file_backed(t));
  }

  void insert(const at::Tensor& t, bool in_file = false) {
    const Key key = key_of(t);
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() >= prune_at_) {
      for (auto it = entries_.begin(); it != entries_.end();)
        it = it->second.storage.expired() ? entries_.erase(it) : std::next(it);
      prune_at_ = std::max<size_t>(1024, 2 * entries_.size());
    }
    entries_.insert_or_assign(key.data, Entry{key, c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(
                                                       c10::raw::intrusive_ptr::make_weak(key.storage)), in_file});
  }

 private:
  struct Key {
    const void* data;
    c10::StorageImpl* storage;
    int64_t nbytes;
    uint32_t version;
  };
  struct Entry {
    Key key;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    bool file_backed;  // verified on every call (found once, at the first verification)
    bool matches(const Key& k) const {
      return key.storage == k.storage && key.nbytes == k.nbytes && key.version == k.version && !storage.expired();
    }
  };
  // Whether the blob's bytes live in a mapping of a file: torch's MapAllocator (torch.from_file), or, on Linux, any
  // file mapping /proc/self/maps lists at its address (torch.load(mmap=True) slices one storage per record out of
  // the mapped file, numpy memmaps): read once per blob, at its first verification.
  static bool file_backed(const at::Tensor& t) {
    if (at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr) return true;
#ifdef __linux__
    const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
      unsigned long long begin = 0, end = 0, offset = 0, inode = 0;
      char perms[8] = {}, device[16] = {};
      if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %15s %llu", &begin, &end, perms, &offset, device, &inode) != 6)
        continue;
      if (address >= begin && address < end) return inode != 0;
    }
#endif
    return false;
  }
  static Key key_of(const at::Tensor& t) {
    const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
    return {t.data_ptr(), t.storage().unsafeGetStorageImpl(), t.numel(),
            version.enabled() ? version.current_version() : 0u};
  }

  std::mutex mutex_;
  std::unordered_map<const void*, Entry> entries_;
  size_t prune_at_ = 1024;
};

VerifiedBlobs& verified_blobs() {
  static VerifiedBlobs* blobs = new VerifiedBlobs;  // never destroyed: ops may run during interpreter teardown
  return *blobs;
}

bool is_packed(const at::Tensor& w) { return w.dim() == 1 && w.scalar_type() == at::kByte; }

at::Tensor pack_weight_tensor(const at::Tensor& w) {
  check_cpu(w, "w");
  TORCH_CHECK_VALUE(w.scalar_type() == at::kChar, "w: dtype must be int8 (a raw [N, K] weight), got ",
                    w.scalar_type());
  check_rows(w, "w");
  TORCH_CHECK_VALUE(w.size(0) > 0, "w: N (dim 0) must be > 0");
  check_k(w.size(1), "w");
  const MicroKernel& kernel = active_kernel();
  const int64_t nbytes =
      as_value_errors([&] { return packed_weight_nbytes(w.size(0), w.size(1), kernel.geometry().layout, "w"); });
  auto blob = at::empty({nbytes}, w.options().dtype(at::kByte));
  pack_weight(kernel, w.data_ptr<int8_t>(), w.size(0), w.size(1), w.stride(0), blob.data_ptr<uint8_t>(),
              torch_parallel_for());
  return blob;
}

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
  check_cpu(q, "q");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kChar, "q: dtype must be int8 holding int4 values in [-8, 7] ([N, K]), got ",
                    q.scalar_type());
  check_rows(q, "q");
  TORCH_CHECK_VALUE(q.size(0) > 0, "q: N (dim 0) must be > 0");
  check_k(q.size(1), "q");
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

// A 1-D uint8 blob from the caller as a view: its header checked on every call, its contents once per tensor version.
PackedWeightView checked_blob(const at::Tensor& blob, const char* arg) {
  return as_value_errors([&] {
    const PackedWeightView v = view_packed_weight(blob.data_ptr<uint8_t>(), blob.numel(), arg);
    verified_blobs().ensure(blob, [&] { verify_packed_weight(v, arg); });
    return v;
  });
}

// The weight as a packed view; raw int8 [N, K] weights are packed into `storage` for this call.
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

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias) return {};
  check_cpu(*bias, "bias");
  float_kind(bias->scalar_type(), "bias");
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape [", n, "], got ", bias->sizes());
  return aligned(bias->to(at::kFloat).contiguous());
}

// A GEMM op's weight operand, checked: its packed view (a raw int8 [N, K] weight is packed into `storage` for this
// call) and, for ops with an epilogue, the per-output-channel scales and the bias as contiguous fp32.
struct WeightOperand {
  at::Tensor storage;  // declared before view: weight_view fills it first
  PackedWeightView view;
  at::Tensor scales, bias;

  WeightOperand(const at::Tensor& w, int64_t k) : view(weight_view(w, k, storage)) {}
  WeightOperand(const at::Tensor& w, int64_t k, const at::Tensor& w_scale, const c10::optional<at::Tensor>& b)
      : WeightOperand(w, k) {
    scales = checked_scales(w_scale, n(), "w_scale", "output channel");
    bias = checked_bias(b, n());
    check_finite_weight_side(scales, "w_scale");
    if (bias.defined()) check_finite_weight_side(bias, "bias");
  }
  int64_t n() const { return view.header.n; }
};

// The epilogue's operands for `out` [M, N] (row scales may be null where linear() computes them itself).
GemmOutput epilogue(const float* x_scales, const at::Tensor& w_scales, const at::Tensor& bias, at::Tensor& out,
                    FloatKind out_kind) {
  return {x_scales, w_scales.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr(),
          out_kind, out.size(1)};
}

// Core: x_q int8 [M, K] (validated) times the weight into a new [M, N] tensor, through the epilogue or, when
// x_scale is undefined, as the raw int32 accumulators.
at::Tensor scaled_mm(const at::Tensor& x_q, const at::Tensor& x_scale, const WeightOperand& w,
                     at::ScalarType out_dtype) {
  const MicroKernel& kernel = active_kernel();
  const bool raw = !x_scale.defined();
  const FloatKind out_kind = raw ? FloatKind::f32 : float_kind(out_dtype, "out_dtype");
  const int64_t m = x_q.size(0);
  auto out = at::empty({m, w.n()}, x_q.options().dtype(raw ? at::kInt : out_dtype));
  if (m == 0) return out;
  const at::Tensor scratch = scratch_buffer(gemm_scratch_nbytes(kernel, m, w.view.header.k_padded));
  GemmOutput o{nullptr, nullptr, nullptr, out.data_ptr(), out_kind, w.n()};
  if (raw) {
    o.raw_int32 = true;
  } else {
    o = epilogue(x_scale.data_ptr<float>(), w.scales, w.bias, out, out_kind);
  }
  as_value_errors([&] {
    gemm(kernel, x_q.data_ptr<int8_t>(), m, x_q.stride(0), w.view, o, scratch.data_ptr(), torch_parallel_for());
    return 0;
  });
  return out;
}

// Strict mode, W8A8_CPU_CHECK_FINITE=1 (read once): a NaN/Inf activation row raises instead of giving a NaN output
// row (quantize_rows). Off by default, as nn.Linear: one bad request must not fail a whole serving batch.
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

// Per-row absmax given by the caller ([M] or [M, 1] fp32), or undefined.
at::Tensor checked_amax(const c10::optional<at::Tensor>& amax, int64_t m) {
  if (!amax) return {};
  return checked_scales(*amax, m, "amax", "row");
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x2d, const at::Tensor& amax) {
  const FloatKind kind = float_kind(x2d.scalar_type(), "x");
  const int64_t m = x2d.size(0), k = x2d.size(1);
  auto q = at::empty({m, k}, x2d.options().dtype(at::kChar));
  auto scales = at::empty({m, 1}, x2d.options().dtype(at::kFloat));
  const int64_t bad = as_value_errors([&] {
    return quantize_rows(active_kernel(), x2d.data_ptr(), kind, m, k, x2d.stride(0), q.data_ptr<int8_t>(), k,
                         scales.data_ptr<float>(), torch_parallel_for(), amax.defined() ? amax.data_ptr<float>() : nullptr);
  });
  check_finite_rows(bad, "x");
  return {q, scales};
}

// Activations x [..., K] as a 2-D [M, K] operand.
at::Tensor activation_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  float_kind(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least 1 dimension [..., K], got a scalar");
  check_k(x.size(-1), "x");
  TORCH_CHECK_VALUE(x.size(-1) == 1 || x.stride(-1) == 1, "x: last dimension must be contiguous (stride 1), got strides ",
                    x.strides(), "; call .contiguous() first");
  return aligned(x.dim() == 2 ? x : x.reshape({-1, x.size(-1)}));
}

std::tuple<at::Tensor, at::Tensor> per_token_quant_int8_op(const at::Tensor& x, const c10::optional<at::Tensor>& amax) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x: expected a 2-D [M, K] tensor, got shape ", x.sizes());
  const at::Tensor rows = activation_rows(x);
  return quantize(rows, checked_amax(amax, rows.size(0)));
}

// Exact int32 accumulators x_q . w^T: partial products that callers add (tensor parallelism) before one epilogue.
at::Tensor int8_mm_op(const at::Tensor& x_q, const at::Tensor& w) {
  check_cpu(x_q, "x_q");
  TORCH_CHECK_VALUE(x_q.scalar_type() == at::kChar, "x_q: dtype must be int8, got ", x_q.scalar_type());
  check_rows(x_q, "x_q");
  check_k(x_q.size(1), "x_q");
  return scaled_mm(x_q, at::Tensor(), WeightOperand(w, x_q.size(1)), at::kInt);
}

// The epilogue of int8_scaled_mm on int32 accumulators [M, N] computed elsewhere (int8_mm, then summed): same bits.
at::Tensor scale_accumulators_op(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                                 const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype) {
  check_cpu(acc, "acc");
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kInt, "acc: dtype must be int32, got ", acc.scalar_type());
  check_rows(acc, "acc");
  const int64_t m = acc.size(0), n = acc.size(1);
  const FloatKind out_kind = float_kind(out_dtype.value_or(at::kFloat), "out_dtype");
  const at::Tensor xs = checked_scales(x_scale, m, "x_scale", "row of acc");
  const at::Tensor ws = checked_scales(w_scale, n, "w_scale", "output channel");
  check_finite_weight_side(ws, "w_scale");
  const at::Tensor b = checked_bias(bias, n);
  auto out = at::empty({m, n}, acc.options().dtype(out_dtype.value_or(at::kFloat)));
  const at::Tensor acc_rows = aligned(acc);  // (a copy keeps acc's row stride only when it is contiguous)
  scale_accumulators(acc_rows.data_ptr<int32_t>(), m, n, acc_rows.stride(0),
                     epilogue(xs.data_ptr<float>(), ws, b, out, out_kind), torch_parallel_for());
  return out;
}

at::Tensor int8_scaled_mm_op(const at::Tensor& x_q, const at::Tensor& w, const at::Tensor& x_scale,
                             const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             c10::optional<at::ScalarType> out_dtype) {
  check_cpu(x_q, "x_q");
  TORCH_CHECK_VALUE(x_q.scalar_type() == at::kChar, "x_q: dtype must be int8, got ", x_q.scalar_type());
  check_rows(x_q, "x_q");
  check_k(x_q.size(1), "x_q");
  const at::Tensor xs = checked_scales(x_scale, x_q.size(0), "x_scale", "row of x_q");
  return scaled_mm(x_q, xs, WeightOperand(w, x_q.size(1), w_scale, bias), out_dtype.value_or(at::kFloat));
}

// The fused linear ops: per-token quantization of x [..., K] and one GEMM with the weight; gated (SwiGLU's gate/up
// projection, w holding gate rows then up rows): silu(gate) * up, [..., N / 2].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype,
                            const c10::optional<at::Tensor>& amax, bool gated) {
  const at::Tensor rows = activation_rows(x);
  const FloatKind kind = float_kind(rows.scalar_type(), "x");
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  const FloatKind out_kind = float_kind(dtype, "out_dtype");
  const MicroKernel& kernel = active_kernel();
  const WeightOperand weight(w, rows.size(1), w_scale, bias);
  const int64_t m = rows.size(0);
  TORCH_CHECK_VALUE(!gated || weight.n() % 2 == 0, "w: the gated linear needs an even number of output channels "
                    "(gate rows, then up rows), got N = ", weight.n());
  const int64_t n = gated ? weight.n() / 2 : weight.n();
  const at::Tensor row_amax = checked_amax(amax, m);
  auto out = at::empty({m, n}, rows.options().dtype(dtype));
  if (m > 0) {
    // Scratch: the per-row scales (a whole number of cache lines), then the driver's.
    const int64_t scales_bytes = round_up(4 * m, 64);
    const PackedWeightHeader& shape = weight.view.header;
    const int64_t groups = weight.view.int4() ? weight.view.groups : 0;  // the activations' int4 group sums
    const int64_t driver_bytes = gated
                                     ? gated_linear_scratch_nbytes(kernel, m, shape.k, shape.k_padded, shape.n, groups)
                                     : linear_scratch_nbytes(kernel, m, shape.k, shape.k_padded, groups);
    const at::Tensor scratch = scratch_buffer(scales_bytes + driver_bytes);
    auto* base = static_cast<uint8_t*>(scratch.data_ptr());
    const int64_t bad = as_value_errors([&] {
      const auto run = gated ? gated_linear : linear;
      return run(kernel, rows.data_ptr(), kind, m, rows.stride(0),
                 row_amax.defined() ? row_amax.data_ptr<float>() : nullptr, weight.view,
                 epilogue(nullptr, weight.scales, weight.bias, out, out_kind), reinterpret_cast<float*>(base),
                 base + scales_bytes, torch_parallel_for());
    });
    check_finite_rows(bad, "x");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

at::Tensor int8_scaled_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::optional<at::ScalarType> out_dtype, const c10::optional<at::Tensor>& amax) {
  return quantized_linear(x, w, w_scale, bias, out_dtype, amax, false);
}

at::Tensor int8_gated_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                       const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype) {
  return quantized_linear(x, w, w_scale, bias, out_dtype, c10::nullopt, true);
}

// ---- the layer ops (layer_ops.h): rows of x [..., N], one row per task of at::parallel_for -------------------

// x [..., N] for a layer op: a CPU float tensor, contiguous (read as rows, or written in place); returns N.
int64_t layer_row_length(const at::Tensor& x, const char* arg, int64_t max_n) {
  check_cpu(x, arg);
  float_kind(x.scalar_type(), arg);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, arg, ": expected a tensor [..., N] with N > 0, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), arg, ": must be contiguous, got strides ", x.strides(),
                    "; call .contiguous() first");
  TORCH_CHECK_VALUE(x.size(-1) <= max_n, arg, ": last dimension ", x.size(-1), " exceeds ", max_n,
                    ", the longest row the layer ops take");
  return x.size(-1);
}

// Rows [0, m) of n elements each through body(r), in chunks of about 16384 elements (decode's single row: inline).
void for_each_row(int64_t m, int64_t n, const std::function<void(int64_t)>& body) {
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) body(r);
  });
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  const int64_t n = layer_row_length(x, "x", kMaxNormRow);
  if (delta) {
    layer_row_length(*delta, "delta", kMaxNormRow);
    TORCH_CHECK_VALUE(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                      "delta: expected the shape and dtype of x, ", x.sizes(), " ", x.scalar_type(), ", got ",
                      delta->sizes(), " ", delta->scalar_type());
    // x is written row by row while delta is read: delta may be x itself, not a shifted view of it
    TORCH_CHECK_VALUE(at::get_overlap_status(x, *delta) != at::MemOverlapStatus::Partial,
                      "delta: overlaps x in part (x is updated in place); pass a copy");
  }
  check_cpu(weight, "weight");
  float_kind(weight.scalar_type(), "weight");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == n, "weight: expected shape [", n,
                    "] (the last dimension of x), got ", weight.sizes());
  // A contiguous fp32 weight is read in place, by every thread, while the rows of x are written: one overlapping x
  // gave outputs that depended on the thread count. (Any other weight is copied to fp32 first: no overlap possible;
  // for it get_overlap_status would also answer TooHard.)
  TORCH_CHECK_VALUE(!delta || weight.scalar_type() != at::kFloat || !weight.is_contiguous() ||
                        at::get_overlap_status(x, weight) == at::MemOverlapStatus::No,
                    "weight: overlaps x (x is updated in place); pass a copy");
  TORCH_CHECK_VALUE(eps >= 0 && eps <= std::numeric_limits<float>::max(), "eps: expected a finite float32 value >= 0, "
                    "got ", eps);
  const at::Tensor w = aligned(weight.to(at::kFloat).contiguous());
  const at::Tensor xs = aligned(x), ds = delta ? aligned(*delta) : at::Tensor();
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  const int64_t bytes = element_bytes(kind);
  auto out = at::empty_like(xs);
  const auto* src = static_cast<const char*>(xs.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for_each_row(xs.numel() / n, n, [&](int64_t r) {
    const int64_t at = r * n * bytes;
    const bool add = delta != nullptr;
    rms_norm_row(src + at, add ? static_cast<const char*>(ds.data_ptr()) + at : nullptr,
                 add ? const_cast<char*>(src) + at : nullptr, kind, w.data_ptr<float>(), static_cast<float>(eps), n,
                 dst + at);
  });
  if (delta && !xs.is_same(x)) x.copy_(xs);  // x was not aligned: the sums went to the copy
  return out;
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_rows(x, nullptr, weight, eps);
}

// x += delta (in place: the residual stream), then RMSNorm of the sum.
at::Tensor add_rms_norm_op(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return rms_norm_rows(x, &delta, weight, eps);
}

void rotary_embedding_op(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t n = layer_row_length(x, "x", std::numeric_limits<int64_t>::max());
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}}) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous(), arg, ": expected a contiguous [positions, head_dim] "
                      "tensor, got shape ", t.sizes(), " and strides ", t.strides());
  }
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "sin: expected the shape of cos, ", cos.sizes(), ", got ",
                    sin.sizes());
  const int64_t positions = cos.size(0), d = cos.size(1);
  TORCH_CHECK_VALUE(d >= 2 && d % 2 == 0 && d <= kMaxHeadDim, "cos: head_dim (dim 1) must be even and in [2, ",
                    kMaxHeadDim, "], got ", d);
  TORCH_CHECK_VALUE(positions == x.numel() / n, "cos: expected one row per row of x (", x.numel() / n,
                    " positions), got ", positions);
  TORCH_CHECK_VALUE(heads >= 1 && heads <= n / d, "heads: expected 1 <= heads <= ", n / d, " (heads of ", d,
                    " in a row of ", n, "), got ", heads);
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}})
    TORCH_CHECK_VALUE(at::get_overlap_status(x, t) == at::MemOverlapStatus::No, arg,
                      ": overlaps x (x is rotated in place); pass a copy");
  const at::Tensor c = aligned(cos), s = aligned(sin);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % x.element_size() == 0,
                    "x: data must be aligned to its element size (rotated in place)");
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  auto* rows = static_cast<char*>(x.data_ptr());
  for_each_row(positions, heads * d, [&](int64_t r) {
    rotary_row(rows + r * n * element_bytes(kind), kind, heads, d, c.data_ptr<float>() + r * d,
               s.data_ptr<float>() + r * d);
  });
}

// Query positions per block of causal_attention: a block's scores [positions x query heads of a KV head, keys] stay in
// L2 (64 KiB a position group at 512 keys).
constexpr int64_t kAttentionBlock = 32;

// A [rows, cols] fp32 matrix over raw memory with row stride ld (the attention's blocks, views for at::mm_out).
at::Tensor float_matrix(const float* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(data), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// Causal self-attention of a prompt: q [T, heads, d] (positions 0..T-1), k and v [kv_heads, T, d]; returns
// out [T, heads, d] = softmax(scale q k^T, causal) v per head, the query heads of one KV head sharing it (grouped-
// query attention). Tasks are (KV head, pair of query blocks), a block of positions with the keys up to its last
// position only: about half the work of a masked T x T product, and every task (block b with block B-1-b; the middle
// block alone when B is odd) the same size, so at::parallel_for's equal split of the tasks balances the threads. Its
// GEMMs run inside the parallel region, one thread each, so the bits do not depend on the thread count; a prompt
// that is a single task (one KV head, at most 64 positions) runs on the calling thread, whose at::mm may use
// torch's intra-op threads. Each block: its query rows (scaled) into a contiguous copy, the scores by at::mm (torch's
// fp32 GEMM), the causal softmax's numerators on them in place, at::mm with V, each output row divided by its
// row's softmax sum.
at::Tensor causal_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(2) > 0 && t.stride(2) == 1 && t.stride(1) == t.size(2), arg,
                      ": expected [", std::string(arg) == "q" ? "positions, heads" : "kv_heads, positions",
                      ", head_dim] with contiguous heads (strides [any, head_dim, 1]), got shape ", t.sizes(),
                      " and strides ", t.strides());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, arg, ": data must be aligned to 4 bytes");
  }
  const int64_t positions = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "v: expected the shape of k, ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK_VALUE(k.size(1) == positions && k.size(2) == d, "k: expected [kv_heads, ", positions, ", ", d,
                    "] (q's positions and head_dim), got ", k.sizes());
  TORCH_CHECK_VALUE(heads > 0, "q: expected at least one head, got shape ", q.sizes());
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0, "k: kv_heads (dim 0) must divide q's ", heads,
                    " heads, got ", kv_heads);
  TORCH_CHECK_VALUE(std::fabs(scale) <= std::numeric_limits<float>::max(), "scale: expected a finite float32 value, "
                    "got ", scale);
  auto out = at::empty({positions, heads, d}, q.options());
  const int64_t group = heads / kv_heads, blocks = (positions + kAttentionBlock - 1) / kAttentionBlock;
  const int64_t pairs = (blocks + 1) / 2, rows_max = kAttentionBlock * group;
  const auto* qp = q.data_ptr<float>();
  auto* op = out.data_ptr<float>();
  const MicroKernel& kernel = active_kernel();
  at::parallel_for(0, kv_heads * pairs, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> query(rows_max * d), scores(rows_max * positions), result(rows_max * d), sums(rows_max);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t g = task / pairs, pair = task % pairs;
      const float* kg = k.data_ptr<float>() + g * k.stride(0);
      const float* vg = v.data_ptr<float>() + g * v.stride(0);
      const int64_t pair_blocks[2] = {pair, blocks - 1 - pair};  // one block when blocks is odd: the middle one
      for (int which = 0; which < (pair_blocks[0] == pair_blocks[1] ? 1 : 2); ++which) {
        const int64_t b = pair_blocks[which];
        const int64_t p0 = b * kAttentionBlock, count = std::min(kAttentionBlock, positions - p0);
        const int64_t keys = p0 + count, rows = count * group;
        // row (i, j): position p0 + i, query head g * group + j
        for (int64_t i = 0; i < count; ++i) {
          const float* src = qp + (p0 + i) * q.stride(0) + g * group * d;
          for (int64_t e = 0; e < group * d; ++e) query[i * group * d + e] = src[e] * static_cast<float>(scale);
        }
        at::Tensor s = float_matrix(scores.data(), rows, keys, keys);
        at::mm_out(s, float_matrix(query.data(), rows, d, d), float_matrix(kg, keys, d, d).t());
        for (int64_t r = 0; r < rows; ++r)
          sums[r] = softmax_numerators(kernel, scores.data() + r * keys, p0 + r / group + 1, keys);
        at::Tensor o = float_matrix(result.data(), rows, d, d);
        at::mm_out(o, s, float_matrix(vg, keys, d, d));
        // row r (position p0 + r / group, head g * group + r % group) divided by its softmax sum
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.f / sums[r];
          float* dst = op + ((p0 + r / group) * heads + g * group + r % group) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = result[r * d + e] * inv;
        }
      }
    }
  });
  return out;
}

// Work (key x head_dim multiply-adds) per task of decode_attention: a short cache's heads run on the calling thread
// (at::parallel_for's start costs more than their arithmetic).
constexpr int64_t kDecodeAttentionGrain = 1 << 15;

// One decode step's attention, the position after those cached: qkv [heads + 2 kv_heads, d] is this position's query
// heads (rotated), key heads (rotated) and value heads, as the fused q/k/v GEMM and the rotary op leave them; k_cache and
// v_cache [kv_heads, length, d]. Writes the key and value heads at `position` of the caches, then returns out
// [heads, d]: per query head h, softmax(scale q_h . k[0..position]) v[0..position] of KV head h / (heads / kv_heads)
// (grouped-query attention), attend_one_position's bits. One call instead of the cache writes, views and
// scaled_dot_product_attention of a Python step (~40 us a layer at SmolLM2's size, ~7% of its decode).
at::Tensor decode_attention_op(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t position,
                               int64_t heads, double scale) {
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{qkv, "qkv"}, {k_cache, "k_cache"},
                               {v_cache, "v_cache"}}) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() > 0, arg, ": expected a non-empty contiguous tensor, got shape ",
                      t.sizes(), " and strides ", t.strides());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, arg, ": data must be aligned to 4 bytes");
  }
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.size(2) <= kMaxHeadDim, "k_cache: expected [kv_heads, length, "
                    "head_dim] with head_dim <= ", kMaxHeadDim, ", got shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache: expected the shape of k_cache, ", k_cache.sizes(),
                    ", got ", v_cache.sizes());
  const int64_t kv_heads = k_cache.size(0), length = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK_VALUE(heads >= 1 && heads % kv_heads == 0 && heads <= std::numeric_limits<int32_t>::max(),
                    "heads: expected a positive multiple of the caches' ", kv_heads, " KV heads, got ", heads);
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.size(0) == heads + 2 * kv_heads && qkv.size(1) == d, "qkv: expected [",
                    heads + 2 * kv_heads, ", ", d, "] (", heads, " query, ", kv_heads, " key and ", kv_heads,
                    " value heads of the caches' head_dim), got ", qkv.sizes());
  TORCH_CHECK_VALUE(position >= 0 && position < length, "position: expected 0 <= position < ", length,
                    " (the caches' length), got ", position);
  TORCH_CHECK_VALUE(std::fabs(scale) <= std::numeric_limits<float>::max(), "scale: expected a finite float32 value, "
                    "got ", scale);
  TORCH_CHECK_VALUE(at::get_overlap_status(k_cache, v_cache) == at::MemOverlapStatus::No &&
                    at::get_overlap_status(qkv, k_cache) == at::MemOverlapStatus::No &&
                    at::get_overlap_status(qkv, v_cache) == at::MemOverlapStatus::No,
                    "k_cache, v_cache: must not overlap each other or qkv (the caches are written in place)");
  const float* rows = qkv.data_ptr<float>();
  float* keys_of = k_cache.data_ptr<float>();
  float* values_of = v_cache.data_ptr<float>();
  const size_t head_bytes = static_cast<size_t>(d) * 4;
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::memcpy(keys_of + (g * length + position) * d, rows + (heads + g) * d, head_bytes);
    std::memcpy(values_of + (g * length + position) * d, rows + (heads + kv_heads + g) * d, head_bytes);
  }
  auto out = at::empty({heads, d}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t keys = position + 1, group = heads / kv_heads;
  const MicroKernel& kernel = active_kernel();
  at::parallel_for(0, heads, std::max<int64_t>(1, kDecodeAttentionGrain / (keys * d)), [&](int64_t h0, int64_t h1) {
    std::vector<float> scores(keys);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / group;
      attend_one_position(kernel, rows + h * d, keys_of + g * length * d, values_of + g * length * d, keys, d,
                          static_cast<float>(scale), scores.data(), op + h * d);
    }
  });
  return out;
}

// The weights of one layer in decode_step_'s `weights`, in this order (biases may be None); the final norm's weight
// follows the last layer's.
enum DecodeStepWeight : int64_t {
  kInputNorm, kQkv, kQkvScale, kQkvBias, kOut, kOutScale, kOutBias, kPostNorm, kGateUp, kGateUpScale, kGateUpBias,
  kDown, kDownScale, kDownBias, kWeightsPerLayer
};

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
                          int64_t heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers,
                    "v_caches: expected one cache per layer of k_caches (", layers, "), got ", v_caches.size());
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
      // (kv_heads bounded before heads + kv_heads below; decode_attention_op checks the rest of both caches)
      TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.numel() > 0 &&
                            k_cache.size(0) <= std::numeric_limits<int32_t>::max() && k_cache.is_contiguous() &&
                            v_cache.is_contiguous(),
                        "expected contiguous, non-empty caches [kv_heads, length, head_dim] (kv_heads < 2^31), got "
                        "k_cache of shape ", k_cache.sizes(), " and strides ", k_cache.strides());
      // h is updated in place while the caches are written: an h inside one would take the cache's writes
      TORCH_CHECK_VALUE(at::get_overlap_status(h, k_cache) == at::MemOverlapStatus::No &&
                            at::get_overlap_status(h, v_cache) == at::MemOverlapStatus::No,
                        "h: overlaps the layer's k_cache or v_cache (written in place); pass a copy");
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
      const at::Tensor attention = decode_attention_op(qkv.view({-1, d}), k_cache, v_cache, position, heads, scale);
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

// Per-expert packed views of an MoE weight: raw int8 [E, n, k] (packed here into `storage` for this call)
// or the output of pack_moe_weights / pack_experts_int4, uint8 [E, bytes] with one packed blob per expert (int8 or
// int4 weights; the driver checks that the experts share one format).
std::vector<PackedWeightView> expert_views(const at::Tensor& w, int64_t experts, int64_t n, int64_t k, const char* arg,
                                           at::Tensor& storage) {
  check_cpu(w, arg);
  const bool raw = w.scalar_type() == at::kChar;  // packed here for this call, else packed by the caller
  if (raw) {
    TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == experts && w.size(1) == n && w.size(2) == k, arg,
                      ": expected a raw int8 weight of shape [", experts, ", ", n, ", ", k, "], got ", w.sizes());
    const MicroKernel& kernel = active_kernel();
    const at::Tensor wc = w.contiguous();
    const int64_t nbytes = as_value_errors([&] { return packed_weight_nbytes(n, k, kernel.geometry().layout, arg); });
    storage = at::empty({experts, nbytes}, w.options().dtype(at::kByte));
    for (int64_t e = 0; e < experts; ++e)
      pack_weight(kernel, wc.data_ptr<int8_t>() + e * n * k, n, k, k, storage.data_ptr<uint8_t>() + e * nbytes,
                  torch_parallel_for());
  } else {
    TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) == experts, arg,
                      ": expected a raw int8 [", experts, ", ", n, ", ", k,
                      "] weight or packed experts (uint8 [E, bytes] from pack_moe_weights or pack_experts_int4), "
                      "got dtype ",
                      w.scalar_type(), " and shape ", w.sizes());
    TORCH_CHECK_VALUE(w.is_contiguous(), arg, ": packed experts must be contiguous");
    storage = w;
  }
  std::vector<PackedWeightView> views;
  for (int64_t e = 0; e < experts; ++e) {
    views.push_back(as_value_errors([&] {
      return view_packed_weight(storage.data_ptr<uint8_t>() + e * storage.size(1), storage.size(1), arg);
    }));
    const PackedWeightHeader& h = views.back().header;
    TORCH_CHECK_VALUE(h.n == n && h.k == k, arg, ": expert ", e, " was packed with shape [", h.n, ", ", h.k,
                      "], expected [", n, ", ", k, "]");
    // The driver packs A once for all experts, so every expert must share one panel layout.
    TORCH_CHECK_VALUE(views.back().layout.nr == views[0].layout.nr && views.back().layout.kr == views[0].layout.kr,
                      arg, ": expert ", e, " was packed by '", packed_by_name(h), "', expert 0 by '",
                      packed_by_name(views[0].header), "'; pack all experts with one variant");
  }
  if (!raw)  // verified once per tensor version, like a packed linear weight
    as_value_errors([&] {
      verified_blobs().ensure(w, [&] {
        for (int64_t e = 0; e < experts; ++e)
          verify_packed_weight(views[e], (std::string(arg) + " (expert " + std::to_string(e) + ")").c_str());
      });
      return 0;
    });
  return views;
}

// [E, rows] or [E, rows, 1] fp32 scales; returns rows.
at::Tensor checked_expert_scales(const at::Tensor& s, const char* arg) {
  check_cpu(s, arg);
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() == 2 || (s.dim() == 3 && s.size(2) == 1), arg,
                    ": expected shape [E, N] or [E, N, 1], got ", s.sizes());
  return aligned(s.reshape({s.size(0), s.size(1)}).contiguous());
}

at::Tensor fused_experts_op(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids, const at::Tensor& w13_scale,
                            const at::Tensor& w2_scale, c10::string_view activation,
                            bool apply_router_weight_on_input) {
  TORCH_CHECK_VALUE(activation == "silu", "activation: only 'silu' is supported, got '", std::string(activation), "'");
  check_cpu(hidden, "hidden");
  const FloatKind kind = float_kind(hidden.scalar_type(), "hidden");
  check_rows(hidden, "hidden");
  const int64_t m = hidden.size(0), h = hidden.size(1);
  check_k(h, "hidden");
  const at::Tensor s13 = checked_expert_scales(w13_scale, "w13_scale");
  const at::Tensor s2 = checked_expert_scales(w2_scale, "w2_scale");
  check_finite_weight_side(s13, "w13_scale");
  check_finite_weight_side(s2, "w2_scale");
  const int64_t experts = s13.size(0), inter2 = s13.size(1);
  TORCH_CHECK_VALUE(experts > 0, "w13_scale: number of experts (dim 0) must be > 0");
  TORCH_CHECK_VALUE(inter2 > 0 && inter2 % 2 == 0, "w13_scale: dim 1 must be 2 * intermediate size (gate rows then "
                    "up rows), got ", inter2);
  TORCH_CHECK_VALUE(s2.size(0) == experts && s2.size(1) == h, "w2_scale: expected shape [", experts, ", ", h,
                    "] (experts x hidden size), got ", w2_scale.sizes());
  check_k(inter2 / 2, "w2");
  check_cpu(topk_ids, "topk_ids");
  TORCH_CHECK_VALUE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
                    "topk_ids: dtype must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == m, "topk_ids: expected shape [", m,
                    ", topk], got ", topk_ids.sizes());
  const int64_t topk = topk_ids.size(1);
  TORCH_CHECK_VALUE(topk > 0, "topk_ids: topk (dim 1) must be > 0");
  check_cpu(topk_weights, "topk_weights");
  float_kind(topk_weights.scalar_type(), "topk_weights");
  TORCH_CHECK_VALUE(topk_weights.dim() == 2 && topk_weights.size(0) == m && topk_weights.size(1) == topk,
                    "topk_weights: expected shape [", m, ", ", topk, "] like topk_ids, got ", topk_weights.sizes());
  at::Tensor w13_storage, w2_storage;
  const std::vector<PackedWeightView> v13 = expert_views(w13, experts, inter2, h, "w13", w13_storage);
  const std::vector<PackedWeightView> v2 = expert_views(w2, experts, h, inter2 / 2, "w2", w2_storage);

  auto out = at::empty({m, h}, hidden.options());
  if (m == 0) return out;
  at::Tensor x = aligned(hidden), weights = aligned(topk_weights.to(at::kFloat).contiguous());
  if (apply_router_weight_on_input) {
    // The router weight scales the expert's input instead of its output (sglang's convention: topk == 1).
    TORCH_CHECK_VALUE(topk == 1, "apply_router_weight_on_input: requires topk == 1, got topk = ", topk);
    x = hidden.to(at::kFloat) * weights;
    weights = at::ones_like(weights);
  }
  const at::Tensor ids = aligned(topk_ids.to(at::kLong).contiguous());
  const MicroKernel& kernel = active_kernel();
  MoeProblem p{m, h, inter2 / 2, experts, topk, x.data_ptr(), float_kind(x.scalar_type(), "hidden"), x.stride(0),
               weights.data_ptr<float>(), ids.data_ptr<int64_t>(), v13.data(), s13.data_ptr<float>(), v2.data(),
               s2.data_ptr<float>(), out.data_ptr(), kind, reject_non_finite()};
  as_value_errors([&] {
    fused_experts(kernel, p, scratch_buffer(moe_scratch_nbytes(kernel, p)).data_ptr(), torch_parallel_for());
    return 0;
  });
  return out;
}

std::string json_list(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", \"" : "\"") + items[i] + "\"";
  return s + "]";
}

// Build and CPU facts as JSON; w8a8_cpu.info() adds the Python-side ones.
std::string info_op() {
  std::vector<std::string> compiled, runnable;
  for (const MicroKernel* k : compiled_kernels()) {
    compiled.emplace_back(k->name);
    if (cpu_supports(*k)) runnable.emplace_back(k->name);
  }
  const MicroKernel& active = as_value_errors([]() -> const MicroKernel& { return active_kernel(); });
  std::ostringstream s;
  s << "{\"arch\": \"" << target_arch() << "\", \"features\": " << json_list(feature_names(cpu_features()))
    << ", \"compiled_variants\": " << json_list(compiled) << ", \"runnable_variants\": " << json_list(runnable)
    << ", \"selected_variant\": \"" << active.name << "\", \"panel_width\": " << active.geometry().layout.nr
    << ", \"panel_depth\": " << active.geometry().layout.kr << "}";
  return s.str();
}

std::string set_variant_op(const std::string& name) {
  return as_value_errors([&] { return set_thread_kernel(name); });
}

}  // namespace
}  // namespace w8a8_cpu

TORCH_LIBRARY(w8a8_cpu, m) {
  m.def("per_token_quant_int8(Tensor x, Tensor? amax=None) -> (Tensor, Tensor)");
  m.def("int8_mm(Tensor x_q, Tensor w) -> Tensor");
  m.def(
      "scale_accumulators(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias=None, ScalarType? out_dtype=None) "
      "-> Tensor");
  m.def(
      "int8_scaled_mm(Tensor x_q, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "int8_scaled_mm_with_quant(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, "
      "ScalarType? out_dtype=None, Tensor? amax=None) -> Tensor");
  m.def(
      "int8_gated_mm_with_quant(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, ScalarType? out_dtype=None) "
      "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("decode_attention_(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, int position, int heads, float scale) "
        "-> Tensor");
  m.def("decode_step_(Tensor(a!) h, Tensor?[] weights, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor cos, "
        "Tensor sin, int position, int heads, float scale, float eps) -> Tensor");
  m.def("pack_weight(Tensor w) -> Tensor");
  m.def("pack_weight_int4(Tensor q, Tensor scale, Tensor? minimum=None, int group_size=0, bool half_scales=False) "
        "-> Tensor");
  m.def(
      "fused_experts(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor w13_scale, "
      "Tensor w2_scale, str activation='silu', bool apply_router_weight_on_input=False) -> Tensor");
  m.def("_verify_packed_weight(Tensor blob) -> ()");
  m.def("_info() -> str", &w8a8_cpu::info_op);
  m.def("_set_variant(str name) -> str", &w8a8_cpu::set_variant_op);
}

TORCH_LIBRARY_IMPL(w8a8_cpu, CPU, m) {
  m.impl("per_token_quant_int8", &w8a8_cpu::per_token_quant_int8_op);
  m.impl("int8_mm", &w8a8_cpu::int8_mm_op);
  m.impl("scale_accumulators", &w8a8_cpu::scale_accumulators_op);
  m.impl("int8_scaled_mm", &w8a8_cpu::int8_scaled_mm_op);
  m.impl("int8_scaled_mm_with_quant", &w8a8_cpu::int8_scaled_mm_with_quant_op);
  m.impl("int8_gated_mm_with_quant", &w8a8_cpu::int8_gated_mm_with_quant_op);
  m.impl("rms_norm", &w8a8_cpu::rms_norm_op);
  m.impl("add_rms_norm_", &w8a8_cpu::add_rms_norm_op);
  m.impl("rotary_embedding_", &w8a8_cpu::rotary_embedding_op);
  m.impl("causal_attention", &w8a8_cpu::causal_attention_op);
  m.impl("decode_attention_", &w8a8_cpu::decode_attention_op);
  m.impl("decode_step_", &w8a8_cpu::decode_step_op);
  m.impl("pack_weight", &w8a8_cpu::pack_weight_op);
  m.impl("pack_weight_int4", &w8a8_cpu::pack_weight_int4_op);
  m.impl("fused_experts", &w8a8_cpu::fused_experts_op);
  m.impl("_verify_packed_weight", &w8a8_cpu::verify_packed_weight_op);
}
