// _read_probe: the fastest plain read of a buffer this core can do, bench's reference for what a memory-bound GEMV
// could reach. Three ways to read, each timed by the caller and the best taken: plain wide loads (the hardware
// prefetchers alone), the same with software prefetch a fixed distance ahead (into L1, as the GEMV's panels are
// read), and with non-temporal prefetch (fills that skip the outer cache levels' replacement). The loads are xor-ed
// into a checksum that is returned, so no compiler drops them. The buffer is split in chunks over torch's threads,
// as the GEMV splits its panels.
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <vector>

#include "binding_checks.h"
#include "torch_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace w8a8_cpu {

namespace {

enum class ReadWay { kPlain, kPrefetch, kNonTemporal };

constexpr int64_t kPrefetchDistance = 4096;  // bytes ahead; past the stride prefetchers' own lead on one stream
constexpr int64_t kStep = 256;               // bytes a loop iteration: four 64-byte loads

// A hint for each 64-byte line of the step kPrefetchDistance ahead (a prefetch never faults, also past the buffer):
// into every cache level (x86 prefetcht0), or non-temporal (prefetchnta: locality 0).
inline void prefetch_ahead(const uint8_t* q, ReadWay way) {
  if (way == ReadWay::kPlain) return;
  for (int line = 0; line < kStep; line += 64) {
    if (way == ReadWay::kPrefetch)
      __builtin_prefetch(q + kPrefetchDistance + line, 0, 3);
    else
      __builtin_prefetch(q + kPrefetchDistance + line, 0, 0);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, int64_t bytes, ReadWay way) {
  __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
  for (int64_t i = 0; i < bytes; i += kStep) {
    const uint8_t* q = p + i;
    prefetch_ahead(q, way);
    x0 = _mm512_xor_si512(x0, _mm512_loadu_si512(q));
    x1 = _mm512_xor_si512(x1, _mm512_loadu_si512(q + 64));
    x2 = _mm512_xor_si512(x2, _mm512_loadu_si512(q + 128));
    x3 = _mm512_xor_si512(x3, _mm512_loadu_si512(q + 192));
  }
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(x0, x1), _mm512_xor_si512(x2, x3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, x);
  uint64_t sum = 0;
  for (uint64_t lane : lanes) sum ^= lane;
  return sum;
}

__attribute__((target("avx2"))) uint64_t read_avx2(const uint8_t* p, int64_t bytes, ReadWay way) {
  __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
  for (int64_t i = 0; i < bytes; i += kStep) {
    const uint8_t* q = p + i;
    prefetch_ahead(q, way);
    for (int half = 0; half < kStep; half += 128) {
      x0 = _mm256_xor_si256(x0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half)));
      x1 = _mm256_xor_si256(x1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half + 32)));
      x2 = _mm256_xor_si256(x2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half + 64)));
      x3 = _mm256_xor_si256(x3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half + 96)));
    }
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}
#endif

// Any CPU: 8-byte loads, four independent chains.
uint64_t read_words(const uint8_t* p, int64_t bytes, ReadWay way) {
  uint64_t x[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < bytes; i += kStep) {
    const uint8_t* q = p + i;
    prefetch_ahead(q, way);
    for (int w = 0; w < kStep; w += 32)
      for (int j = 0; j < 4; ++j) {
        uint64_t v;
        std::memcpy(&v, q + w + 8 * j, 8);
        x[j] ^= v;
      }
  }
  return x[0] ^ x[1] ^ x[2] ^ x[3];
}

uint64_t read_chunk(const uint8_t* p, int64_t bytes, ReadWay way) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return read_avx512(p, bytes, way);
  if (__builtin_cpu_supports("avx2")) return read_avx2(p, bytes, way);
#endif
  return read_words(p, bytes, way);
}

ReadWay read_way(const std::string& way) {
  if (way == "plain") return ReadWay::kPlain;
  if (way == "prefetch") return ReadWay::kPrefetch;
  if (way == "nta") return ReadWay::kNonTemporal;
  TORCH_CHECK_VALUE(false, "_read_probe: way must be 'plain', 'prefetch' or 'nta', got '", way, "'");
}

}  // namespace

int64_t read_probe_op(const at::Tensor& buffer, const std::string& way) {
  const ReadWay how = read_way(way);
  check_cpu(buffer, "buffer");
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
                    "_read_probe: buffer must be a contiguous 1-D uint8 tensor");
  const int64_t bytes = buffer.numel();
  TORCH_CHECK_VALUE(bytes > 0 && bytes % kStep == 0, "_read_probe: buffer must hold a positive multiple of ", kStep,
                    " bytes (got ", bytes, ")");
  const auto* p = static_cast<const uint8_t*>(buffer.data_ptr());
  const int64_t steps = bytes / kStep;
  std::vector<uint64_t> partial(static_cast<size_t>(at::get_num_threads()) + 1, 0);
  at::parallel_for(0, steps, 1, [&](int64_t begin, int64_t end) {
    const int slot = at::get_thread_num();
    partial[static_cast<size_t>(slot)] ^= read_chunk(p + begin * kStep, (end - begin) * kStep, how);
  });
  uint64_t sum = 0;
  for (uint64_t v : partial) sum ^= v;
  return static_cast<int64_t>(sum);
}

}  // namespace w8a8_cpu
