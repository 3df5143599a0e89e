// Driver scratch: a buffer of the calling thread, grown on demand and kept between calls (a fresh multi-MB buffer
// per call would page-fault through every page again; ops never nest, so one per thread is enough). What all
// threads keep together is bounded by kRetainedScratchBytes: a request that would cross it (big MoE prefills, or
// many threads calling at once) gets a buffer of its own, freed after the call. A thread's buffer is freed (and
// leaves the budget) when the thread exits: it is a thread_local with a destructor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace w8a8_cpu {

// At least nbytes (>= 1) bytes, uint8.
at::Tensor scratch_buffer(int64_t nbytes);

}  // namespace w8a8_cpu
