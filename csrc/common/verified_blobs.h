// Packed blobs are verified (verify_packed_weight: checksum, channel sums, padding; one pass over the blob) once
// per tensor contents, not on every call: the pass costs about as much as an M = 1 GEMV over the same weight
// (docs/ARCHITECTURE.md). The contents are identified as far as torch can tell: the storage, the byte range and
// the tensor's version counter, which every in-place op bumps (views share it). A weak reference keeps the storage
// object's address from being reused by a new storage while the entry exists. A blob in file-backed storage
// (torch.from_file, torch.load(mmap=True), UntypedStorage.from_file) is verified on every call instead: another
// process can rewrite the file under the mapping, and no counter sees that. Writes that bypass the counter within
// the process (through numpy, .data, raw pointers, a second tensor made with set_() on the same storage, which has a
// counter of its own, or in-place edits of inference tensors, which have none) are not seen: they are the process's
// own edits, not input; the header is still validated on every call, so memory safety never depends on this cache.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace w8a8_cpu {

class VerifiedBlobs {
 public:
  template <typename Verify>
  void ensure(const at::Tensor& t, Verify&& verify) {
    const Key key = key_of(t);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = entries_.find(key.data);
      if (it != entries_.end() && it->second.matches(key) && !it->second.file_backed) return;
    }
    verify();  // throws for a bad blob; outside the lock, so threads verifying different blobs do not wait
    insert(t, file_backed(t));
  }

  void insert(const at::Tensor& t, bool in_file = false);

 private:
  struct Key {
    const void* data;
    c10::StorageImpl* storage;
    int64_t nbytes;
    uint32_t version;
  };
  struct Entry {
    Key key;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    bool file_backed;  // verified on every call (found once, at the first verification)
    bool matches(const Key& k) const {
      return key.storage == k.storage && key.nbytes == k.nbytes && key.version == k.version && !storage.expired();
    }
  };
  // Whether the blob's bytes live in a mapping of a file: torch's MapAllocator (torch.from_file), or, on Linux, any
  // file mapping /proc/self/maps lists at its address (torch.load(mmap=True) slices one storage per record out of
  // the mapped file, numpy memmaps): read once per blob, at its first verification.
  static bool file_backed(const at::Tensor& t);
  static Key key_of(const at::Tensor& t);

  std::mutex mutex_;
  std::unordered_map<const void*, Entry> entries_;
  size_t prune_at_ = 1024;
};

// The process's one cache.
VerifiedBlobs& verified_blobs();

}  // namespace w8a8_cpu
