#include "packed_weight.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "cpu_features.h"
#include "float_convert.h"

namespace w8a8_cpu {

#ifdef W8A8_CPU_HAVE_SSE42_CRC
uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n);  // csrc/x86_64/crc32c_sse42.cpp
#endif

namespace {

static_assert(offsetof(PackedWeightHeader, checksum) == kChecksumOffset, "checksum field moved");
static_assert(offsetof(PackedWeightHeader, packed_by) + sizeof(PackedWeightHeader::packed_by) == kChecksumOffset,
              "packed_by must end where the checksum starts");

// The int4 epilogue's group sum t (GemmOutput) is formed before the activation scale multiplies it, so it must stay
// finite in fp32 for every int8 activation row: group g adds float(acc_g) * s_g with |acc_g| <= 128 * 8 * group (and
// float(sum_g) * mn_g with |sum_g| <= 128 * group), and each of a channel's groups + 2 roundings grows the sum by at
// most 2^-24 of itself. A channel whose bound passes FLT_MAX is refused, at packing and in a blob: its outputs could
// be Inf or NaN where the same weights as float or int8 stay finite (issue 50: weights ~1e36).
struct Int4SumBound {
  double scales = 0, mins = 0;  // one channel's sums of |s_g| and |mn_g|
  void add(float scale, float minimum) {
    scales += std::fabs(static_cast<double>(scale));
    mins += std::fabs(static_cast<double>(minimum));
  }
  double bound(int64_t group, int64_t groups) const {
    const double g = static_cast<double>(group);
    return (1024.0 * g * scales + 128.0 * g * mins) * std::pow(1.0 + 0x1p-24, static_cast<double>(groups + 2));
  }
  // Empty when the channel fits, else why not.
  std::string problem(int64_t channel, int64_t group, int64_t groups) const {
    const double b = bound(group, groups);
    if (b <= static_cast<double>(std::numeric_limits<float>::max())) return {};
    char text[320];
    std::snprintf(text, sizeof text,
                  "channel %" PRId64 ": its group scales%s let the W4A8 kernel's fp32 sum of group products (int8 "
                  "activations times int4 weights times scale, before the activation scale) reach %.3g, past fp32's "
                  "%.3g; scale the weights down",
                  channel, mins > 0 ? " and minimums" : "", b, static_cast<double>(std::numeric_limits<float>::max()));
    return text;
  }
};

// Slicing-by-8 tables of the reflected Castagnoli polynomial, built at compile time: t[0] is the classic
// byte-at-a-time table, t[i][b] = the CRC of byte b followed by i zero bytes.
struct Crc32cTables {
  uint32_t t[8][256];
};
constexpr Crc32cTables make_crc32c_tables() {
  Crc32cTables tables{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    tables.t[0][b] = c;
  }
  for (int i = 1; i < 8; ++i)
    for (uint32_t b = 0; b < 256; ++b)
      tables.t[i][b] = (tables.t[i - 1][b] >> 8) ^ tables.t[0][tables.t[i - 1][b] & 0xff];
  return tables;
}
constexpr Crc32cTables kCrc32c = make_crc32c_tables();

uint32_t load_le32(const uint8_t* p) {  // byte by byte, so the CRC does not depend on the host's byte order
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

// What pack_weight writes: 1 to 11 printable ASCII characters, then NUL bytes to the end of the field.
bool valid_packed_by(const PackedWeightHeader& h) {
  const size_t len = strnlen(h.packed_by, sizeof h.packed_by);
  if (len == 0 || len == sizeof h.packed_by) return false;
  for (size_t i = 0; i < sizeof h.packed_by; ++i) {
    const auto c = static_cast<unsigned char>(h.packed_by[i]);
    if (i < len ? (c < 0x20 || c > 0x7e) : c != 0) return false;
  }
  return true;
}

// acc[i] += group[i] for i < len over `groups` consecutive groups of len bytes (one k group of a panel: nr
// channels x kr k). The shipped layouts' lengths are compile-time constants, so the loop vectorizes at -O2.
template <int Len>
void sum_groups_fixed(const int8_t* p, int64_t groups, int32_t* acc) {
  for (int64_t g = 0; g < groups; ++g, p += Len)
    for (int i = 0; i < Len; ++i) acc[i] += p[i];
}
void sum_groups(const int8_t* p, int64_t groups, int len, int32_t* acc) {
  if (len == 64) return sum_groups_fixed<64>(p, groups, acc);    // 16 x 4
  if (len == 128) return sum_groups_fixed<128>(p, groups, acc);  // 16 x 8
  for (int64_t g = 0; g < groups; ++g, p += len)
    for (int i = 0; i < len; ++i) acc[i] += p[i];
}

PackedWeightSizes checked_sizes(int64_t n, int64_t k, PanelLayout layout, WeightFormat format, const char* arg) {
  PackedWeightSizes sizes;
  if (!packed_weight_sizes(n, k, layout, format, &sizes))
    throw std::invalid_argument(std::string(arg) + ": a [" + std::to_string(n) + ", " + std::to_string(k) +
                                "] weight is outside the packed weight format (1 <= N <= " +
                                std::to_string(kMaxPackedN) + ", 1 <= K <= " + std::to_string(kMaxK) +
                                (format.scheme != WeightScheme::int8
                                     ? ", int4 groups of 2^" + std::to_string(kMinGroupLog2) + " .. 2^" +
                                           std::to_string(kMaxGroupLog2) + " k, a multiple of the panel depth"
                                     : std::string()) +
                                ")");
  return sizes;
}

// Where int4 panel element e lives: byte and shift of its nibble (WeightScheme: 64 elements per 32 bytes).
inline int64_t nibble_byte(int64_t e) { return e / kInt4ChunkElements * 32 + e % 32; }
inline int nibble_shift(int64_t e) { return e % kInt4ChunkElements >= 32 ? 4 : 0; }

// The weight at panel element e (int8 bytes, or int4 nibbles u = q + 8).
int8_t panel_element(const PackedWeightView& w, const int8_t* panel, int64_t e) {
  if (!w.int4()) return panel[e];
  const auto byte = static_cast<uint8_t>(panel[nibble_byte(e)]);
  return static_cast<int8_t>(((byte >> nibble_shift(e)) & 0x0f) - 8);
}

[[noreturn]] void throw_corrupted(const char* arg, const std::string& what) {
  throw std::invalid_argument(std::string(arg) + ": packed weight " + what +
                              ": the blob is corrupted; re-pack the raw weight with pack_weight");
}

}  // namespace

std::string packed_by_name(const PackedWeightHeader& h) {
  return std::string(h.packed_by, strnlen(h.packed_by, sizeof h.packed_by));
}

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = kCrc32c.t;
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = crc ^ load_le32(p), hi = load_le32(p + 4);
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
          t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#ifdef W8A8_CPU_HAVE_SSE42_CRC
  if (cpu_features() & kFeatSse42) return crc32c_sse42(crc, data, n);
#endif
  return crc32c_portable(crc, data, n);
}

