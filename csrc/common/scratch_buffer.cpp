// The drivers' scratch memory (scratch_buffer.h).
#include "scratch_buffer.h"

#include <algorithm>
#include <atomic>

namespace w8a8_cpu {

namespace {

constexpr int64_t kRetainedScratchBytes = int64_t{256} << 20;
std::atomic<int64_t> g_retained_scratch_bytes{0};

struct RetainedScratch {
  at::Tensor buffer;
  ~RetainedScratch() { g_retained_scratch_bytes -= buffer.defined() ? buffer.numel() : 0; }
};

// Adds `delta` bytes to the retained total if that stays within the budget.
bool claim_retained(int64_t delta) {
  int64_t total = g_retained_scratch_bytes.load();
  do {
    if (total + delta > kRetainedScratchBytes) return false;
  } while (!g_retained_scratch_bytes.compare_exchange_weak(total, total + delta));
  return true;
}

}  // namespace

at::Tensor scratch_buffer(int64_t nbytes) {
  thread_local RetainedScratch mine;
  nbytes = std::max<int64_t>(nbytes, 1);
  if (mine.buffer.defined() && mine.buffer.numel() >= nbytes) return mine.buffer;
  const int64_t held = mine.buffer.defined() ? mine.buffer.numel() : 0;
  if (!claim_retained(nbytes - held)) return at::empty({nbytes}, at::kByte);
  mine.buffer = at::Tensor();  // free the old one before allocating the new one
  mine.buffer = at::empty({nbytes}, at::kByte);
  return mine.buffer;
}

}  // namespace w8a8_cpu
