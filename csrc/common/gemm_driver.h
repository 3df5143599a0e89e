// The one W8A8 driver, written over the MicroKernel interface: per-token quantization, weight packing,
// and the blocked GEMM with the fp32 epilogue. No torch: the caller allocates and provides parallelism.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "microkernel.h"

namespace w8a8_cpu {

// parallel_for(begin, end, grain, body): calls body(b, e) on disjoint sub-ranges covering [begin, end),
// possibly concurrently; ranges of at most `grain` items run inline. Results never depend on the split.
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body)>;
void serial_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// body(t0, t1) over [0, count) in claims of at most `chunk` items, each taken from a shared counter by whichever
// thread of one parallel_for region is free: a thread slowed down (another process on its core) holds up at most its
// current claim instead of a fixed share. Only for bodies whose results do not depend on which thread runs a claim.
void dynamic_for(int64_t count, int64_t chunk, const ParallelFor& parallel_for,
                 const std::function<void(int64_t, int64_t)>& body);

// amax is clamped to this before scale = amax / 127, so an all-zero row quantizes to zeros.
constexpr float kAmaxEps = 1e-10f;

// Packed weight blob: a 64-byte header, then n_padded / nr panels of k_padded * nr int8 (see PanelLayout),
// then n_padded int32 per-channel weight sums, in host (little-endian) byte order. Self-describing, so ops tell
// it apart from a raw weight and check it against the variant that reads it. A blob is untrusted input (it may
// come from a file or another machine): view_packed_weight bounds every header field before it sizes anything,
// verify_packed_weight checks the contents (docs/ARCHITECTURE.md, "Packed weight blob").
struct PackedWeightHeader {
  char magic[8];  // kPackedMagic
  uint32_t version;
  uint16_t nr, kr;
  int64_t n, k, n_padded, k_padded;
  char packed_by[12];  // the packing variant's name for error messages: printable ASCII, NUL-terminated, zero-filled
  uint32_t checksum;   // CRC-32C of the header's first 60 bytes, then of everything after the header
};
static_assert(sizeof(PackedWeightHeader) == 64, "header must stay 64 bytes");
constexpr char kPackedMagic[8] = {'W', '8', 'A', '8', 'P', 'K', 'W', '\0'};
// 3: packed_by shrank to 12 bytes to make room for the checksum. Older versions are rejected ("re-pack").
constexpr uint32_t kPackedVersion = 3;
constexpr int64_t kChecksumOffset = 60;  // offsetof(PackedWeightHeader, checksum)
// Format bounds, checked before any size is computed: nr * mr stays within the driver's 1024-int32 tile for
// mr <= 16; N as in unpack_weight; K as the ops (kMaxK, the int32 accumulation limit).
constexpr int kMaxPanelWidth = 64, kMaxPanelDepth = 64;
constexpr int64_t kMaxPackedN = (int64_t{1} << 31) - 1;

struct PackedWeightView {
  PackedWeightHeader header;  // a copy: the blob may start at any byte address
  PanelLayout layout;
  const uint8_t* blob;
  int64_t nbytes;
  const int8_t* panels;
  const uint8_t* col_sums;  // n_padded int32 at any alignment: read them with load_col_sums
};

// Byte layout of the blob of an [n, k] weight: the one place header fields are turned into sizes. Returns false,
// computing nothing, if n, k or the layout is outside the format bounds or a size would overflow int64.
struct PackedWeightSizes {
  int64_t n_padded, k_padded, col_sums_offset, nbytes;
};
bool packed_weight_sizes(int64_t n, int64_t k, PanelLayout layout, PackedWeightSizes* sizes);
// packed_weight_sizes(...).nbytes; throws std::invalid_argument naming `arg` outside the format bounds.
int64_t packed_weight_nbytes(int64_t n, int64_t k, PanelLayout layout, const char* arg);
// Packs w (int8 [n, k], rows ldw apart) for `kernel` into blob (packed_weight_nbytes bytes), checksum included.
void pack_weight(const MicroKernel& kernel, const int8_t* w, int64_t n, int64_t k, int64_t ldw, uint8_t* blob,
                 const ParallelFor& parallel_for);
