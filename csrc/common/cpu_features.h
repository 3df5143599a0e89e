// CPU feature detection. Compiled for the baseline ISA of each arch so it can run anywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace w8a8_cpu {

// One bit per feature that some variant (or the packed weight checksum) needs. Bits of other arches are never set.
enum CpuFeature : uint64_t {
  kFeatAvx2 = 1ull << 0,  // with FMA and F16C, and OS-enabled YMM state
  kFeatAvx512Vnni = 1ull << 1,  // AVX512 F/BW/VL/VNNI and OS-enabled ZMM state
  kFeatAmxInt8 = 1ull << 2,
  kFeatSse42 = 1ull << 3,  // crc32 instruction (CRC-32C of packed weights)
  kFeatAsimd = 1ull << 8,
  kFeatDotprod = 1ull << 9,
  kFeatI8mm = 1ull << 10,
  kFeatBf16 = 1ull << 11,
  kFeatSve = 1ull << 12,
  kFeatVsx = 1ull << 16,
  kFeatArch31 = 1ull << 17,  // POWER10 ISA 3.1
  kFeatMma = 1ull << 18,
};

// What the running CPU (and OS) supports, probed once.
uint64_t cpu_features();

// Names of the bits set in `features`, e.g. {"avx2", "avx512_vnni"}.
std::vector<std::string> feature_names(uint64_t features);

// "x86_64", "aarch64", "ppc64le" — the arch this library was compiled for.
const char* target_arch();

}  // namespace w8a8_cpu
