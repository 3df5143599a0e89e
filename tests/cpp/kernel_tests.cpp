// Torch-free kernel tests: every compiled variant the CPU supports, against the exact integer reference.
// Runs natively or under qemu (cross builds). Usage:
//   w8a8_kernel_tests [--shapes N] [--seed S] [--expect-selected NAME] [--variant NAME]
// --variant: that variant's suites only (with it the cross-variant checks are trivially about one variant); the
// default runs every compiled variant the CPU supports.
// Exit status 0 only if every check passed and at least one variant ran.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "float_convert.h"
#include "gemm_driver.h"
#include "layer_ops.h"
#include "ref_kernel.h"
#include "registry.h"

using namespace w8a8_cpu;

namespace w8a8_cpu {
int run_moe_tests(const std::vector<const MicroKernel*>& kernels, uint64_t seed);  // moe_tests.cpp
}

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++g_failures;                                       \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
    }                                                     \
  } while (0)

struct Shape {
  int64_t m, n, k;
};

// Exact int64 reference: c[i, j] = sum_k a[i, k] * w[j, k].
std::vector<int64_t> reference_matmul(const std::vector<int8_t>& a, const std::vector<int8_t>& w, const Shape& s) {
  std::vector<int64_t> c(s.m * s.n, 0);
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) {
      int64_t acc = 0;
      for (int64_t k = 0; k < s.k; ++k) acc += int64_t{a[i * s.k + k]} * w[j * s.k + k];
      c[i * s.n + j] = acc;
    }
  return c;
}

int64_t blob_k_padded(const std::vector<uint8_t>& blob) {
  return view_packed_weight(blob.data(), static_cast<int64_t>(blob.size()), "w").header.k_padded;
}

// Runs the variant's tile (or `tile`, another of its tiles) over every (row tile, panel) and returns the int32
// accumulators [m, n].
std::vector<int32_t> kernel_matmul(const MicroKernel& kern, const std::vector<int8_t>& a, const std::vector<int8_t>& w,
                                   const Shape& s, decltype(MicroKernel::tile) tile_fn = nullptr) {
  const TileGeometry g = kern.geometry();
  std::vector<uint8_t> blob(packed_weight_nbytes(s.n, s.k, g.layout, "w"));
  pack_weight(kern, w.data(), s.n, s.k, s.k, blob.data(), serial_for);
  const PackedWeightView pw = view_packed_weight(blob.data(), static_cast<int64_t>(blob.size()), "w");
  verify_packed_weight(pw, "w");
  const int64_t kp = pw.header.k_padded, nr = pw.layout.nr;
  std::vector<int32_t> sums(pw.header.n_padded);
  load_col_sums(pw, 0, pw.header.n_padded, sums.data());
  const size_t stride = static_cast<size_t>(kp) * g.a_elem_bytes;
  std::vector<uint8_t> apack(s.m * stride);
  std::vector<const int8_t*> rows_in(s.m);
  for (int64_t i = 0; i < s.m; ++i) rows_in[i] = a.data() + i * s.k;
  kern.pack_a_rows(rows_in.data(), s.m, s.k, kp, apack.data(), stride);
  std::vector<int32_t> c(s.m * s.n), tile(g.mr * nr);
  for (int64_t r = 0; r < s.m; r += g.mr) {
    const int rows = static_cast<int>(std::min<int64_t>(g.mr, s.m - r));
    for (int64_t p = 0; p < pw.header.n_padded / nr; ++p) {
      (tile_fn ? tile_fn : kern.tile)(apack.data() + r * stride, stride, rows, pw.panels + p * kp * nr,
                                      sums.data() + p * nr, pw.layout, kp, tile.data());
      for (int i = 0; i < rows; ++i)
        for (int64_t j = 0; j < nr && p * nr + j < s.n; ++j) c[(r + i) * s.n + p * nr + j] = tile[i * nr + j];
    }
  }
  return c;
}

std::vector<int8_t> random_int8(std::mt19937_64& rng, int64_t count, int lo, int hi) {
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<int8_t> v(count);
  for (auto& x : v) x = static_cast<int8_t>(d(rng));
  return v;
}

std::vector<Shape> sweep_shapes(std::mt19937_64& rng, int count) {
  std::vector<Shape> shapes;
  for (int64_t m = 1; m <= 8; ++m) shapes.push_back({m, 1 + 7 * m, 5 + 11 * m});
  shapes.push_back({1, 16, 4});
  shapes.push_back({3, 33, 16384});
  shapes.push_back({2, 17, 16387});
  shapes.push_back({9, 100, 4096});
  // Every row count of a tile (and of two tiles) at a long K; K not a multiple of 4 or 8 exercises padding.
  for (int64_t m = 1; m <= 8; ++m) shapes.push_back({m, 3 + 5 * m, 16384 + 3 * m});
  std::uniform_int_distribution<int64_t> dm(1, 24), dn(1, 80), dk(1, 700);
  while (static_cast<int>(shapes.size()) < count) shapes.push_back({dm(rng), dn(rng), dk(rng)});
  return shapes;
}

// Smallest A value the variant's tile takes (gemm() sends -128 elsewhere for the others: test_driver_int8_min).
int a_min(const MicroKernel& kern) { return kern.a_excludes_int8_min ? -127 : -128; }

void test_matmul_sweep(const MicroKernel& kern, const std::vector<Shape>& shapes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t mismatches = 0;
  for (const Shape& s : shapes) {
    const auto a = random_int8(rng, s.m * s.k, a_min(kern), 127), w = random_int8(rng, s.n * s.k, -128, 127);
    const auto want = reference_matmul(a, w, s);
    const auto got = kernel_matmul(kern, a, w, s);
    for (int64_t i = 0; i < s.m * s.n; ++i)
      if (got[i] != want[i]) {
        if (mismatches++ < 5)
          CHECK(false, "%s: M=%" PRId64 " N=%" PRId64 " K=%" PRId64 " element %" PRId64 ": got %d want %" PRId64,
                kern.name, s.m, s.n, s.k, i, got[i], want[i]);
      }
  }
  std::printf("  %-12s matmul sweep: %zu shapes, %" PRId64 " mismatches\n", kern.name, shapes.size(), mismatches);
}

// A tile over several consecutive panels at once: the decode tile (MicroKernel::two_panel_rows: 2 panels, up to
// kTwoPanelMaxRows rows) and the wide prefill tile (wide_tile: geometry().wide_panels panels, up to wide_mr rows).
// Every row count from 1 up over the sweep's shapes against each run of consecutive panels, exact against the int64
// reference (the sweep's long K included).
using PanelGroupTile = decltype(MicroKernel::two_panel_rows);

void test_panel_group_tile(const MicroKernel& kern, const char* what, PanelGroupTile tile, int panels, int max_rows,
                           const std::vector<Shape>& shapes, uint64_t seed) {
  if (!tile) return;
  if (panels < 1 || max_rows < 1 || max_rows > 8) {  // (rows[] below holds 8)
    CHECK(false, "%s: %s geometry %d panels x %d rows", kern.name, what, panels, max_rows);
    return;
  }
  std::mt19937_64 rng(seed);
  int64_t mismatches = 0, groups = 0;
  for (const Shape& shape : shapes) {
    const int64_t nr = kern.geometry().layout.nr;
    const Shape s{1 + (shape.m - 1) % max_rows, shape.n + (panels - 1) * nr, shape.k};  // >= `panels` panels
    const auto a = random_int8(rng, s.m * s.k, a_min(kern), 127), w = random_int8(rng, s.n * s.k, -128, 127);
    const auto want = reference_matmul(a, w, s);
    std::vector<uint8_t> blob(packed_weight_nbytes(s.n, s.k, kern.geometry().layout, "w"));
    pack_weight(kern, w.data(), s.n, s.k, s.k, blob.data(), serial_for);
    const PackedWeightView pw = view_packed_weight(blob.data(), static_cast<int64_t>(blob.size()), "w");
    const int64_t kp = pw.header.k_padded, width = panels * nr;
    std::vector<int32_t> sums(pw.header.n_padded), c(s.m * width);
    load_col_sums(pw, 0, pw.header.n_padded, sums.data());
    const size_t stride = static_cast<size_t>(kp) * kern.geometry().a_elem_bytes;
    std::vector<uint8_t> apack(s.m * stride);
    const int8_t* rows[8];
    for (int64_t i = 0; i < s.m; ++i) rows[i] = a.data() + i * s.k;
    kern.pack_a_rows(rows, s.m, s.k, kp, apack.data(), stride);
    for (int64_t p = 0; p + panels <= pw.header.n_padded / nr; ++p, ++groups) {
      tile(apack.data(), stride, static_cast<int>(s.m), pw.panels + p * pw.panel_bytes, pw.panel_bytes,
           sums.data() + p * nr, pw.layout, kp, c.data());
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < width && p * nr + j < s.n; ++j)
          if (c[i * width + j] != want[i * s.n + p * nr + j] && mismatches++ < 5)
            CHECK(false, "%s: %s M=%" PRId64 " N=%" PRId64 " K=%" PRId64 " row %" PRId64 " panel %" PRId64
                  " column %" PRId64 ": got %d want %" PRId64, kern.name, what, s.m, s.n, s.k, i, p, j,
                  c[i * width + j], want[i * s.n + p * nr + j]);
    }
  }
  std::printf("  %-12s %s: %" PRId64 " runs of %d panels, %" PRId64 " mismatches\n", kern.name, what, groups, panels,
              mismatches);
}