uint32_t packed_weight_checksum(const uint8_t* blob, int64_t nbytes) {
  const uint32_t head = crc32c(0, blob, kChecksumOffset);
  const int64_t header = sizeof(PackedWeightHeader);
  return crc32c(head, blob + header, static_cast<size_t>(nbytes - header));
}

bool packed_weight_sizes(int64_t n, int64_t k, PanelLayout layout, WeightFormat format, PackedWeightSizes* sizes) {
  if (layout.nr < 1 || layout.nr > kMaxPanelWidth || layout.kr < 1 || layout.kr > kMaxPanelDepth || n < 1 ||
      n > kMaxPackedN || k < 1 || k > kMaxK)
    return false;
  const bool int4 = format.scheme == WeightScheme::int4 || format.scheme == WeightScheme::int4_min;
  if (int4 ? (format.group_log2 != 0 && (format.group_log2 < kMinGroupLog2 || format.group_log2 > kMaxGroupLog2)) ||
                 32 % layout.kr != 0 || (32 * layout.nr) % kInt4ChunkElements != 0
           : format.scheme != WeightScheme::int8 || format.group_log2 != 0 || format.scales != ScaleStorage::f32)
    return false;
  if (format.scales != ScaleStorage::f32 && format.scales != ScaleStorage::f16) return false;
  // Within those bounds nothing below can overflow (the body is < 2^50 bytes); checked anyway, so that raising a
  // bound can never turn a hostile header into a small size.
  const int64_t group_step = int4 ? (format.group_log2 ? int64_t{1} << format.group_log2 : 32) : layout.kr;
  const int64_t n_padded = round_up(n, layout.nr), k_padded = round_up(k, group_step);
  const int64_t group = int4 && format.group_log2 ? group_step : k_padded, groups = k_padded / group;
  // bytes per group and channel: a scale, and with int4_min an fp32 minimum
  const int64_t scale_size = int4 ? int4_scale_bytes(format.scales == ScaleStorage::f16) : 0;
  const int64_t value_size = scale_size + (format.scheme == WeightScheme::int4_min ? 4 : 0);
  int64_t elements, nibble_bytes, panel_scale_bytes, value_bytes, panel_bytes, body, col_sums_offset, sum_bytes, nbytes;
  if (__builtin_mul_overflow(k_padded, static_cast<int64_t>(layout.nr), &elements) ||
      __builtin_mul_overflow(groups * layout.nr, scale_size, &panel_scale_bytes) ||
      __builtin_mul_overflow(groups * layout.nr, value_size, &value_bytes))
    return false;
  nibble_bytes = int4 ? elements / 2 : 0;
  panel_bytes = int4 ? nibble_bytes + value_bytes : elements;
  if (__builtin_mul_overflow(n_padded / layout.nr, panel_bytes, &body) ||
      __builtin_add_overflow(body, static_cast<int64_t>(sizeof(PackedWeightHeader)), &col_sums_offset) ||
      __builtin_mul_overflow(int4 ? 0 : n_padded, int64_t{4}, &sum_bytes) ||
      __builtin_add_overflow(col_sums_offset, sum_bytes, &nbytes))
    return false;
  *sizes = {n_padded, k_padded, panel_bytes, nibble_bytes, panel_scale_bytes, col_sums_offset, nbytes, group, groups};
  return true;
}

