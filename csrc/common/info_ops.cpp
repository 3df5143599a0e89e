// The build and CPU facts (_info) and the variant override (_set_variant).
#include <sstream>
#include <string>
#include <vector>

#include "binding_checks.h"
#include "cpu_features.h"
#include "registry.h"
#include "torch_ops.h"

namespace w8a8_cpu {

namespace {

std::string json_list(const std::vector<std::string>& items) {
  std::string s = "[";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", \"" : "\"") + items[i] + "\"";
  return s + "]";
}

}  // namespace

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

}  // namespace w8a8_cpu