// The tile for small rows (MicroKernel::a_row_small / tile_small): rows of small values with one 127 each (as
// per-token quantization makes them) are small and exact against the int64 reference on every sweep shape (weights
// in [-128, 127]); at the bound, a row whose four |a| of one int16 lane (k, k + 1, k + 4, k + 5 or k + 2, k + 3,
// k + 6, k + 7 from k = 0 mod 8) sum to 255, all negative, is small and exact against weights of -128 (every product
// +128 |a|: the lane reaches 128 * 255 = 32640), in every such lane position, a tail shorter than 32 k included, and
// 256 (32768, past int16) is not small.
void test_tile_small(const MicroKernel& kern, const std::vector<Shape>& shapes, uint64_t seed) {
  CHECK(!kern.a_row_small == !kern.tile_small, "%s: a_row_small and tile_small come together", kern.name);
  CHECK(!(kern.tile_small && kern.wide_tile), "%s: a variant sets tile_small or wide_tile, not both (the wide tile's "
        "rows never ask for small rows)", kern.name);
  if (!kern.tile_small) return;
  std::mt19937_64 rng(seed);
  int64_t mismatches = 0, not_small = 0;
  std::uniform_int_distribution<int64_t> pick(0, 1 << 30);
  for (const Shape& s : shapes) {
    auto a = random_int8(rng, s.m * s.k, -32, 32);
    for (int64_t i = 0; i < s.m; ++i) a[i * s.k + pick(rng) % s.k] = pick(rng) % 2 ? 127 : -127;
    const auto w = random_int8(rng, s.n * s.k, -128, 127);
    for (int64_t i = 0; i < s.m; ++i) not_small += !kern.a_row_small(a.data() + i * s.k, s.k);
    const auto want = reference_matmul(a, w, s);
    const auto got = kernel_matmul(kern, a, w, s, kern.tile_small);
    for (int64_t i = 0; i < s.m * s.n; ++i)
      if (got[i] != want[i] && mismatches++ < 5)
        CHECK(false, "%s: tile_small M=%" PRId64 " N=%" PRId64 " K=%" PRId64 " element %" PRId64 ": got %d want %" PRId64,
              kern.name, s.m, s.n, s.k, i, got[i], want[i]);
  }
  CHECK(not_small == 0, "%s: %" PRId64 " rows of |a| <= 32 and one 127 not small", kern.name, not_small);
  int64_t bound_cases = 0;
  for (const int64_t k : {int64_t{64}, int64_t{40}})
    for (int64_t block = 0; block + 8 <= k; block += 8)
      for (const int first : {0, 2}) {  // the lane's pairs: k, k + 1 with k + 4, k + 5; or k + 2, k + 3 with k + 6, k + 7
        for (const int total : {255, 256}) {
          const Shape s{1, 16, k};
          std::vector<int8_t> a(k, 0);
          const int64_t at = block + first;
          a[at] = -127, a[at + 1] = -127, a[at + 4] = static_cast<int8_t>(254 + 1 - total), a[at + 5] = -1;
          const std::vector<int8_t> w(s.n * k, -128);
          const bool small = kern.a_row_small(a.data(), k);
          CHECK(small == (total <= 255), "%s: a row whose lane sums to %d at k %" PRId64 " (K=%" PRId64 ") %s small",
                kern.name, total, at, k, small ? "is" : "is not");
          if (!small) continue;
          ++bound_cases;
          const auto want = reference_matmul(a, w, s);
          const auto got = kernel_matmul(kern, a, w, s, kern.tile_small);
          CHECK(got == std::vector<int32_t>(want.begin(), want.end()), "%s: tile_small at the bound, k %" PRId64
                " (K=%" PRId64 "): got %d want %" PRId64, kern.name, at, k, got[0], want[0]);
        }
      }
  std::printf("  %-12s tile_small: %zu shapes + %" PRId64 " rows at the bound, %" PRId64 " mismatches\n", kern.name,
              shapes.size(), bound_cases, mismatches);
}

// Extremes at the largest allowed K: every product +-2^14 must accumulate without int32 overflow.
void test_extreme_k(const MicroKernel& kern) {
  const Shape s{2, 3, kMaxK};
  std::vector<int8_t> a(s.m * s.k, static_cast<int8_t>(a_min(kern))), w(s.n * s.k, -128);
  for (int64_t k = 0; k < s.k; ++k) a[s.k + k] = 127;  // row 1: 127 * -128
  for (int64_t k = 0; k < s.k; ++k) w[2 * s.k + k] = 127;  // col 2: mixed
  const auto want = reference_matmul(a, w, s);
  const auto got = kernel_matmul(kern, a, w, s);
  bool ok = true;
  for (size_t i = 0; i < got.size(); ++i) ok &= got[i] == want[i];
  CHECK(ok, "%s: extreme values at K=%" PRId64 " overflowed or mismatched", kern.name, s.k);
  std::printf("  %-12s extreme K=%" PRId64 ": %s\n", kern.name, s.k, ok ? "exact" : "WRONG");
}

uint16_t bits16_of(FloatKind kind, float v) {
  return kind == FloatKind::bf16 ? float_to_bf16_bits(v) : float_to_f16_bits(v);
}

// Quantization must give the same int8 values and the same amax bits as the reference, incl. ties.
void test_quantization(const MicroKernel& kern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 3.f);
  int64_t mismatches = 0, rows = 0;
  for (FloatKind kind : {FloatKind::f32, FloatKind::bf16, FloatKind::f16}) {
    for (int64_t k : {1, 7, 8, 31, 32, 33, 64, 100, 1000, 4099}) {
      std::vector<float> vals(k);
      for (auto& v : vals) v = nd(rng);
      // Exact halves after scaling: with amax = 127, x * (127 / 127) = x, so x.5 values are ties.
      for (int64_t i = 0; i < k; i += 3) vals[i] = static_cast<float>(static_cast<int>(i % 50) - 25) + 0.5f;
      vals[k / 2] = 127.f;
      std::vector<uint16_t> half(k);
      for (int64_t i = 0; i < k; ++i) half[i] = bits16_of(kind, vals[i]);
      const void* x = kind == FloatKind::f32 ? static_cast<const void*>(vals.data()) : half.data();
      const uint32_t want_amax = ref_row_absmax_bits(x, kind, k), got_amax = kern.row_absmax_bits(x, kind, k);
      CHECK(want_amax == got_amax, "%s: amax bits differ (k=%" PRId64 ")", kern.name, k);
      for (float inv : {1.0f, 127.f / 3.7f}) {
        std::vector<int8_t> want(k), got(k);
        ref_quantize_row(x, kind, k, inv, want.data());
        kern.quantize_row(x, kind, k, inv, got.data());
        for (int64_t i = 0; i < k; ++i) mismatches += want[i] != got[i];
        ++rows;
      }
    }
  }
  // Inf/NaN anywhere in a row must be reported by the amax pass (the driver refuses such rows).
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    std::vector<float> vals(45, 1.f);
    vals[40] = bad;
    CHECK(kern.row_absmax_bits(vals.data(), FloatKind::f32, 45) >= 0x7f800000u, "%s: non-finite not detected",
          kern.name);
  }
  CHECK(mismatches == 0, "%s: %" PRId64 " quantized values differ from the reference", kern.name, mismatches);
  std::printf("  %-12s quantization: %" PRId64 " rows, %" PRId64 " mismatches\n", kern.name, rows, mismatches);
}