int64_t packed_weight_nbytes(int64_t n, int64_t k, PanelLayout layout, const char* arg, WeightFormat format) {
  return checked_sizes(n, k, layout, format, arg).nbytes;
}

void widen_int4(const uint8_t* src, int64_t count, PanelLayout layout, int8_t* dst, int32_t* sums) {
  for (int64_t c = 0; c < count; c += kInt4ChunkElements, src += 32, dst += kInt4ChunkElements)
    for (int i = 0; i < 32; ++i) {
      dst[i] = static_cast<int8_t>((src[i] & 0x0f) - 8);
      dst[i + 32] = static_cast<int8_t>((src[i] >> 4) - 8);
    }
  dst -= count;
  const int nr = layout.nr, kr = layout.kr, len = nr * kr;
  int32_t acc[kMaxPanelWidth * kMaxPanelDepth];
  std::fill(acc, acc + len, 0);
  sum_groups(dst, count / len, len, acc);
  for (int j = 0; j < nr; ++j)
    for (int r = 0; r < kr; ++r) sums[j] += acc[j * kr + r];
}

bool kernel_reads_layout(const MicroKernel& kernel, PanelLayout layout) {
  const PanelLayout own = kernel.geometry().layout;
  return kernel.reads_any_layout || (own.nr == layout.nr && own.kr == layout.kr);
}

namespace {

// The header of a blob `kernel` packs in `format`, written to blob.
void write_header(const MicroKernel& kernel, int64_t n, int64_t k, WeightFormat format, const PackedWeightSizes& sizes,
                  uint8_t* blob) {
  const PanelLayout layout = kernel.geometry().layout;
  PackedWeightHeader header{};
  if (std::strlen(kernel.name) >= sizeof header.packed_by)
    throw std::logic_error(std::string("variant name '") + kernel.name + "' does not fit the packed weight header");
  std::memcpy(header.magic, kPackedMagic, sizeof kPackedMagic);
  header.version = kPackedVersion;
  header.scale_storage = static_cast<uint8_t>(format.scales);
  header.nr = static_cast<uint8_t>(layout.nr);
  header.kr = static_cast<uint8_t>(layout.kr);
  header.scheme = static_cast<uint8_t>(format.scheme);
  header.group_log2 = static_cast<uint8_t>(format.group_log2);
  header.n = n;
  header.k = k;
  header.n_padded = sizes.n_padded;
  header.k_padded = sizes.k_padded;
  std::memcpy(header.packed_by, kernel.name, std::strlen(kernel.name));
  std::memcpy(blob, &header, sizeof header);
}

void seal(uint8_t* blob, int64_t nbytes) {
  const uint32_t checksum = packed_weight_checksum(blob, nbytes);
  std::memcpy(blob + kChecksumOffset, &checksum, sizeof checksum);
}

// Calls emit(e, j, v) for every element of panel p in the panel's own order, e = layout.index(k, j) = 0, 1, 2, ...: v
// the weight at row p * nr + j, column k of w [n, k] (rows ldw apart), 0 in the padding. The packers' one walk over a
// panel: sequential writes and no division per element (layout.index per element took ~7-9 ns an element: ~60 s to
// pack a 7B model's int4 weights on one core).
template <typename Emit>
void for_each_panel_element(const int8_t* w, int64_t n, int64_t k, int64_t ldw, PanelLayout layout, int64_t k_padded,
                            int64_t p, Emit&& emit) {
  int64_t e = 0;
  for (int64_t k0 = 0; k0 < k_padded; k0 += layout.kr)
    for (int j = 0; j < layout.nr; ++j) {
      const int64_t row = p * layout.nr + j;
      const int8_t* src = row < n ? w + row * ldw : nullptr;
      for (int t = 0; t < layout.kr; ++t, ++e) emit(e, j, src && k0 + t < k ? src[k0 + t] : int8_t{0});
    }
}

}  // namespace

