#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#elif defined(__APPLE__) && defined(__aarch64__)
#include <sys/sysctl.h>
#elif defined(__linux__) && (defined(__aarch64__) || defined(__powerpc64__))
#include <sys/auxv.h>
#endif

namespace w8a8_cpu {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

uint64_t probe() {
  uint32_t a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), sse42 = c & (1u << 20);
  // The OS must save the vector state, or the instructions fault even though cpuid lists them.
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool ymm_os = (xcr0 & 0x6) == 0x6;
  const bool zmm_os = (xcr0 & 0xe6) == 0xe6;
  const bool amx_os = (xcr0 & 0x60000) == 0x60000;
  uint64_t f = sse42 ? uint64_t{kFeatSse42} : 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31), avx512vnni = c & (1u << 11), amx_int8 = d & (1u << 25);
  if (ymm_os && avx2 && fma && f16c) f |= kFeatAvx2;
  if ((f & kFeatAvx2) && zmm_os && avx512f && avx512bw && avx512vl && avx512vnni) f |= kFeatAvx512Vnni;
  if (amx_os && amx_int8) f |= kFeatAmxInt8;
  return f;
}
#elif defined(__APPLE__) && defined(__aarch64__)
// macOS on Apple Silicon: no auxv; the kernel publishes each Arm feature as a sysctl (1 when present). Every Apple
// Silicon CPU has Advanced SIMD. UNTESTED here (no macOS machine in this project's CI; see docs/ADDING_A_VARIANT.md).
bool sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof value;
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value == 1;
}

uint64_t probe() {
  uint64_t f = kFeatAsimd;
  if (sysctl_flag("hw.optional.arm.FEAT_DotProd")) f |= kFeatDotprod;
  if (sysctl_flag("hw.optional.arm.FEAT_I8MM")) f |= kFeatI8mm;
  if (sysctl_flag("hw.optional.arm.FEAT_BF16")) f |= kFeatBf16;
  return f;  // no SVE on Apple Silicon; SME (M4) is not used by any variant yet
}
#elif defined(__aarch64__)
uint64_t probe() {
  // Bit values from the Linux uapi <asm/hwcap.h>; spelled out so old libc headers still compile.
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  uint64_t f = 0;
  if (hwcap & (1ul << 1)) f |= kFeatAsimd;     // HWCAP_ASIMD
  if (hwcap & (1ul << 20)) f |= kFeatDotprod;  // HWCAP_ASIMDDP
  if (hwcap & (1ul << 22)) f |= kFeatSve;      // HWCAP_SVE
  if (hwcap2 & (1ul << 13)) f |= kFeatI8mm;    // HWCAP2_I8MM
  if (hwcap2 & (1ul << 14)) f |= kFeatBf16;    // HWCAP2_BF16
  return f;
}
#elif defined(__powerpc64__)
uint64_t probe() {
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  uint64_t f = 0;
  if (hwcap & 0x00000080ul) f |= kFeatVsx;      // PPC_FEATURE_HAS_VSX
  if (hwcap2 & 0x00040000ul) f |= kFeatArch31;  // PPC_FEATURE2_ARCH_3_1
  if (hwcap2 & 0x00020000ul) f |= kFeatMma;     // PPC_FEATURE2_MMA
  return f;
}
#else
uint64_t probe() { return 0; }
#endif

}  // namespace

uint64_t cpu_features() {
  static const uint64_t features = probe();
  return features;
}

std::vector<std::string> feature_names(uint64_t features) {
  static const struct { CpuFeature bit; const char* name; } kNames[] = {
      {kFeatSse42, "sse4_2"}, {kFeatAvx2, "avx2"},   {kFeatAvx512Vnni, "avx512_vnni"}, {kFeatAmxInt8, "amx_int8"},
      {kFeatAsimd, "asimd"}, {kFeatDotprod, "dotprod"},         {kFeatI8mm, "i8mm"},
      {kFeatBf16, "bf16"},   {kFeatSve, "sve"},                 {kFeatVsx, "vsx"},
      {kFeatArch31, "arch_3_1"}, {kFeatMma, "mma"}};
  std::vector<std::string> names;
  for (const auto& n : kNames)
    if (features & n.bit) names.emplace_back(n.name);
  return names;
}

const char* target_arch() {
#if defined(__x86_64__)
  return "x86_64";
#elif defined(__aarch64__)
  return "aarch64";
#elif defined(__powerpc64__) && defined(__LITTLE_ENDIAN__)
  return "ppc64le";
#else
  return "unknown";
#endif
}

}  // namespace w8a8_cpu
