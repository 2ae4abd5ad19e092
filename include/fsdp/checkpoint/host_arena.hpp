#pragma once
// HostArena: one uninitialised host allocation for a checkpoint's staging bytes. Fresh
// anonymous memory is zeroed by the kernel one 4 KiB page fault at a time, which costs more
// than the disk on some machines; large arenas are therefore 2 MiB aligned and asked for
// transparent huge pages (a hint: where the kernel declines, they are ordinary pages).
#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <memory>

#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

class HostArena {
 public:
  HostArena() = default;
  explicit HostArena(std::size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    constexpr std::size_t huge = std::size_t{2} << 20;
    const bool large = bytes >= huge;
    const std::size_t align = large ? huge : alignof(std::max_align_t);
    const std::size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(align, rounded)));
    if (!data_)
      fsdp::detail::fail_as(ErrorKind::out_of_memory, "out of host memory allocating ", bytes,
                            " bytes of checkpoint staging");
#ifdef MADV_HUGEPAGE
    if (large) ::madvise(data_.get(), rounded, MADV_HUGEPAGE);
#endif
  }
  std::byte* data() const { return data_.get(); }
  std::size_t size() const { return bytes_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t bytes_ = 0;
};

}  // namespace fsdp::checkpoint
