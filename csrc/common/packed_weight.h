// The packed weight format: layout, sizes, packing, and the validation of blobs from outside (untrusted input).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "microkernel.h"
#include "parallel.h"

namespace w8a8_cpu {

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// What a packed weight's panels hold (PackedWeightHeader::scheme): the weight scheme every layer shares (ops, driver,
// epilogue, modules, checkpoints).
//  int8: int8 weights; the op's w_scale [N] scales each output channel. A panel holds k_padded x nr int8, and one
//        int32 weight sum per channel follows all panels (the biased-A tiles' correction).
//  int4 / int4_min: int4 weights q in [-8, 7] with scales (int4_min: and fp32 minimums) per group of `group`
//        consecutive k of a channel: w = scale * q (+ min) per group, then times the op's w_scale [N] (ones for a
//        plain W4A8 layer). A panel holds the k_padded x nr weights as nibbles u = q + 8, in the int8 panel's element
//        order, 64 elements per 32 bytes (byte i: element i in the low nibble, element i + 32 in the high one; a
//        vector register widens them with a mask and a shift), then the panel's scales [groups][nr] (fp32, or fp16
//        per ScaleStorage) and for int4_min its minimums [groups][nr] (fp32), little-endian, any alignment. K is
//        padded to whole groups (per channel: to a multiple of 32) with q = 0; padded channels have q = 0 and scale
//        and minimum 0.
enum class WeightScheme : uint8_t { int8 = 0, int4 = 1, int4_min = 2 };
// How an int4 blob stores its group scales (PackedWeightHeader::scale_storage). f16 holds the same fp32 values in half
// the bytes, for scales that are fp16 values (pack_weight_int4 refuses one that is not): the arithmetic and its bits
// do not change, only the bytes a decode reads (symmetric groups of 32: 0.5625 of an int8 weight's, not 0.625).
enum class ScaleStorage : uint8_t { f32 = 0, f16 = 1 };
constexpr int64_t kInt4ChunkElements = 64;  // elements per 32 bytes of nibbles (see WeightScheme)

// Packed weight blob: a 64-byte header, then n_padded / nr panels of k_padded * nr weights (see PanelLayout; int8
// bytes, or int4 nibbles), then for int8 n_padded int32 per-channel weight sums, in host (little-endian) byte
// order. Self-describing, so ops tell it apart from a raw weight and check it against the variant that reads it. A
// blob is untrusted input (it may come from a file or another machine): view_packed_weight bounds every header field
// before it sizes anything, verify_packed_weight checks the contents (docs/ARCHITECTURE.md, "Packed weight blob").
struct PackedWeightHeader {
  char magic[8];  // kPackedMagic
  uint16_t version;
  uint8_t scale_storage;  // int4: ScaleStorage; int8: 0
  uint8_t reserved;       // 0
  uint8_t nr, kr;
  uint8_t scheme;      // WeightScheme
  uint8_t group_log2;  // int4: k per scale group = 2^group_log2 (kMinGroupLog2..kMaxGroupLog2), or 0: one group of
                       // k_padded (per channel); int8: 0
  int64_t n, k, n_padded, k_padded;
  char packed_by[12];  // the packing variant's name for error messages: printable ASCII, NUL-terminated, zero-filled
  uint32_t checksum;   // CRC-32C of the header's first 60 bytes, then of everything after the header
};
static_assert(sizeof(PackedWeightHeader) == 64, "header must stay 64 bytes");
constexpr char kPackedMagic[8] = {'W', '8', 'A', '8', 'P', 'K', 'W', '\0'};
// 3: packed_by shrank to 12 bytes to make room for the checksum. 4: the weight scheme and its group size (nr and kr
// narrowed to a byte each). 5: the int4 scales' storage (the version narrowed to 16 bits: bytes 8-11 of a version 5
// blob never read as the uint32 4 of older builds). Older versions are rejected ("re-pack").
constexpr uint16_t kPackedVersion = 5;
constexpr int64_t kChecksumOffset = 60;  // offsetof(PackedWeightHeader, checksum)
// Format bounds, checked before any size is computed: nr * mr stays within the driver's 1024-int32 tile for
// mr <= 16; N as in unpack_weight; K as the ops (kMaxK, the int32 accumulation limit).
constexpr int kMaxPanelWidth = 64, kMaxPanelDepth = 64;
constexpr int64_t kMaxPackedN = (int64_t{1} << 31) - 1;
constexpr int kMinGroupLog2 = 5, kMaxGroupLog2 = 16;  // int4 groups of 32 .. 65536 k

// How a weight is quantized: the scheme and, for int4, the group size (group_log2 as in the header).
struct WeightFormat {
  WeightScheme scheme = WeightScheme::int8;
  int group_log2 = 0;
  ScaleStorage scales = ScaleStorage::f32;  // int4 only
};

struct PackedWeightView {
  PackedWeightHeader header;  // a copy: the blob may start at any byte address
  PanelLayout layout;
  WeightFormat format;
  int64_t group, groups;  // k per scale group and groups per channel (int8: k_padded and 1)
  const uint8_t* blob;
  int64_t nbytes;
  const int8_t* panels;     // panel p at panels + p * panel_bytes (int8 weights; int4: nibbles, scales, minimums)
  int64_t panel_bytes;      // bytes of one panel
  int64_t nibble_bytes;     // int4: bytes of a panel's nibbles (its scales follow)
  int64_t scale_bytes;      // int4: bytes of a panel's scales (its minimums follow)
  const uint8_t* col_sums;  // int8: n_padded int32 at any alignment: read them with load_col_sums
  bool int4() const { return format.scheme != WeightScheme::int8; }
  bool has_mins() const { return format.scheme == WeightScheme::int4_min; }
  Int4Groups int4_groups() const { return {group, groups, has_mins(), format.scales == ScaleStorage::f16}; }
};

// Byte layout of the blob of an [n, k] weight: the one place header fields are turned into sizes. Returns false,
// computing nothing, if n, k, the layout or the format is outside the format bounds or a size would overflow int64.
struct PackedWeightSizes {
  int64_t n_padded, k_padded, panel_bytes, nibble_bytes, scale_bytes, col_sums_offset, nbytes, group, groups;
};
bool packed_weight_sizes(int64_t n, int64_t k, PanelLayout layout, WeightFormat format, PackedWeightSizes* sizes);
// packed_weight_sizes(...).nbytes; throws std::invalid_argument naming `arg` outside the format bounds.
int64_t packed_weight_nbytes(int64_t n, int64_t k, PanelLayout layout, const char* arg,
                             WeightFormat format = WeightFormat{});
// Packs w (int8 [n, k], rows ldw apart) for `kernel` into blob (packed_weight_nbytes bytes), checksum included.
void pack_weight(const MicroKernel& kernel, const int8_t* w, int64_t n, int64_t k, int64_t ldw, uint8_t* blob,
                 const ParallelFor& parallel_for);
// Packs int4 weights q (int8 [n, k] holding [-8, 7], checked; rows ldq apart) with scales [n][groups] and minimums
// [n][groups] (null: format int4) for `kernel` into blob (packed_weight_nbytes(..., format) bytes). With
// format.scales f16 every scale must be an fp16 value (std::invalid_argument naming `scale` otherwise).
void pack_weight_int4(const MicroKernel& kernel, const int8_t* q, int64_t n, int64_t k, int64_t ldq,
                      const float* scales, const float* mins, WeightFormat format, uint8_t* blob,
                      const ParallelFor& parallel_for);
// Widens `count` int4 weights of a panel (count / 2 bytes of nibbles, count a multiple of kInt4ChunkElements) to
// int8 q in dst, and adds each column's values into sums[j] (column j = (element / kr) % nr).
void widen_int4(const uint8_t* src, int64_t count, PanelLayout layout, int8_t* dst, int32_t* sums);
// Validates the header of a blob of nbytes bytes (any alignment) against the format bounds and nbytes, O(1);
// throws std::invalid_argument naming `arg` if it is not a packed weight. Reading the view is then memory-safe.
PackedWeightView view_packed_weight(const uint8_t* blob, int64_t nbytes, const char* arg);
// Verifies the contents, one pass over the blob: the checksum, the channel sums (the VNNI / ppc64 tiles trust
// them) and zero padding. Throws std::invalid_argument naming `arg`. Run once per blob that comes from outside
// before computing with it (the torch binding caches the outcome per tensor version).
void verify_packed_weight(const PackedWeightView& w, const char* arg);
// Scale i of a panel's scales stored as `half_scales` says (ScaleStorage), as fp32: the reader of stored scales
// outside the vector tiles.
float load_group_scale(const uint8_t* scales, bool half_scales, int64_t i);
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