// Portable pseudo-random bytes (splitmix64): unlike std::uniform_int_distribution, whose algorithm is
// implementation-specific, the sequence is the same on every arch and standard library, so the hash
// below is a cross-arch constant.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int8_t next_int8() { return static_cast<int8_t>(static_cast<uint8_t>(next() >> 56)); }  // all of -128..127
};

// FNV-1a (64-bit) over the int32 values as little-endian bytes, independent of host byte order.
uint64_t fnv1a_int32(const std::vector<int32_t>& v) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t x : v) {
    const uint32_t u = static_cast<uint32_t>(x);
    for (int b = 0; b < 4; ++b) h = (h ^ ((u >> (8 * b)) & 0xffu)) * 0x100000001b3ull;
  }
  return h;
}

// Shared test vectors: the int32 accumulators of one fixed 13x77x1000 problem hash to the same constant on
// every arch (x86_64, aarch64, ppc64le) and in every variant. The constant was computed with the ref variant
// (A in [-127, 127] since the AVX2 tile's vpsignb trick, see a_excludes_int8_min).
constexpr uint64_t kSharedVectorsHash = 0x5324385a12969a69ull;
void test_shared_vectors(const MicroKernel& kern) {
  const Shape s{13, 77, 1000};
  SplitMix64 gen{0x5738a8c0ffee2026ull};
  std::vector<int8_t> a(s.m * s.k), w(s.n * s.k);
  for (auto& x : a) x = std::max<int8_t>(gen.next_int8(), -127);  // A as the quantizer makes it; W all of int8
  for (auto& x : w) x = gen.next_int8();
  const uint64_t got = fnv1a_int32(kernel_matmul(kern, a, w, s));
  CHECK(got == kSharedVectorsHash, "%s: shared test vectors hash 0x%016" PRIx64 ", expected 0x%016" PRIx64,
        kern.name, got, kSharedVectorsHash);
  std::printf("  %-12s shared vectors 13x77x1000: hash 0x%016" PRIx64 " %s\n", kern.name, got,
              got == kSharedVectorsHash ? "(matches)" : "(WRONG)");
}

// FNV-1a (64-bit) over fp32 values' bits, as little-endian bytes.
uint64_t fnv1a_float(const std::vector<float>& v) {
  std::vector<int32_t> bits(v.size());
  std::memcpy(bits.data(), v.data(), v.size() * 4);
  return fnv1a_int32(bits);
}

// W4A8 shared test vectors: linear() on one fixed 13x77x1000 problem with int4 weights in groups of 32 with
// minimums (K padded to 1024), every value and scale exactly representable and drawn from SplitMix64, equals a scalar
// implementation of the fixed fp32 group order bit for bit, and its fp32 output bits hash to one constant on every
// arch and variant (computed with the ref variant). Every variant runs it: its int4 tile or the generic widening
// path.
constexpr uint64_t kInt4SharedVectorsHash = 0xbf8c27032e2b7787ull;
void test_int4_shared_vectors(const MicroKernel& kern) {
  const Shape s{13, 77, 1000};
  const int group_log2 = 5;
  const int64_t group = int64_t{1} << group_log2, groups = (s.k + group - 1) / group;
  SplitMix64 gen{0x1234abcd5678ef01ull};
  std::vector<float> x(s.m * s.k), scales(s.n * groups), mins(s.n * groups), w_scale(s.n, 1.f), out(s.m * s.n);
  std::vector<int8_t> q(s.n * s.k);
  for (auto& v : x) v = static_cast<float>(gen.next_int8()) / 16.f;
  for (auto& v : q) v = static_cast<int8_t>(gen.next_int8() >> 4);  // all of -8..7
  for (auto& v : scales) v = static_cast<float>(1 + (gen.next() >> 58)) / 1024.f;
  for (auto& v : mins) v = static_cast<float>(gen.next_int8()) / 512.f;
  const WeightFormat format{WeightScheme::int4_min, group_log2};
  std::vector<uint8_t> blob(packed_weight_nbytes(s.n, s.k, kern.geometry().layout, "w", format));
  pack_weight_int4(kern, q.data(), s.n, s.k, s.k, scales.data(), mins.data(), format, blob.data(), serial_for);
  const PackedWeightView view = view_packed_weight(blob.data(), blob.size(), "w");
  std::vector<uint8_t> scratch(linear_scratch_nbytes(kern, s.m, s.k, blob_k_padded(blob), groups));
  std::vector<float> a_scales(s.m);
  CHECK(linear(kern, x.data(), FloatKind::f32, s.m, s.k, nullptr, view,
               {nullptr, w_scale.data(), nullptr, out.data(), FloatKind::f32, s.n}, a_scales.data(), scratch.data(),
               serial_for) == -1, "%s: finite rows reported bad", kern.name);
  // the scalar implementation: the driver's quantization (checked per variant above), then per group
  // t = t + float(acc_g) * scale_g, t = t + float(sum_g a) * min_g; out = t * (a_scale * w_scale)
  int64_t mismatches = 0;
  std::vector<int8_t> a(s.k);
  for (int64_t i = 0; i < s.m; ++i) {
    uint32_t bits = ref_row_absmax_bits(x.data() + i * s.k, FloatKind::f32, s.k);
    float amax;
    std::memcpy(&amax, &bits, 4);
    amax = std::max(amax, kAmaxEps);
    ref_quantize_row(x.data() + i * s.k, FloatKind::f32, s.k, 127.f / amax, a.data());
    for (int64_t j = 0; j < s.n; ++j) {
      float t = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int64_t acc = 0, a_sum = 0;
        for (int64_t c = g * group; c < std::min(s.k, (g + 1) * group); ++c)
          acc += int64_t{a[c]} * q[j * s.k + c], a_sum += a[c];
        t = t + static_cast<float>(acc) * scales[j * groups + g];
        t = t + static_cast<float>(a_sum) * mins[j * groups + g];
      }
      const float want = t * ((amax / 127.f) * w_scale[j]);
      mismatches += std::memcmp(&want, &out[i * s.n + j], 4) != 0;
    }
  }
  // Decode-sized blocks of rows (int4_two_panel_rows where the variant has it; 77 columns are two pairs of panels and
  // one more) give the same bits as the rows in one block: each row alone and the rows two at a time, with minimums
  // (this blob) and symmetric (the same values packed without them). The same values with the scales stored as fp16
  // (every scale here is an fp16 value) give the fp32-stored blob's bits.
  std::vector<std::vector<uint8_t>> blobs;
  std::vector<PackedWeightView> views;
  for (const WeightScheme scheme : {WeightScheme::int4_min, WeightScheme::int4})
    for (const ScaleStorage storage : {ScaleStorage::f32, ScaleStorage::f16}) {
      const WeightFormat f{scheme, group_log2, storage};
      blobs.emplace_back(packed_weight_nbytes(s.n, s.k, kern.geometry().layout, "w", f));
      pack_weight_int4(kern, q.data(), s.n, s.k, s.k, scales.data(),
                       scheme == WeightScheme::int4_min ? mins.data() : nullptr, f, blobs.back().data(), serial_for);
    }
  for (const auto& b : blobs) views.push_back(view_packed_weight(b.data(), b.size(), "w"));
  CHECK(blobs[1].size() < blobs[0].size() && blobs[3].size() < blobs[2].size(),
        "%s: fp16 scales did not shrink the blob", kern.name);
  int64_t row_mismatches = 0, storage_mismatches = 0;
  std::vector<float> block_out(s.m * s.n), rows_out(kTwoPanelMaxRows * s.n), f32_out(s.m * s.n);
  for (size_t b = 0; b < views.size(); ++b) {
    const PackedWeightView* w = &views[b];
    linear(kern, x.data(), FloatKind::f32, s.m, s.k, nullptr, *w,
           {nullptr, w_scale.data(), nullptr, block_out.data(), FloatKind::f32, s.n}, a_scales.data(), scratch.data(),
           serial_for);
    if (w->format.scales == ScaleStorage::f32)
      f32_out = block_out;
    else
      storage_mismatches += std::memcmp(f32_out.data(), block_out.data(), s.m * s.n * 4) != 0;
    for (int64_t rows = 1; rows <= kTwoPanelMaxRows; ++rows)
      for (int64_t i = 0; i + rows <= s.m; i += rows) {
        linear(kern, x.data() + i * s.k, FloatKind::f32, rows, s.k, nullptr, *w,
               {nullptr, w_scale.data(), nullptr, rows_out.data(), FloatKind::f32, s.n}, a_scales.data(),
               scratch.data(), serial_for);
        row_mismatches += std::memcmp(rows_out.data(), block_out.data() + i * s.n, rows * s.n * 4) != 0;
      }
  }
  CHECK(row_mismatches == 0, "%s: int4 shared vectors: %" PRId64 " blocks of 1-%d rows differ when computed alone",
        kern.name, row_mismatches, kTwoPanelMaxRows);
  CHECK(storage_mismatches == 0, "%s: int4 shared vectors: %" PRId64 " blobs with fp16-stored scales differ from fp32",
        kern.name, storage_mismatches);
  const uint64_t got = fnv1a_float(out);
  CHECK(mismatches == 0, "%s: int4 shared vectors: %" PRId64 " outputs differ from the scalar implementation",
        kern.name, mismatches);
  CHECK(got == kInt4SharedVectorsHash, "%s: int4 shared vectors hash 0x%016" PRIx64 ", expected 0x%016" PRIx64,
        kern.name, got, kInt4SharedVectorsHash);
  std::printf("  %-12s int4 shared vectors 13x77x1000 g32: %" PRId64 " mismatches, hash 0x%016" PRIx64 " %s\n",
              kern.name, mismatches, got, got == kInt4SharedVectorsHash ? "(matches)" : "(WRONG)");
}