void pack_weight(const MicroKernel& kernel, const int8_t* w, int64_t n, int64_t k, int64_t ldw, uint8_t* blob,
                 const ParallelFor& parallel_for) {
  const PanelLayout layout = kernel.geometry().layout;
  const int nr = layout.nr;
  const PackedWeightSizes sizes = checked_sizes(n, k, layout, WeightFormat{}, "w");
  write_header(kernel, n, k, WeightFormat{}, sizes, blob);
  auto* panels = reinterpret_cast<int8_t*>(blob + sizeof(PackedWeightHeader));
  uint8_t* col_sums = blob + sizes.col_sums_offset;  // any alignment: stored with memcpy
  parallel_for(0, sizes.n_padded / nr, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* panel = panels + p * sizes.panel_bytes;
      int32_t sums[kMaxPanelWidth] = {};
      for_each_panel_element(w, n, k, ldw, layout, sizes.k_padded, p, [&](int64_t e, int j, int8_t v) {
        panel[e] = v;
        sums[j] += v;
      });
      std::memcpy(col_sums + p * nr * 4, sums, static_cast<size_t>(nr) * 4);
    }
  });
  seal(blob, sizes.nbytes);
}

void pack_weight_int4(const MicroKernel& kernel, const int8_t* q, int64_t n, int64_t k, int64_t ldq,
                      const float* scales, const float* mins, WeightFormat format, uint8_t* blob,
                      const ParallelFor& parallel_for) {
  const PanelLayout layout = kernel.geometry().layout;
  const int nr = layout.nr;
  format.scheme = mins ? WeightScheme::int4_min : WeightScheme::int4;
  const PackedWeightSizes sizes = checked_sizes(n, k, layout, format, "q");
  for (int64_t row = 0; row < n; ++row)
    for (int64_t kk = 0; kk < k; ++kk)
      if (q[row * ldq + kk] < -8 || q[row * ldq + kk] > 7)
        throw std::invalid_argument("q: int4 weights must lie in [-8, 7]; row " + std::to_string(row) + ", k " +
                                    std::to_string(kk) + " holds " + std::to_string(q[row * ldq + kk]));
  const bool half = format.scales == ScaleStorage::f16;
  if (half)
    for (int64_t i = 0; i < n * sizes.groups; ++i)
      if (f16_bits_to_float(float_to_f16_bits(scales[i])) != scales[i])
        throw std::invalid_argument("scale: fp16 storage holds only fp16 values; row " +
                                    std::to_string(i / sizes.groups) + ", group " + std::to_string(i % sizes.groups) +
                                    " is not one (store the scales as fp32)");
  for (int64_t row = 0; row < n; ++row) {
    Int4SumBound sums;
    for (int64_t g = 0; g < sizes.groups; ++g)
      sums.add(scales[row * sizes.groups + g], mins ? mins[row * sizes.groups + g] : 0.f);
    const std::string problem = sums.problem(row, sizes.group, sizes.groups);
    if (!problem.empty()) throw std::invalid_argument(std::string(mins ? "scale, minimum: " : "scale: ") + problem);
  }
  write_header(kernel, n, k, format, sizes, blob);
  uint8_t* panels = blob + sizeof(PackedWeightHeader);
  parallel_for(0, sizes.n_padded / nr, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = panels + p * sizes.panel_bytes;
      std::memset(panel, 0, static_cast<size_t>(sizes.panel_bytes));
      for_each_panel_element(q, n, k, ldq, layout, sizes.k_padded, p, [&](int64_t e, int, int8_t v) {
        panel[nibble_byte(e)] |= static_cast<uint8_t>((v + 8) << nibble_shift(e));
      });
      for (int j = 0; j < nr; ++j) {
        const int64_t row = p * nr + j;
        for (int64_t g = 0; g < sizes.groups; ++g) {  // [groups][nr] per panel; padded channels 0
          const float scale = row < n ? scales[row * sizes.groups + g] : 0.f;
          uint8_t* scale_at = panel + sizes.nibble_bytes + (g * nr + j) * int4_scale_bytes(half);
          if (half) {
            const uint16_t bits = float_to_f16_bits(scale);
            std::memcpy(scale_at, &bits, 2);
          } else {
            std::memcpy(scale_at, &scale, 4);
          }
          if (mins) {
            const float minimum = row < n ? mins[row * sizes.groups + g] : 0.f;
            std::memcpy(panel + sizes.nibble_bytes + sizes.scale_bytes + (g * nr + j) * 4, &minimum, 4);
          }
        }
      }
    }
  });
  seal(blob, sizes.nbytes);
}