// Validates the header of a blob of nbytes bytes (any alignment) against the format bounds and nbytes, O(1);
// throws std::invalid_argument naming `arg` if it is not a packed weight. Reading the view is then memory-safe.
PackedWeightView view_packed_weight(const uint8_t* blob, int64_t nbytes, const char* arg);
// Verifies the contents, one pass over the blob: the checksum, the channel sums (the VNNI / ppc64 tiles trust
// them) and zero padding. Throws std::invalid_argument naming `arg`. Run once per blob that comes from outside
// before computing with it (the torch binding caches the outcome per tensor version).
void verify_packed_weight(const PackedWeightView& w, const char* arg);
// Channel sums [first, first + count) of w into dst (aligned): the blob's may be at any address.
void load_col_sums(const PackedWeightView& w, int64_t first, int64_t count, int32_t* dst);
// The packing variant's name, never reading past the field (a corrupted blob's may lack its NUL).
std::string packed_by_name(const PackedWeightHeader& h);
// Whether `kernel` can read weights packed in `layout`.
bool kernel_reads_layout(const MicroKernel& kernel, PanelLayout layout);

// CRC-32C (Castagnoli; reflected, init and final xor 0xffffffff) of n bytes, continuing from crc (0 to start).
// Identical on every arch (blobs travel): SSE4.2 crc32 where the CPU has it, else a portable table.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);
// The checksum a blob of nbytes bytes (nbytes >= 64) should carry.
uint32_t packed_weight_checksum(const uint8_t* blob, int64_t nbytes);

// Per-token symmetric quantization of x [m, k] (rows ldx elements apart) into q (rows ldq apart) and
// scales [m]: scale = max(amax, kAmaxEps) / 127, q = clamp(round_half_even(x * (127 / amax)), -127, 127).
// A row holding NaN or Inf gets scale NaN and q all 0, so every product with it is NaN: like nn.Linear, a non-finite
// activation row gives a non-finite output row and leaves the other rows exact (one bad request must not fail a
// whole batch). Returns the first such row (callers in strict mode reject it), or -1 when all rows are finite.
// row_amax (may be null): each row's absmax to quantize with instead of its own, e.g. the maximum over the ranks that
// hold slices of one row (>= the slice's own absmax, finite; NaN/Inf mark the row non-finite as above).
int64_t quantize_rows(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t k, int64_t ldx,
                      int8_t* q, int64_t ldq, float* scales, const ParallelFor& parallel_for,
                      const float* row_amax = nullptr);

// Throws std::invalid_argument naming `arg` unless `kernel` reads w's layout.
void check_kernel_reads(const MicroKernel& kernel, const PackedWeightView& w, const char* arg);

// A rows packed for `kernel` (pack_a_row) lie packed_a_stride bytes apart.
int64_t packed_a_stride(const MicroKernel& kernel, int64_t k_padded);
void pack_a_rows(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, int64_t k, int64_t k_padded,
                 uint8_t* dst, const ParallelFor& parallel_for);

// What a GEMM writes: the fp32 epilogue out[r, n] = float(acc) * (a_scales[r] * w_scales[n]) (+ bias[n]) cast once to
// out_kind, rows ldo elements apart; or, with raw_int32, the exact int32 accumulators themselves (scales and bias
// unused), for callers that add partial products before the epilogue (tensor parallelism).
struct GemmOutput {
  const float* a_scales;
  const float* w_scales;
  const float* bias;  // may be null
  void* out;
  FloatKind out_kind;
  int64_t ldo;
  bool raw_int32 = false;
};

// The unit of work of every driver: rows [r0, r1) of packed A times one weight panel, through the tile and the
// epilogue into o. The caller has checked check_kernel_reads.
void compute_panel_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const PackedWeightView& w, int64_t panel, const GemmOutput& o);

// The epilogue alone, for int32 accumulators [m, n] (rows lda apart) summed elsewhere: the same rule, bit for bit.
void scale_accumulators(const int32_t* acc, int64_t m, int64_t n, int64_t lda, const GemmOutput& o,
                        const ParallelFor& parallel_for);

// Scratch bytes gemm() and linear() need for m rows of A with k columns.
int64_t gemm_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k_padded);
int64_t linear_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k, int64_t k_padded);

// o <- a [m, k] (int8, rows lda apart) times w^T: acc[i, j] = sum_k a[i, k] * w[j, k] through the epilogue.
// w packed for a panel width `kernel` reads.
void gemm(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, const PackedWeightView& w,
          const GemmOutput& o, void* scratch, const ParallelFor& parallel_for);

// The linear layer: per-token quantization of x [m, k] (rows ldx apart; row_amax as in quantize_rows, may be null)
// and the GEMM, in at most two parallel regions (one when m * k is small). The per-row scales are written to
// a_scales_out [m] (o.a_scales is ignored). Returns the first non-finite row or -1 (quantize_rows).
int64_t linear(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
               const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out, void* scratch,
               const ParallelFor& parallel_for);

}  // namespace w8a8_cpu