// silu(gate) * up through the kernel (its own ISA's copy of activation.h, when it has one) gives the bits of the
// reference's baseline copy: over a sweep of gate values across exp_poly's clamps, and at odd lengths (vector tails).
void test_silu_mul_bits(const MicroKernel& kern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> wide(-120.f, 120.f), narrow(-6.f, 6.f);
  for (const int64_t n : {1, 7, 16, 33, 1536}) {
    std::vector<float> gate(n), up(n);
    for (int64_t j = 0; j < n; ++j) gate[j] = j % 2 ? wide(rng) : narrow(rng), up[j] = narrow(rng);
    gate[0] = n % 2 ? -0.f : 1e-30f;
    std::vector<float> want = gate, got = gate;
    silu_mul(kRefKernel, want.data(), up.data(), n);
    silu_mul(kern, got.data(), up.data(), n);
    CHECK(std::memcmp(want.data(), got.data(), n * 4) == 0, "%s: silu_mul differs from the reference's (n = %lld)",
          kern.name, static_cast<long long>(n));
  }
}

// A ParallelFor over `threads` real threads, the range split in equal shares.
ParallelFor threaded_for(int threads) {
  return ParallelFor(
      [threads](int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& body) {
        std::vector<std::thread> workers;
        const int64_t share = (end - begin + threads - 1) / threads;
        for (int64_t b = begin; b < end; b += share) workers.emplace_back(body, b, std::min(end, b + share));
        for (auto& t : workers) t.join();
      },
      threads);
}

// The decode attention (decode_attention: key blocks, their combine, the variant's copy of a block) over fp32, fp16
// and int8 caches stored by store_kv_row: the reference's bits in every variant and at 1, 2 and 3 threads, within 1e-5
// of the fp64 attention over the values as stored (an int8 row: q * scale), NaN out for the KV head of an Inf key (an
// int8 row holding Inf: scale NaN), an all-zero int8 row stored as zeros.
void test_decode_attention_bits(const MicroKernel& kern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  int64_t cases = 0;
  // groups of 3 query heads a KV head, and of 10 (more than one attend_key_block call takes: kMaxAttendHeads)
  for (const auto [heads, kv_heads] : {std::pair<int64_t, int64_t>{6, 2}, {20, 2}}) {
    const int64_t group = heads / kv_heads;
    // keys around the x86 copy's blocks of 8, its value tiles of 128 and the key blocks of 256; d: multiples of 16
    // (the vector path: 2, 4, 6 or 8 vectors in the last 64 dims) and others (the row's); the cache longer than the
    // keys read; every array 4 bytes into its allocation, as a tensor's data may be
    for (const KvKind kind : {KvKind::f32, KvKind::f16, KvKind::i8})
      for (const int64_t keys : {1, 7, 9, 129, 256, 257, 700})
        for (const int64_t d : {2, 16, 48, 64, 70, 128}) {
          const int64_t length = keys + 3, rows = kv_heads * length, bytes = kv_element_bytes(kind);
          std::vector<float> q_(heads * d + 1), x(rows * d), k_scale_(rows + 1), v_scale_(rows + 1);
          std::vector<uint8_t> k_(rows * d * bytes + 4), v_(rows * d * bytes + 4);
          float *q = q_.data() + 1, *k_scale = k_scale_.data() + 1, *v_scale = v_scale_.data() + 1;
          for (int64_t i = 0; i < heads * d; ++i) q[i] = nd(rng);
          std::vector<double> stored_k(rows * d), stored_v(rows * d);
          for (auto [cache, scales, stored] : {std::tuple{k_.data() + 4, k_scale, &stored_k},
                                               std::tuple{v_.data() + 4, v_scale, &stored_v}}) {
            for (float& v : x) v = nd(rng);
            std::fill(x.begin() + 5 * d, x.begin() + 6 * d, 0.f);  // row 5 (head 0 or 1) all zeros
            for (int64_t r = 0; r < rows; ++r) store_kv_row(kern, x.data() + r * d, d, kind, cache, scales, r);
            for (int64_t i = 0; i < rows * d; ++i) {  // the values as stored, in fp64
              const uint8_t* at = cache + i * bytes;
              if (kind == KvKind::f32) {
                float f32;
                std::memcpy(&f32, at, 4);
                (*stored)[i] = f32;
              } else if (kind == KvKind::f16) {
                uint16_t f16;
                std::memcpy(&f16, at, 2);
                (*stored)[i] = f16_bits_to_float(f16);
              } else {
                (*stored)[i] = static_cast<int8_t>(*at) * static_cast<double>(scales[i / d]);
              }
            }
            if (kind == KvKind::i8)
              CHECK(std::all_of(cache + 5 * d, cache + 6 * d, [](uint8_t b) { return b == 0; }),
                    "store_kv_row: an all-zero int8 row is not stored as zeros");
          }
          const KvRows cache{k_.data() + 4, v_.data() + 4, kind == KvKind::i8 ? k_scale : nullptr,
                             kind == KvKind::i8 ? v_scale : nullptr, kind};
          const float scale = 1.f / std::sqrt(static_cast<float>(d));
          std::vector<float> scratch(decode_attention_scratch_floats(heads, keys, d)), want(heads * d),
              got_(heads * d + 1);
          float* got = got_.data() + 1;
          decode_attention(kRefKernel, q, heads, cache, kv_heads, length, keys, d, scale, scratch.data(), want.data(),
                           serial_for);
          for (const int threads : {1, 2, 3}) {
            decode_attention(kern, q, heads, cache, kv_heads, length, keys, d, scale, scratch.data(), got,
                             threads == 1 ? ParallelFor(serial_for) : threaded_for(threads));
            CHECK(std::memcmp(want.data(), got, heads * d * 4) == 0, "%s: decode_attention differs from the "
                  "reference's (kind %d, keys = %lld, d = %lld, %d threads)", kern.name, static_cast<int>(kind),
                  static_cast<long long>(keys), static_cast<long long>(d), threads);
          }
          double worst = 0;
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t g = h / group;
            std::vector<double> p(keys);
            double max = -1e300, sum = 0;
            for (int64_t j = 0; j < keys; ++j) {
              for (int64_t e = 0; e < d; ++e)
                p[j] += static_cast<double>(q[h * d + e]) * stored_k[(g * length + j) * d + e];
              p[j] *= scale, max = std::max(max, p[j]);
            }
            for (double& v : p) sum += (v = std::exp(v - max));
            for (int64_t e = 0; e < d; ++e) {
              double exact = 0;
              for (int64_t j = 0; j < keys; ++j) exact += p[j] / sum * stored_v[(g * length + j) * d + e];
              worst = std::max(worst, std::fabs(got[h * d + e] - exact));
            }
          }
          CHECK(worst < 1e-5, "%s: decode_attention off by %g from the fp64 attention (kind %d, keys = %lld, d = %lld)",
                kern.name, worst, static_cast<int>(kind), static_cast<long long>(keys), static_cast<long long>(d));
          // an Inf in the last KV head's last key read: its query heads NaN, the other heads' untouched
          std::vector<float> poisoned(d, 1.f);
          poisoned[d - 1] = std::numeric_limits<float>::infinity();
          store_kv_row(kern, poisoned.data(), d, kind, k_.data() + 4, k_scale, (kv_heads - 1) * length + keys - 1);
          decode_attention(kern, q, heads, cache, kv_heads, length, keys, d, scale, scratch.data(), got,
                           threaded_for(2));
          const int64_t clean = (kv_heads - 1) * group * d;  // the floats of the untouched heads
          CHECK(std::all_of(got + clean, got + heads * d, [](float v) { return std::isnan(v); }) &&
                    std::memcmp(got, want.data(), clean * 4) == 0,
                "%s: decode_attention with an Inf key is not NaN in its KV head alone (kind %d, keys = %lld, d = %lld)",
                kern.name, static_cast<int>(kind), static_cast<long long>(keys), static_cast<long long>(d));
          ++cases;
        }
  }
  std::printf("  %-12s decode attention, fp32 / fp16 / int8 caches, groups of 3 and 10 heads, 1-3 threads: %" PRId64
              " cases\n", kern.name,
              cases);
}

