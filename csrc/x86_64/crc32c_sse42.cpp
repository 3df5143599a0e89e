// CRC-32C of packed weight blobs with the SSE4.2 crc32 instruction, which implements exactly the Castagnoli
// polynomial, so results equal crc32c_portable bit for bit (tests/cpp/kernel_tests.cpp checks it). Compiled with
// -msse4.2 and nothing else; crc32c() (packed_weight.cpp) calls it only when cpu_features() has kFeatSse42.
//
// crc32 has a 3-cycle latency and a 1-cycle throughput: one dependency chain would run at a third of the
// instruction's rate, so three chains run over three adjacent blocks and are joined with the CRC combination rule
// crc(A B) = crc(A) * x^(8 |B|) mod P xor crc(B) (as zlib's crc32_combine).
#if !defined(__SSE4_2__)
#error "crc32c_sse42.cpp needs -msse4.2 (csrc/x86_64/variants.cmake adds it with that flag)"
#endif
#include <nmmintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace w8a8_cpu {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
constexpr size_t kBlock = 8192;          // bytes per chain and round: the combination cost is ~1% of a round

// a * b mod P in the reflected bit order (bit 31 is x^0).
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 * bytes) mod P, by squaring.
uint32_t x8nmodp(size_t bytes) {
  uint32_t result = 1u << 31, power = 1u << 23;  // x^0; x^8
  for (; bytes != 0; bytes >>= 1, power = multmodp(power, power))
    if (bytes & 1) result = multmodp(power, result);
  return result;
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // x86 is little-endian: the bytes in CRC order
  return v;
}

}  // namespace

uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n) {
  static const uint32_t shift = x8nmodp(kBlock);
  const auto* p = static_cast<const uint8_t*>(data);
  for (; n >= 3 * kBlock; n -= 3 * kBlock, p += 3 * kBlock) {
    uint64_t a = ~crc, b = 0xffffffffu, c = 0xffffffffu;  // raw register states: the first chain continues crc
    for (size_t i = 0; i < kBlock; i += 8) {
      a = _mm_crc32_u64(a, load64(p + i));
      b = _mm_crc32_u64(b, load64(p + kBlock + i));
      c = _mm_crc32_u64(c, load64(p + 2 * kBlock + i));
    }
    crc = multmodp(shift, multmodp(shift, ~static_cast<uint32_t>(a)) ^ ~static_cast<uint32_t>(b)) ^
          ~static_cast<uint32_t>(c);
  }
  uint64_t a = ~crc;
  for (; n >= 8; n -= 8, p += 8) a = _mm_crc32_u64(a, load64(p));
  uint32_t tail = static_cast<uint32_t>(a);
  for (; n > 0; --n, ++p) tail = _mm_crc32_u8(tail, *p);
  return ~tail;
}

}  // namespace w8a8_cpu
