// The driver's parallelism, independent of torch: the caller passes a ParallelFor (the binding: at::parallel_for,
// torch's one thread pool, with its thread count; tests: serial_for), and every driver loop runs through dynamic_for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>

namespace w8a8_cpu {

// parallel_for(begin, end, grain, body): calls body(b, e) on disjoint sub-ranges covering [begin, end),
// possibly concurrently; ranges of at most `grain` items run inline. Results never depend on the split.
// threads: how many threads it runs a region on (the binding: torch's count at the call; a plain function: 1). The
// driver sizes some claims with it (gemm_packed's decode claims); results never depend on it either.
struct ParallelFor {
  using Run = std::function<void(int64_t begin, int64_t end, int64_t grain,
                                 const std::function<void(int64_t, int64_t)>& body)>;
  Run run;
  const int threads = 1;  // >= 1

  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, ParallelFor> &&
                                                    std::is_constructible_v<Run, F&&>>>
  ParallelFor(F&& f, int thread_count = 1) : run(std::forward<F>(f)), threads(std::max(thread_count, 1)) {}
  void operator()(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body) const {
    run(begin, end, grain, body);
  }
};
void serial_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// body(t0, t1) over [0, count) in claims of at most `chunk` items, each taken from a shared counter by whichever
// thread of one parallel_for region is free: a thread slowed down (another process on its core) holds up at most its
// current claim instead of a fixed share. Only for bodies whose results do not depend on which thread runs a claim.
// enter / leave (may be null): called on each thread that takes a claim, before its first and after its last (a
// variant's per-thread hooks, MicroKernel::thread_enter / thread_leave).
void dynamic_for(int64_t count, int64_t chunk, const ParallelFor& parallel_for,
                 const std::function<void(int64_t, int64_t)>& body, void (*enter)() = nullptr,
                 void (*leave)() = nullptr);

}  // namespace w8a8_cpu