// The causal softmax's numerators of attention scores through the kernel (its ISA's copy of activation.h, when it
// has one) give the bits of the reference's baseline copy, sum included, with the masked tail zeroed, at lengths
// around the 16 lanes; and they are a softmax's: divided by the returned sum they follow exp(s - max) / sum within
// exp_poly's 2e-7 (-inf, -Inf and NaN scores: see below).
void test_softmax_numerators_bits(const MicroKernel& kern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> score(-30.f, 30.f);
  for (const int64_t n : {1, 15, 16, 17, 70, 512}) {
    const int64_t len = n == 1 ? 1 : n - n / 3;
    std::vector<float> scores(n);
    for (float& v : scores) v = score(rng);
    std::vector<float> want = scores, got = scores;
    const float want_sum = softmax_numerators(kRefKernel, want.data(), len, n);
    const float got_sum = softmax_numerators(kern, got.data(), len, n);
    CHECK(std::memcmp(want.data(), got.data(), n * 4) == 0 && std::memcmp(&want_sum, &got_sum, 4) == 0,
          "%s: softmax_numerators differs from the reference's (n = %lld)", kern.name, static_cast<long long>(n));
    const double max = *std::max_element(scores.begin(), scores.begin() + len);
    double sum = 0, worst = 0;
    for (int64_t j = 0; j < len; ++j) sum += std::exp(static_cast<double>(scores[j]) - max);
    for (int64_t j = 0; j < n; ++j) {
      const double exact = j < len ? std::exp(static_cast<double>(scores[j]) - max) / sum : 0.0;
      worst = std::max(worst, std::fabs(static_cast<double>(got[j]) / got_sum - exact));
    }
    CHECK(worst < 2e-6, "%s: softmax_numerators / sum off by %g from exp(s - max) / sum (n = %lld)", kern.name,
          worst, static_cast<long long>(n));
    // a NaN, Inf or -Inf among the kept scores: a NaN row and sum (the masked tail still 0), in every copy
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      std::vector<float> poisoned = scores;
      poisoned[len - 1] = bad;
      const float poisoned_sum = softmax_numerators(kern, poisoned.data(), len, n);
      bool ok = std::isnan(poisoned_sum);
      for (int64_t j = 0; j < n; ++j) ok = ok && (j < len ? std::isnan(poisoned[j]) : poisoned[j] == 0.f);
      CHECK(ok, "%s: softmax_numerators of a row holding %g is not NaN (n = %lld)", kern.name, bad,
            static_cast<long long>(n));
    }
  }
}

// The whole driver (quantize, pack, gemm, epilogue) gives bit-identical outputs in every variant.
void test_driver_identical(const std::vector<const MicroKernel*>& kernels, uint64_t seed, const Shape& s) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(s.m * s.k), w_scale(s.n), bias(s.n);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w_scale) v = 0.01f + std::abs(nd(rng)) * 0.01f;
  for (auto& v : bias) v = nd(rng);
  const auto w = random_int8(rng, s.n * s.k, -127, 127);
  std::vector<float> first;
  for (const MicroKernel* kern : kernels) {
    std::vector<int8_t> q(s.m * s.k);
    std::vector<float> scales(s.m), out(s.m * s.n);
    CHECK(quantize_rows(*kern, x.data(), FloatKind::f32, s.m, s.k, s.k, q.data(), s.k, scales.data(), serial_for) == -1,
          "%s: finite rows reported bad", kern->name);
    std::vector<uint8_t> blob(packed_weight_nbytes(s.n, s.k, kern->geometry().layout, "w"));
    pack_weight(*kern, w.data(), s.n, s.k, s.k, blob.data(), serial_for);
    const PackedWeightView view = view_packed_weight(blob.data(), blob.size(), "w");
    std::vector<uint8_t> scratch(linear_scratch_nbytes(*kern, s.m, s.k, blob_k_padded(blob)));
    gemm(*kern, q.data(), s.m, s.k, view, {scales.data(), w_scale.data(), bias.data(), out.data(), FloatKind::f32, s.n},
         scratch.data(), serial_for);
    if (first.empty()) first = out;
    CHECK(std::memcmp(first.data(), out.data(), out.size() * 4) == 0, "%s: driver output differs from %s", kern->name,
          kernels.front()->name);
    // linear() (quantize + pack + GEMM in its own passes) and the raw int32 accumulators + scale_accumulators give
    // the same bits.
    std::vector<float> fused(s.m * s.n), fused_scales(s.m), rescaled(s.m * s.n);
    CHECK(linear(*kern, x.data(), FloatKind::f32, s.m, s.k, nullptr, view,
                 {nullptr, w_scale.data(), bias.data(), fused.data(), FloatKind::f32, s.n}, fused_scales.data(),
                 scratch.data(), serial_for) == -1,
          "%s: linear reported a bad row", kern->name);
    std::vector<int32_t> acc(s.m * s.n);
    GemmOutput raw{scales.data(), w_scale.data(), bias.data(), acc.data(), FloatKind::f32, s.n};
    raw.raw_int32 = true;
    gemm(*kern, q.data(), s.m, s.k, view, raw, scratch.data(), serial_for);
    scale_accumulators(acc.data(), s.m, s.n, s.n, {scales.data(), w_scale.data(), bias.data(), rescaled.data(),
                                                   FloatKind::f32, s.n}, serial_for);
    CHECK(std::memcmp(fused.data(), out.data(), out.size() * 4) == 0 &&
              std::memcmp(fused_scales.data(), scales.data(), scales.size() * 4) == 0,
          "%s: linear() differs from quantize_rows + gemm", kern->name);
    CHECK(std::memcmp(rescaled.data(), out.data(), out.size() * 4) == 0,
          "%s: raw int32 + scale_accumulators differs from gemm", kern->name);
  }
  std::printf("  driver output bit-identical across %zu variants, M=%" PRId64 " N=%" PRId64 " K=%" PRId64 "\n",
              kernels.size(), s.m, s.n, s.k);
}

// Decode claims grow where few threads share a layer (gemm_packed: ParallelFor::threads): the same bits whatever
// the thread count says, int8 and int4 weights, decode rows (1 and 2) of a layer wide and deep enough that the claim
// size differs between 1, 2, 3 and 64 threads (2048 x 4096: 16, 8, 4 (rounded) and 4 panels with the avx2 tiles).
void test_decode_claims_by_thread_count(const MicroKernel& kern, uint64_t seed) {
  const int64_t n = 2048, k = 4096, groups = k / 32;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(2 * k), w_scale(n, 0.02f), group_scales(n * groups);
  for (auto& v : x) v = nd(rng);
  for (auto& v : group_scales) v = 0.01f + std::abs(nd(rng)) * 0.01f;
  const auto w8 = random_int8(rng, n * k, -127, 127), q4 = random_int8(rng, n * k, -8, 7);
  const WeightFormat int4_format{WeightScheme::int4, 5};
  std::vector<uint8_t> blob8(packed_weight_nbytes(n, k, kern.geometry().layout, "w")),
      blob4(packed_weight_nbytes(n, k, kern.geometry().layout, "w", int4_format));
  pack_weight(kern, w8.data(), n, k, k, blob8.data(), serial_for);
  pack_weight_int4(kern, q4.data(), n, k, k, group_scales.data(), nullptr, int4_format, blob4.data(), serial_for);
  int64_t mismatches = 0;
  for (const auto* blob : {&blob8, &blob4}) {
    const PackedWeightView view = view_packed_weight(blob->data(), blob->size(), "w");
    std::vector<uint8_t> scratch(linear_scratch_nbytes(kern, 2, k, blob_k_padded(*blob), view.int4() ? groups : 0));
    for (int64_t m = 1; m <= 2; ++m) {
      std::vector<float> first;
      for (const int threads : {1, 2, 3, 64}) {
        std::vector<float> out(m * n), a_scales(m);
        linear(kern, x.data(), FloatKind::f32, m, k, nullptr, view,
               {nullptr, w_scale.data(), nullptr, out.data(), FloatKind::f32, n}, a_scales.data(), scratch.data(),
               ParallelFor(serial_for, threads));
        if (first.empty()) first = out;
        mismatches += std::memcmp(first.data(), out.data(), out.size() * 4) != 0;
      }
    }
  }
  CHECK(mismatches == 0, "%s: decode output differs with the thread count (%" PRId64 " cases)", kern.name, mismatches);
  std::printf("  %-12s decode claims by thread count (1, 2, 3, 64), int8 and int4, M = 1, 2: %" PRId64
              " differ\n", kern.name, mismatches);
}