PackedWeightView view_packed_weight(const uint8_t* blob, int64_t nbytes, const char* arg) {
  const std::string name(arg);
  PackedWeightHeader h;  // copied out: the blob may sit at any byte address
  if (nbytes < static_cast<int64_t>(sizeof h))
    throw std::invalid_argument(name + ": a 1-D uint8 tensor of " + std::to_string(nbytes) +
                                " bytes is too short to be a packed weight (expected the output of pack_weight)");
  std::memcpy(&h, blob, sizeof h);
  if (std::memcmp(h.magic, kPackedMagic, sizeof kPackedMagic) != 0)
    throw std::invalid_argument(name + ": 1-D uint8 tensor is not a packed weight (bad magic); pass the output of "
                                "pack_weight or a raw int8 [N, K] weight");
  if (h.version != kPackedVersion)
    throw std::invalid_argument(name + ": packed weight format version " + std::to_string(h.version) +
                                " is not supported (this build reads version " + std::to_string(kPackedVersion) +
                                "); re-pack the raw weight with pack_weight");
  if (!valid_packed_by(h))
    throw std::invalid_argument(name + ": packed weight header: packed_by is not a NUL-terminated printable ASCII "
                                "variant name (corrupted blob)");
  const PanelLayout layout{h.nr, h.kr};
  const WeightFormat format{static_cast<WeightScheme>(h.scheme), h.group_log2,
                            static_cast<ScaleStorage>(h.scale_storage)};
  PackedWeightSizes sizes;
  if (h.scheme > static_cast<uint8_t>(WeightScheme::int4_min) || h.reserved != 0 ||
      !packed_weight_sizes(h.n, h.k, layout, format, &sizes) || sizes.n_padded != h.n_padded ||
      sizes.k_padded != h.k_padded)
    throw std::invalid_argument(
        name + ": packed weight header: n = " + std::to_string(h.n) + ", k = " + std::to_string(h.k) + ", panel " +
        std::to_string(h.nr) + "x" + std::to_string(h.kr) + ", scheme " + std::to_string(h.scheme) + ", group 2^" +
        std::to_string(h.group_log2) + ", scales " + std::to_string(h.scale_storage) + "/" +
        std::to_string(h.reserved) + ", padded to " + std::to_string(h.n_padded) + " x " +
        std::to_string(h.k_padded) + " is outside the format (1 <= n <= " + std::to_string(kMaxPackedN) +
        ", 1 <= k <= " + std::to_string(kMaxK) + ", panel at most " + std::to_string(kMaxPanelWidth) + "x" +
        std::to_string(kMaxPanelDepth) + ", scheme 0 (int8, group 0, scales 0/0), 1 or 2 (int4, group 0 or 2^" +
        std::to_string(kMinGroupLog2) + " .. 2^" + std::to_string(kMaxGroupLog2) +
        ", scales 0/0 fp32 or 1/0 fp16), padding to the next panel or group multiple) (corrupted blob)");
  if (sizes.nbytes != nbytes)
    throw std::invalid_argument(name + ": packed weight header is inconsistent with its size: it describes " +
                                std::to_string(sizes.nbytes) + " bytes, the tensor has " + std::to_string(nbytes) +
                                " (corrupted or truncated blob)");
  return {h, layout, format, sizes.group, sizes.groups, blob, nbytes, reinterpret_cast<const int8_t*>(blob + sizeof h),
          sizes.panel_bytes, sizes.nibble_bytes, sizes.scale_bytes, blob + sizes.col_sums_offset};
}

