// The cache of verified packed blobs (verified_blobs.h).
#include "verified_blobs.h"

#include <ATen/MapAllocator.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace w8a8_cpu {

void VerifiedBlobs::insert(const at::Tensor& t, bool in_file) {
  const Key key = key_of(t);
  std::lock_guard<std::mutex> lock(mutex_);
  if (entries_.size() >= prune_at_) {
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->second.storage.expired() ? entries_.erase(it) : std::next(it);
    prune_at_ = std::max<size_t>(1024, 2 * entries_.size());
  }
  entries_.insert_or_assign(key.data, Entry{key, c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(
                                                     c10::raw::intrusive_ptr::make_weak(key.storage)), in_file});
}

bool VerifiedBlobs::file_backed(const at::Tensor& t) {
  if (at::MapAllocator::fromDataPtr(t.storage().data_ptr()) != nullptr) return true;
#ifdef __linux__
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long long begin = 0, end = 0, offset = 0, inode = 0;
    char perms[8] = {}, device[16] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %llx %15s %llu", &begin, &end, perms, &offset, device, &inode) != 6)
      continue;
    if (address >= begin && address < end) return inode != 0;
  }
#endif
  return false;
}

VerifiedBlobs::Key VerifiedBlobs::key_of(const at::Tensor& t) {
  const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
  return {t.data_ptr(), t.storage().unsafeGetStorageImpl(), t.numel(),
          version.enabled() ? version.current_version() : 0u};
}

VerifiedBlobs& verified_blobs() {
  static VerifiedBlobs* blobs = new VerifiedBlobs;  // never destroyed: ops may run during interpreter teardown
  return *blobs;
}

}  // namespace w8a8_cpu