// Through the driver every variant takes all of int8 in A and W: a caller's A holding -128 (never produced by the
// quantizer) reaches variants whose tile excludes it through gemm()'s fallback; -128 weights reach every tile.
void test_driver_int8_min(const MicroKernel& kern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Shape s{6, 37, 515};
  auto a = random_int8(rng, s.m * s.k, -128, 127), w = random_int8(rng, s.n * s.k, -128, 127);
  a[3 * s.k + 100] = -128;
  w[5 * s.k + 7] = -128;
  const auto want = reference_matmul(a, w, s);
  std::vector<uint8_t> blob(packed_weight_nbytes(s.n, s.k, kern.geometry().layout, "w"));
  pack_weight(kern, w.data(), s.n, s.k, s.k, blob.data(), serial_for);
  std::vector<uint8_t> scratch(gemm_scratch_nbytes(kern, s.m, blob_k_padded(blob)));
  std::vector<int32_t> out(s.m * s.n);
  GemmOutput raw{nullptr, nullptr, nullptr, out.data(), FloatKind::f32, s.n};
  raw.raw_int32 = true;
  gemm(kern, a.data(), s.m, s.k, view_packed_weight(blob.data(), blob.size(), "w"), raw, scratch.data(), serial_for);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < s.m * s.n; ++i) mismatches += out[i] != want[i];
  CHECK(mismatches == 0, "%s: driver with -128 in A and W: %" PRId64 " mismatches", kern.name, mismatches);
  std::printf("  %-12s driver, -128 in A and W: %" PRId64 " mismatches\n", kern.name, mismatches);
}

// dynamic_for over real threads: every item claimed exactly once, and a variant's per-thread hooks run once on each
// thread that took a claim, enter before its first claim and leave after its last.
thread_local int t_entered = 0, t_left = 0;
std::atomic<int> g_enter_calls{0}, g_leave_calls{0};
void count_enter() { ++t_entered, ++g_enter_calls; }
void count_leave() { ++t_left, ++g_leave_calls; }

void test_dynamic_for_threads_and_hooks() {
  const ParallelFor four_threads = threaded_for(4);
  const int64_t count = 1000;
  std::vector<std::atomic<int>> hits(count);
  std::atomic<int> hook_errors{0};
  g_enter_calls = g_leave_calls = 0;
  dynamic_for(count, 7, four_threads, [&](int64_t t0, int64_t t1) {
    if (t_entered != 1 || t_left != 0) ++hook_errors;  // inside a claim: entered once, not yet left
    for (int64_t t = t0; t < t1; ++t) ++hits[t];
    std::this_thread::sleep_for(std::chrono::microseconds(20));  // long enough claims for the other threads to join
  }, count_enter, count_leave);
  int64_t wrong = 0;
  for (auto& h : hits) wrong += h.load() != 1;
  CHECK(wrong == 0 && hook_errors == 0 && g_enter_calls == g_leave_calls && g_enter_calls >= 1 &&
            g_enter_calls <= 4,
        "dynamic_for: %" PRId64 " items not run exactly once, %d hook errors, %d enters, %d leaves", wrong,
        hook_errors.load(), g_enter_calls.load(), g_leave_calls.load());
  std::printf("  dynamic_for on 4 threads: every item once, hooks balanced on %d threads\n", g_enter_calls.load());
}

// ---- Packed weights are untrusted input: every malformed blob is rejected (std::invalid_argument) or read exactly.

// Recomputes the checksum after an edit, as an adversary would, so the checks behind it are reached too.
void reseal(uint8_t* blob, int64_t nbytes) {
  const uint32_t c = packed_weight_checksum(blob, nbytes);
  std::memcpy(blob + kChecksumOffset, &c, 4);
}

template <typename T>
void put_field(uint8_t* blob, size_t offset, T value) {
  std::memcpy(blob + offset, &value, sizeof value);
}

// view + verify + (if the header still describes [n, k], as the ops check) the driver; "" if nothing threw.
std::string rejection(const MicroKernel& kern, const uint8_t* blob, int64_t nbytes, int64_t n, int64_t k,
                      std::vector<float>* out = nullptr) {
  try {
    const PackedWeightView v = view_packed_weight(blob, nbytes, "w");
    verify_packed_weight(v, "w");
    if (v.header.n != n || v.header.k != k) return "shape differs";
    if (out) {
      const int64_t m = 3;
      std::vector<int8_t> a(m * k);
      SplitMix64 gen{0x1234};
      for (auto& x : a) x = gen.next_int8();
      std::vector<float> a_scales(m, 0.5f), w_scales(n, 0.25f);
      out->assign(m * n, 0.f);
      std::vector<uint8_t> scratch(gemm_scratch_nbytes(kern, m, v.header.k_padded));
      gemm(kern, a.data(), m, k, v, {a_scales.data(), w_scales.data(), nullptr, out->data(), FloatKind::f32, n},
           scratch.data(), serial_for);
    }
    return "";
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
}

// The bits of float -> bf16 / fp16 (float_convert.h's rule) against round-to-nearest-even computed in double, over a
// sweep of float bit patterns (every sign, exponent and the mantissas' low and high bits, ties among them), and a row
// through store_row_from_float (the loop the compiler vectorizes) against the scalar rule element by element.
uint16_t rounded_bits_reference(float v, int mantissa_bits, int min_exponent, int max_exponent) {
  const uint32_t sign = std::signbit(v) ? 1u << 15 : 0u;
  const int exponent_bits = 15 - mantissa_bits;
  const uint32_t inf = ((1u << exponent_bits) - 1) << mantissa_bits;
  if (std::isnan(v)) return 0;  // checked apart
  double a = std::fabs(static_cast<double>(v));
  if (a == 0) return static_cast<uint16_t>(sign);
  if (std::isinf(a)) return static_cast<uint16_t>(sign | inf);
  const int e = std::max(std::ilogb(a), min_exponent);
  const double ulp = std::ldexp(1.0, e - mantissa_bits);
  a = std::nearbyint(a / ulp) * ulp;  // exact quotient (24 significant bits), rounded to nearest even
  if (a >= std::ldexp(1.0, max_exponent + 1)) return static_cast<uint16_t>(sign | inf);
  if (a < std::ldexp(1.0, min_exponent))  // subnormal (or zero): a / 2^(min_exponent - mantissa_bits)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(a / std::ldexp(1.0, min_exponent - mantissa_bits)));
  const int ea = std::ilogb(a);
  const uint32_t mantissa = static_cast<uint32_t>(std::ldexp(a, mantissa_bits - ea)) - (1u << mantissa_bits);
  const uint32_t biased = static_cast<uint32_t>(ea + (1 << (exponent_bits - 1)) - 1);
  return static_cast<uint16_t>(sign | biased << mantissa_bits | mantissa);
}

void test_float_conversions() {
  std::vector<float> values;
  for (uint64_t b = 0; b <= 0xffffffffull; b += 0x1001) values.push_back(float_of_bits(static_cast<uint32_t>(b)));
  for (uint32_t high = 0; high < 0x10000; high += 7)  // bf16 ties and their neighbours, fp16's at 13 bits
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0fffu, 0x1000u, 0x1001u, 0x3000u})
      values.push_back(float_of_bits(high << 16 | low));
  for (float v : {65504.f, 65519.99f, 65520.f, 65536.f, 6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f,
                  2.9802326e-08f, INFINITY, -INFINITY, NAN, -NAN})
    values.push_back(v);
  int64_t bf16_wrong = 0, f16_wrong = 0, nan_wrong = 0, row_wrong = 0;
  for (float v : values) {
    const uint16_t bf = float_to_bf16_bits(v), h = float_to_f16_bits(v);
    if (std::isnan(v)) {
      nan_wrong += !std::isnan(bf16_bits_to_float(bf)) || (h & 0x7fffu) != 0x7e00u ||
                   (h >> 15) != (bits_of_float(v) >> 31);
      continue;
    }
    bf16_wrong += bf != rounded_bits_reference(v, 7, -126, 127);
    f16_wrong += h != rounded_bits_reference(v, 10, -14, 15);
  }
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<uint16_t> row(n);
  for (FloatKind kind : {FloatKind::bf16, FloatKind::f16}) {
    store_row_from_float(row.data(), kind, values.data(), n);
    for (int64_t i = 0; i < n; ++i) row_wrong += row[i] != bits16_of(kind, values[i]);
  }
  CHECK(bf16_wrong + f16_wrong + nan_wrong + row_wrong == 0,
        "float conversions: %" PRId64 " bf16, %" PRId64 " fp16, %" PRId64 " NaN, %" PRId64 " row values wrong",
        bf16_wrong, f16_wrong, nan_wrong, row_wrong);
  std::printf("  float -> bf16 / fp16: %" PRId64 " values, round to nearest even as in double\n", n);
}

