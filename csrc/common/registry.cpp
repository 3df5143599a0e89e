#include "registry.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "cpu_features.h"
#include "ref_kernel.h"

namespace w8a8_cpu {

// Each variant lives in its own translation unit, compiled with its own ISA flags, and exists only
// when CMake found a compiler that supports them (the W8A8_CPU_HAVE_* guards).
#ifdef W8A8_CPU_HAVE_AVX2
extern const MicroKernel kAvx2Kernel;
#endif
#ifdef W8A8_CPU_HAVE_AVX512VNNI
extern const MicroKernel kAvx512VnniKernel;
#endif
#ifdef W8A8_CPU_HAVE_NEON
extern const MicroKernel kNeonKernel;
#endif
#ifdef W8A8_CPU_HAVE_DOTPROD
extern const MicroKernel kDotprodKernel;
#endif
#ifdef W8A8_CPU_HAVE_I8MM
extern const MicroKernel kI8mmKernel;
#endif
#ifdef W8A8_CPU_HAVE_VSX
extern const MicroKernel kVsxKernel;
#endif
#ifdef W8A8_CPU_HAVE_MMA
extern const MicroKernel kMmaKernel;
#endif

const std::vector<const MicroKernel*>& compiled_kernels() {
  static const std::vector<const MicroKernel*> kernels = {
      &kRefKernel,
#ifdef W8A8_CPU_HAVE_AVX2
      &kAvx2Kernel,
#endif
#ifdef W8A8_CPU_HAVE_AVX512VNNI
      &kAvx512VnniKernel,
#endif
#ifdef W8A8_CPU_HAVE_NEON
      &kNeonKernel,
#endif
#ifdef W8A8_CPU_HAVE_DOTPROD
      &kDotprodKernel,
#endif
#ifdef W8A8_CPU_HAVE_I8MM
      &kI8mmKernel,
#endif
#ifdef W8A8_CPU_HAVE_VSX
      &kVsxKernel,
#endif
#ifdef W8A8_CPU_HAVE_MMA
      &kMmaKernel,
#endif
  };
  return kernels;
}

bool cpu_supports(const MicroKernel& kernel) {
  return (cpu_features() & kernel.required_features) == kernel.required_features;
}

namespace {

const MicroKernel& checked_kernel(const std::string& name, const char* source) {
  std::string choices;
  for (const MicroKernel* k : compiled_kernels()) {
    if (!choices.empty()) choices += ", ";
    choices += k->name;
    if (!cpu_supports(*k)) choices += " (not supported by this CPU)";
  }
  for (const MicroKernel* k : compiled_kernels()) {
    if (name != k->name) continue;
    if (!cpu_supports(*k))
      throw std::invalid_argument(std::string(source) + "='" + name + "': this CPU lacks the features the '" +
                                  name + "' variant needs; choices: " + choices);
    return *k;
  }
  throw std::invalid_argument(std::string(source) + "='" + name + "' is not a variant compiled into this " +
                              target_arch() + " build; choices: " + choices);
}

const MicroKernel& initial_kernel() {
  if (const char* forced = std::getenv("W8A8_CPU_ISA"); forced && *forced)
    return checked_kernel(forced, "W8A8_CPU_ISA");
  const MicroKernel* best = &kRefKernel;
  for (const MicroKernel* k : compiled_kernels())
    if (cpu_supports(*k)) best = k;
  return *best;
}

std::atomic<const MicroKernel*>& active_slot() {
  static std::atomic<const MicroKernel*> slot{&initial_kernel()};
  return slot;
}

thread_local const MicroKernel* t_override = nullptr;

}  // namespace

const MicroKernel& active_kernel() { return t_override ? *t_override : *active_slot().load(std::memory_order_acquire); }

std::string set_thread_kernel(const std::string& name) {
  const MicroKernel* next = name.empty() ? nullptr : &checked_kernel(name, "variant");
  std::string previous = t_override ? t_override->name : "";
  t_override = next;
  return previous;
}

}  // namespace w8a8_cpu
