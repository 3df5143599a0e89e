// Portable reference variant: scalar, exact, runs on every CPU. Also the ground truth the C++ tests use.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "float_convert.h"
#include "microkernel.h"
#include "ref_kernel.h"

namespace w8a8_cpu {
void ref_pack_a_row(const int8_t* a, int64_t k, int64_t k_padded, void* dst) {
  auto* out = static_cast<int8_t*>(dst);
  std::memcpy(out, a, static_cast<size_t>(k));
  std::memset(out + k, 0, static_cast<size_t>(k_padded - k));
}

void ref_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout layout,
              int64_t k_padded, int32_t* c) {
  for (int i = 0; i < m; ++i) {
    const auto* ai = static_cast<const int8_t*>(a) + i * a_row_stride;
    for (int j = 0; j < layout.nr; ++j) {
      int32_t acc = 0;
      for (int64_t k = 0; k < k_padded; ++k) acc += int32_t{ai[k]} * panel[layout.index(k, j)];
      c[i * layout.nr + j] = acc;
    }
  }
}

uint32_t ref_row_absmax_bits(const void* x, FloatKind kind, int64_t k) {
  uint32_t m = 0;
  for (int64_t i = 0; i < k; ++i) {
    m = std::max(m, bits_of_float(load_as_float(x, kind, i)) & 0x7fffffffu);
  }
  return m;
}

void ref_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q) {
  for (int64_t i = 0; i < k; ++i) {
    // nearbyint rounds half to even in the default FP environment, like cvtps2dq / fcvtns / xvrspic.
    const float r = std::nearbyint(load_as_float(x, kind, i) * inv_scale);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
}

const MicroKernel kRefKernel = {
    /*name=*/"ref",
    /*required_features=*/0,
    /*geometry=*/fixed_geometry<kRefNr, 4, 4, 1>,
    /*reads_any_layout=*/true,
    pack_rows_one_by_one<ref_pack_a_row>,
    ref_tile,
    ref_row_absmax_bits,
    ref_quantize_row,
};

}  // namespace w8a8_cpu
