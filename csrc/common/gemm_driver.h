// The one W8A8 driver, written over the MicroKernel interface: per-token quantization, weight packing,
// and the blocked GEMM with the fp32 epilogue. No torch: the caller allocates and provides parallelism.
#pragma once

#include <cstdint>
#include <functional>

#include "microkernel.h"

namespace w8a8_cpu {

// parallel_for(begin, end, grain, body): calls body(b, e) on disjoint sub-ranges covering [begin, end),
// possibly concurrently; ranges of at most `grain` items run inline. Results never depend on the split.
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body)>;
void serial_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// amax is clamped to this before scale = amax / 127, so an all-zero row quantizes to zeros.
constexpr float kAmaxEps = 1e-10f;

// Packed weight blob: a 64-byte header, then n_padded / nr panels of k_padded * nr int8 (see PanelLayout),
// then n_padded int32 per-channel weight sums. Self-describing, so ops tell it apart from a raw weight
// and check it against the variant that reads it.
struct PackedWeightHeader {
  char magic[8];  // kPackedMagic
  uint32_t version;
  uint16_t nr, kr;
  int64_t n, k, n_padded, k_padded;
  char packed_by[16];  // variant name, for error messages
};
static_assert(sizeof(PackedWeightHeader) == 64, "header must stay 64 bytes");
constexpr char kPackedMagic[8] = {'W', '8', 'A', '8', 'P', 'K', 'W', '\0'};
constexpr uint32_t kPackedVersion = 2;

struct PackedWeightView {
  const PackedWeightHeader* header;
  PanelLayout layout;
  const int8_t* panels;
  const int32_t* col_sums;
};

int64_t packed_weight_nbytes(int64_t n, int64_t k, PanelLayout layout);
// Packs w (int8 [n, k], rows ldw apart) for `kernel` into blob (packed_weight_nbytes bytes).
void pack_weight(const MicroKernel& kernel, const int8_t* w, int64_t n, int64_t k, int64_t ldw, uint8_t* blob,
                 const ParallelFor& parallel_for);
// Validates a blob of nbytes bytes; throws std::invalid_argument naming `arg` if it is not a packed weight.
PackedWeightView view_packed_weight(const uint8_t* blob, int64_t nbytes, const char* arg);
// Whether `kernel` can read weights packed in `layout`.
bool kernel_reads_layout(const MicroKernel& kernel, PanelLayout layout);

// Per-token symmetric quantization of x [m, k] (rows ldx elements apart) into q (rows ldq apart) and
// scales [m]: scale = max(amax, kAmaxEps) / 127, q = clamp(round_half_even(x * (127 / amax)), -127, 127).
// Returns the first row holding NaN or Inf (left unquantized), or -1 when all rows are finite.
int64_t quantize_rows(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t k, int64_t ldx,
                      int8_t* q, int64_t ldq, float* scales, const ParallelFor& parallel_for);

// Throws std::invalid_argument naming `arg` unless `kernel` reads w's layout.
void check_kernel_reads(const MicroKernel& kernel, const PackedWeightView& w, const char* arg);

// A rows packed for `kernel` (pack_a_row) lie packed_a_stride bytes apart.
int64_t packed_a_stride(const MicroKernel& kernel, int64_t k_padded);
void pack_a_rows(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, int64_t k, int64_t k_padded,
                 uint8_t* dst, const ParallelFor& parallel_for);

// The unit of work of every driver: rows [r0, r1) of packed A times one weight panel, through the tile
// and the fp32 epilogue out[r, n] = float(acc) * (a_scales[r] * w_scales[n]) (+ bias[n]), into out
// (rows ldo elements apart, out_kind). The caller has checked check_kernel_reads.
void compute_panel_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const float* a_scales, const PackedWeightView& w, int64_t panel, const float* w_scales,
                        const float* bias, void* out, FloatKind out_kind, int64_t ldo);

// Scratch bytes gemm() needs for m rows of A with k columns.
int64_t gemm_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k_padded);

// out[i, j] = float(sum_k a[i, k] * w[j, k]) * (a_scales[i] * w_scales[j]) (+ bias[j]), cast once to out_kind.
// a: int8 [m, k] rows lda apart; w packed for a panel width `kernel` reads; bias may be null.
void gemm(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, const float* a_scales,
          const PackedWeightView& w, const float* w_scales, const float* bias, void* out, FloatKind out_kind,
          int64_t ldo, void* scratch, const ParallelFor& parallel_for);

}  // namespace w8a8_cpu
