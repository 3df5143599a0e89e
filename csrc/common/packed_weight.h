// The packed weight format: layout, sizes, packing, and the validation of blobs from outside (untrusted input).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "microkernel.h"
#include "parallel.h"

namespace w8a8_cpu {

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

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

}  // namespace w8a8_cpu