void test_crc32c() {
  const char* check = "123456789";  // CRC-32C check value 0xe3069283
  CHECK(crc32c(0, check, 9) == 0xe3069283u && crc32c_portable(0, check, 9) == 0xe3069283u, "crc32c check value");
  CHECK(crc32c(crc32c(0, check, 4), check + 4, 5) == 0xe3069283u, "crc32c does not chain");
  std::vector<uint8_t> buf(200000);
  SplitMix64 gen{0xc3c32c};
  for (auto& b : buf) b = static_cast<uint8_t>(gen.next());
  int64_t mismatches = 0, runs = 0;
  // Lengths around the SSE4.2 path's 3 x 8 KiB rounds and 8-byte steps, at every start alignment.
  for (size_t len : {0, 1, 7, 8, 9, 63, 64, 65, 8191, 24575, 24576, 24577, 49152 + 13, 199993})
    for (size_t off = 0; off < 8; ++off, ++runs)
      mismatches += crc32c(0x5a5a5a5a, buf.data() + off, len) != crc32c_portable(0x5a5a5a5a, buf.data() + off, len);
  CHECK(mismatches == 0, "crc32c: %" PRId64 " of %" PRId64 " dispatched results differ from the portable code",
        mismatches, runs);
  std::printf("  crc32c: check value, chaining, dispatched == portable on %" PRId64 " buffers\n", runs);
}

void test_packed_weight_rejections(const MicroKernel& kern) {
  const PanelLayout layout = kern.geometry().layout;
  const int64_t n = 37, k = 96;  // K = 96 is a whole number of k groups for kr = 4 and 8
  std::mt19937_64 rng(7);
  const auto w = random_int8(rng, n * k, -127, 127);
  const int64_t nbytes = packed_weight_nbytes(n, k, layout, "w");
  std::vector<uint8_t> good(nbytes);
  pack_weight(kern, w.data(), n, k, k, good.data(), serial_for);
  std::vector<float> want;
  CHECK(rejection(kern, good.data(), nbytes, n, k, &want).empty(), "%s: a fresh blob was rejected", kern.name);
  auto expect = [&](const char* what, std::vector<uint8_t> b, const char* needle) {
    const std::string why = rejection(kern, b.data(), static_cast<int64_t>(b.size()), n, k);
    CHECK(why.find(needle) != std::string::npos && why.size() < 400, "%s: %s: got '%s', expected '%s'", kern.name,
          what, why.c_str(), needle);
  };
  // An unterminated name, read with strlen in the layout-mismatch message before (ASan: heap over-read): body bytes
  // with no zero, and another panel depth, reach that message.
  std::vector<uint8_t> b = good;
  std::memset(b.data() + offsetof(PackedWeightHeader, packed_by), 'A', sizeof(PackedWeightHeader::packed_by));
  std::memset(b.data() + sizeof(PackedWeightHeader), 0x11, nbytes - sizeof(PackedWeightHeader));
  put_field<uint16_t>(b.data(), offsetof(PackedWeightHeader, kr), layout.kr == 8 ? 4 : 8);
  reseal(b.data(), nbytes);
  expect("unterminated packed_by", b, "packed_by is not a NUL-terminated");
  b = good;
  b[offsetof(PackedWeightHeader, packed_by) + 1] = 0x07;
  reseal(b.data(), nbytes);
  expect("control character in packed_by", b, "packed_by is not a NUL-terminated");
  // A 64-byte blob claiming n = 2^58: 64 + n * 60 + 4 * n wrapped around to 64 before (UBSan: signed overflow).
  std::vector<uint8_t> tiny(good.begin(), good.begin() + 64);
  put_field<uint16_t>(tiny.data(), offsetof(PackedWeightHeader, nr), 1);
  put_field<uint16_t>(tiny.data(), offsetof(PackedWeightHeader, kr), 1);
  for (size_t field : {offsetof(PackedWeightHeader, n), offsetof(PackedWeightHeader, n_padded)})
    put_field<int64_t>(tiny.data(), field, int64_t{1} << 58);
  for (size_t field : {offsetof(PackedWeightHeader, k), offsetof(PackedWeightHeader, k_padded)})
    put_field<int64_t>(tiny.data(), field, 60);
  reseal(tiny.data(), 64);
  expect("size overflow", tiny, "packed weight header");
  // Contents: a flipped body byte; resealed edits of a channel sum, of padding (sum adjusted), of kr (4 -> 5 at
  // K = 20 under ref, which reads any layout); an older version.
  b = good;
  b[200] ^= 0x20;
  expect("flipped body byte", b, "checksum mismatch");
  b = good;
  const int64_t sums_at = nbytes - 4 * round_up(n, layout.nr);
  b[sums_at + 4 * 5] += 1;
  reseal(b.data(), nbytes);
  expect("channel sum edit", b, "channel sums do not match its panels (channel 5)");
  b = good;
  const int64_t last = round_up(n, layout.nr) - 1;  // a padding channel
  b[sizeof(PackedWeightHeader) + (last / layout.nr) * round_up(k, layout.kr) * layout.nr +
    layout.index(3, static_cast<int>(last % layout.nr))] = 9;
  put_field<int32_t>(b.data(), sums_at + 4 * last, 9);
  reseal(b.data(), nbytes);
  expect("nonzero padding", b, "padding is not zero");
  b = good;
  put_field<uint32_t>(b.data(), offsetof(PackedWeightHeader, version), 2);
  reseal(b.data(), nbytes);
  expect("version 2", b, "re-pack");
  b = good;  // a version 4 blob: its uint32 version 4 spans what version 5 reads as version, scale storage, reserved
  put_field<uint32_t>(b.data(), offsetof(PackedWeightHeader, version), 4);
  reseal(b.data(), nbytes);
  expect("version 4", b, "version 4 is not supported");
  for (const size_t field : {offsetof(PackedWeightHeader, scale_storage), offsetof(PackedWeightHeader, reserved)}) {
    b = good;  // int8 blobs have no scale storage; reserved stays 0
    b[field] = 1;
    reseal(b.data(), nbytes);
    expect("scale storage / reserved", b, "packed weight header");
  }
  {
    // int4: fp16 storage takes only fp16 values; an fp16 blob relabelled fp32 (or 2) no longer matches its size
    const WeightFormat f16{WeightScheme::int4, 5, ScaleStorage::f16};
    const int64_t groups = (k + 31) / 32, bytes16 = packed_weight_nbytes(n, k, layout, "w", f16);
    std::vector<int8_t> q(n * k, 3);
    std::vector<float> scales(n * groups, 0.5f);
    std::vector<uint8_t> b16(bytes16);
    pack_weight_int4(kern, q.data(), n, k, k, scales.data(), nullptr, f16, b16.data(), serial_for);
    CHECK(bytes16 == packed_weight_nbytes(n, k, layout, "w", WeightFormat{WeightScheme::int4, 5}) - 2 *
                         round_up(n, layout.nr) * groups,
          "%s: fp16 scales: %" PRId64 " bytes", kern.name, bytes16);
    for (const uint8_t storage : {0, 2}) {
      std::vector<uint8_t> r = b16;
      r[offsetof(PackedWeightHeader, scale_storage)] = storage;
      reseal(r.data(), bytes16);
      CHECK(rejection(kern, r.data(), bytes16, n, k).find("packed weight header") != std::string::npos,
            "%s: fp16 blob relabelled scale storage %d accepted", kern.name, int{storage});
    }
    scales[5] = 0.1f;  // not an fp16 value
    std::string why;
    try {
      pack_weight_int4(kern, q.data(), n, k, k, scales.data(), nullptr, f16, b16.data(), serial_for);
    } catch (const std::invalid_argument& e) {
      why = e.what();
    }
    CHECK(why.find("scale: fp16 storage holds only fp16 values; row 1, group 2") == 0, "%s: 0.1 as fp16: got '%s'",
          kern.name, why.c_str());
  }
  if (kern.reads_any_layout) {
    const int64_t k20 = 20;
    std::vector<uint8_t> b20(packed_weight_nbytes(16, k20, layout, "w"));
    pack_weight(kern, w.data(), 16, k20, k20, b20.data(), serial_for);
    put_field<uint16_t>(b20.data(), offsetof(PackedWeightHeader, kr), 5);
    reseal(b20.data(), static_cast<int64_t>(b20.size()));
    const std::string why = rejection(kern, b20.data(), static_cast<int64_t>(b20.size()), 16, k20);
    CHECK(why.find("channel sums") != std::string::npos, "%s: kr 4 -> 5: got '%s'", kern.name, why.c_str());
  }
  // Any start address (a slice of a larger buffer): the header is copied out and the sums read bytewise, so this
  // is exact and, under UBSan, free of misaligned loads (there were before).
  for (int off = 1; off < 8; ++off) {
    std::vector<uint8_t> buf(nbytes + off);
    std::memcpy(buf.data() + off, good.data(), nbytes);
    std::vector<float> got;
    const std::string why = rejection(kern, buf.data() + off, nbytes, n, k, &got);
    CHECK(why.empty() && got == want, "%s: blob at byte offset %d: %s", kern.name, off,
          why.empty() ? "different result" : why.c_str());
  }
  std::printf("  %-12s packed weight rejections and byte offsets 1..7\n", kern.name);
}

