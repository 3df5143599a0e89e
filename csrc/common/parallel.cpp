#include "parallel.h"

#include <algorithm>
#include <atomic>

namespace w8a8_cpu {

void serial_for(int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  if (begin < end) body(begin, end);
}

void dynamic_for(int64_t count, int64_t chunk, const ParallelFor& parallel_for,
                 const std::function<void(int64_t, int64_t)>& body, void (*enter)(), void (*leave)()) {
  if (count <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t claims = (count + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    // Each thread of the one region ignores its static share and claims until the counter runs out.
    int64_t t0 = next.fetch_add(chunk);
    if (t0 >= count) return;
    if (enter) enter();
    for (; t0 < count; t0 = next.fetch_add(chunk)) body(t0, std::min(count, t0 + chunk));
    if (leave) leave();
  };
  if (claims == 1) return work(0, count);  // no region for one claim
  parallel_for(0, claims, 1, work);
}

}  // namespace w8a8_cpu