float load_group_scale(const uint8_t* scales, bool half_scales, int64_t i) {
  if (half_scales) {
    uint16_t bits;
    std::memcpy(&bits, scales + i * 2, 2);
    return f16_bits_to_float(bits);
  }
  float v;
  std::memcpy(&v, scales + i * 4, 4);
  return v;
}

void load_col_sums(const PackedWeightView& w, int64_t first, int64_t count, int32_t* dst) {
  std::memcpy(dst, w.col_sums + first * 4, static_cast<size_t>(count) * 4);
}

void verify_packed_weight(const PackedWeightView& w, const char* arg) {
  const uint32_t computed = packed_weight_checksum(w.blob, w.nbytes);
  if (computed != w.header.checksum) {
    char detail[96];
    std::snprintf(detail, sizeof detail, "checksum mismatch (stored 0x%08" PRIx32 ", computed 0x%08" PRIx32 ")",
                  w.header.checksum, computed);
    throw_corrupted(arg, detail);
  }
  // The checksum catches accidents, not edits: anyone can recompute it. So what the tiles trust is checked too:
  // each stored channel sum against its panel (the VNNI / ppc64 tiles subtract 128 * sum rather than summing the
  // weights) and zero padding (pack_a_rows only promises that A's padding contributes 0 against a zero weight).
  // (int4 blobs carry no sums: the driver sums each block it widens.)
  const PackedWeightHeader& h = w.header;
  const int nr = w.layout.nr, kr = w.layout.kr, group = nr * kr;
  const int64_t groups = h.k_padded / kr, panels = h.n_padded / nr;
  int32_t acc[kMaxPanelWidth * kMaxPanelDepth], stored[kMaxPanelWidth];
  for (int64_t p = 0; p < panels; ++p) {
    const int8_t* panel = w.panels + p * w.panel_bytes;
    if (w.int4()) {  // scales and minimums are weight-side values: finite (the ops' rule), 0 in padded channels
      const int64_t per_kind = w.groups * nr, values = per_kind * (w.has_mins() ? 2 : 1);
      const auto* scales = reinterpret_cast<const uint8_t*>(panel + w.nibble_bytes);
      const bool half_scales = w.int4_groups().half_scales;
      Int4SumBound sums[kMaxPanelWidth];
      for (int64_t v = 0; v < values; ++v) {
        const float value = v < per_kind ? load_group_scale(scales, half_scales, v)
                                         : load_group_scale(scales + w.scale_bytes, false, v - per_kind);
        const int64_t channel = p * nr + v % nr;
        if (!std::isfinite(value) || (channel >= h.n && value != 0.f))
          throw_corrupted(arg, std::string(channel >= h.n ? "padded channel's group scale is not 0"
                                                          : "group scale or minimum is NaN or Inf") +
                                   " (channel " + std::to_string(channel) + ")");
        sums[v % nr].add(v < per_kind ? value : 0.f, v < per_kind ? 0.f : value);
      }
      for (int j = 0; j < nr; ++j) {
        const std::string problem = sums[j].problem(p * nr + j, w.group, w.groups);
        if (!problem.empty()) throw_corrupted(arg, problem);
      }
    } else {
      std::fill(acc, acc + group, 0);
      sum_groups(panel, groups, group, acc);
      load_col_sums(w, p * nr, nr, stored);
      for (int j = 0; j < nr; ++j) {
        int32_t sum = 0;
        for (int r = 0; r < kr; ++r) sum += acc[j * kr + r];
        if (sum != stored[j]) throw_corrupted(arg, "channel sums do not match its panels (channel " +
                                                       std::to_string(p * nr + j) + ")");
      }
    }
    // Padding: k >= K in every channel (in the last k groups), and every k of channels >= N.
    for (int j = 0; j < nr; ++j) {
      const bool padded_channel = p * nr + j >= h.n;
      for (int64_t kk = padded_channel ? 0 : h.k; kk < h.k_padded; ++kk)
        if (panel_element(w, panel, w.layout.index(kk, j)) != 0)
          throw_corrupted(arg, "padding is not zero (channel " + std::to_string(p * nr + j) + ", k " +
                                   std::to_string(kk) + ")");
    }
  }
}

}  // namespace w8a8_cpu