// Seeded mutations of small blobs (bytes, header fields with boundary values, truncation, extension), most
// resealed: each must be rejected or give the unmutated output bit for bit.
void fuzz_packed_weights(const MicroKernel& kern, uint64_t seed, int cases) {
  std::mt19937_64 rng(seed);
  const int64_t n = 21, k = 30;
  const auto w = random_int8(rng, n * k, -127, 127);
  const int64_t nbytes = packed_weight_nbytes(n, k, kern.geometry().layout, "w");
  std::vector<uint8_t> good(nbytes);
  pack_weight(kern, w.data(), n, k, k, good.data(), serial_for);
  std::vector<float> want, got;
  rejection(kern, good.data(), nbytes, n, k, &want);
  const int64_t boundary[] = {0, 1, 2, 3, 4, 8, 16, 17, 64, 65, 255, 65535, kMaxK, kMaxK + 1, kMaxPackedN,
                              kMaxPackedN + 1, int64_t{1} << 58, int64_t{1} << 62, INT64_MAX, -1, INT64_MIN};
  const size_t fields[] = {offsetof(PackedWeightHeader, n), offsetof(PackedWeightHeader, k),
                           offsetof(PackedWeightHeader, n_padded), offsetof(PackedWeightHeader, k_padded)};
  int64_t rejected = 0, exact = 0, wrong = 0;
  for (int c = 0; c < cases; ++c) {
    std::vector<uint8_t> b = good;
    switch (rng() % 6) {
      case 0: b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255); break;
      case 1: b[rng() % 64] = static_cast<uint8_t>(rng()); break;
      case 2: put_field<int64_t>(b.data(), fields[rng() % 4], boundary[rng() % (sizeof boundary / 8)]); break;
      case 3:
        put_field<uint16_t>(b.data(), rng() % 2 ? offsetof(PackedWeightHeader, nr) : offsetof(PackedWeightHeader, kr),
                            static_cast<uint16_t>(boundary[rng() % (sizeof boundary / 8)]));
        break;
      case 4: b.resize(rng() % b.size()); break;
      default: b.resize(b.size() + 1 + rng() % 64, static_cast<uint8_t>(rng())); break;
    }
    if (b.size() >= 64 && rng() % 4 != 0) reseal(b.data(), static_cast<int64_t>(b.size()));
    const std::string why = rejection(kern, b.data(), static_cast<int64_t>(b.size()), n, k, &got);
    if (!why.empty()) ++rejected;
    else if (got == want) ++exact;
    else ++wrong;
  }
  CHECK(wrong == 0, "%s: %" PRId64 " mutated blobs gave a wrong result", kern.name, wrong);
  std::printf("  %-12s packed weight fuzz: %d cases, %" PRId64 " rejected, %" PRId64 " exact, %" PRId64 " wrong\n",
              kern.name, cases, rejected, exact, wrong);
}

}  // namespace

// Exit status of a --variant run whose variant this CPU lacks: ctest reports it as skipped (SKIP_RETURN_CODE).
constexpr int kSkipped = 77;

int run(int argc, char** argv) {
  int shape_count = 300;
  uint64_t seed = 20261129;
  std::string expect_selected, only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--shapes" && i + 1 < argc) shape_count = std::atoi(argv[++i]);
    else if (arg == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (arg == "--expect-selected" && i + 1 < argc) expect_selected = argv[++i];
    else if (arg == "--variant" && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--shapes N] [--seed S] [--expect-selected NAME] [--variant NAME]\n", argv[0]);
      return 2;
    }
  }
  std::string features;
  for (const auto& f : feature_names(cpu_features())) features += " " + f;
  const MicroKernel& selected = active_kernel();
  std::printf("arch %s, features:%s, selected variant: %s\n", target_arch(), features.c_str(), selected.name);
  if (!expect_selected.empty())
    CHECK(expect_selected == selected.name, "dispatch selected '%s', expected '%s'", selected.name,
          expect_selected.c_str());

  std::mt19937_64 rng(seed);
  const auto shapes = sweep_shapes(rng, shape_count);
  std::vector<const MicroKernel*> runnable;
  bool only_found = false;
  for (const MicroKernel* kern : compiled_kernels()) {
    if (!only.empty() && only != kern->name) continue;
    only_found = true;
    if (!cpu_supports(*kern)) {
      std::printf("  %-12s skipped: this CPU lacks its features\n", kern->name);
      if (!only.empty()) return kSkipped;
      continue;
    }
    runnable.push_back(kern);
    test_matmul_sweep(*kern, shapes, seed);
    test_panel_group_tile(*kern, "two_panel_rows", kern->two_panel_rows, 2, kTwoPanelMaxRows, shapes, seed);
    test_panel_group_tile(*kern, "wide_tile", kern->wide_tile, kern->geometry().wide_panels,
                          kern->geometry().wide_mr, shapes, seed);
    test_tile_small(*kern, shapes, seed);
    test_extreme_k(*kern);
    test_driver_int8_min(*kern, seed);
    test_quantization(*kern, seed);
    test_shared_vectors(*kern);
    test_int4_shared_vectors(*kern);
    test_decode_claims_by_thread_count(*kern, seed);
    test_silu_mul_bits(*kern, seed);
    test_softmax_numerators_bits(*kern, seed);
    test_decode_attention_bits(*kern, seed);
    test_packed_weight_rejections(*kern);
    fuzz_packed_weights(*kern, seed, 3000);
  }
  if (!only.empty() && !only_found) {
    std::printf("FAILED: --variant %s: not a variant of this build\n", only.c_str());
    return 1;
  }
  test_crc32c();
  test_float_conversions();
  test_dynamic_for_threads_and_hooks();
  test_driver_identical(runnable, seed, {7, 45, 301});
  // prefill: wide_tile where a variant has it (8 panels: two runs of 4; 11 panels: two runs and 3 alone, the last
  // partly padding), whole tiles of rows and a remainder
  test_driver_identical(runnable, seed, {15, 128, 301});
  test_driver_identical(runnable, seed, {53, 165, 77});
  // decode: two_panel_rows where a variant has it (3 panels: a pair and one alone)
  test_driver_identical(runnable, seed, {1, 45, 301});
  test_driver_identical(runnable, seed, {2, 45, 301});
  g_failures += run_moe_tests(runnable, seed);
  CHECK(!runnable.empty(), "no variant ran");
  std::printf("%s: %zu variants run, %d failures\n", g_failures ? "FAILED" : "OK", runnable.size(), g_failures);
  return g_failures ? 1 : 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // e.g. a bad W8A8_CPU_ISA: report it, do not abort
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}
