// AlignedBuffer<T>: an owned, move-only array of trivially copyable elements at a chosen
// power-of-two alignment (64 bytes by default: one cache line, and what AVX-512 loads want).
// Used for weights, activations and scratch space handed to SIMD kernels.
#ifndef MOE_COMMON_ALIGNED_BUFFER_H_
#define MOE_COMMON_ALIGNED_BUFFER_H_

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace moe::common {

// Owns size() elements. Contents start uninitialized (allocating 1 GiB must not touch it; callers
// that need zeros fill them). Not thread-safe beyond the usual "const methods may be shared".
// madvise(MADV_HUGEPAGE) over [p, p + bytes); false where the system does not take it.
bool AdviseHugePages(void* p, size_t bytes);

template <typename T>
class AlignedBuffer {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "AlignedBuffer holds raw memory: T must be trivially copyable and destructible");

 public:
  static constexpr size_t kDefaultAlignment = 64;

  // Empty: data() == nullptr, size() == 0.
  AlignedBuffer() = default;

  // Allocates n elements. Aborts with a message on an invalid alignment or when out of memory
  // (like operator new); use Allocate() where the size comes from input.
  explicit AlignedBuffer(size_t n, size_t alignment = kDefaultAlignment) {
    absl::StatusOr<AlignedBuffer> b = Allocate(n, alignment);
    if (!b.ok()) {
      std::fprintf(stderr, "AlignedBuffer: %s\n", b.status().ToString().c_str());
      std::abort();
    }
    *this = std::move(*b);
  }

  // InvalidArgument if alignment is not a power of two or is below alignof(T), or n * sizeof(T)
  // overflows; ResourceExhausted if the allocation fails. n == 0 gives an empty buffer.
  static absl::StatusOr<AlignedBuffer> Allocate(size_t n, size_t alignment = kDefaultAlignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment < alignof(T)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "alignment ", alignment, " must be a power of two and at least ", alignof(T)));
    }
    if (n > std::numeric_limits<size_t>::max() / sizeof(T) - alignment) {
      return absl::InvalidArgumentError(absl::StrCat("buffer of ", n, " elements is too large"));
    }
    AlignedBuffer b;
    if (n == 0) return b;
    // aligned_alloc wants a multiple of the alignment (and at least sizeof(void*) alignment).
    const size_t align = alignment < sizeof(void*) ? sizeof(void*) : alignment;
    const size_t bytes = (n * sizeof(T) + align - 1) / align * align;
    void* p = std::aligned_alloc(align, bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", n * sizeof(T), " bytes aligned to ", align));
    }
    b.data_ = static_cast<T*>(p);
    b.size_ = n;
    return b;
  }

  // For large, long-lived, streamed data (expert weights): aligned to 2 MiB and advised onto
  // transparent huge pages (MADV_HUGEPAGE; best effort: where THP is "never" or the advice
  // fails, the buffer simply keeps 4 KiB pages). Reading weights off 4 KiB pages costs a TLB miss
  // every 4 KiB; on the 2-core dev VM that alone cut q4_0 expert reads from 0.73 to about 0.5 of
  // DRAM bandwidth. Call before the memory is first written, so that the first touch faults in
  // huge pages.
  static constexpr size_t kHugePageBytes = size_t{2} << 20;
  static absl::StatusOr<AlignedBuffer> AllocateHugePages(size_t n) {
    absl::StatusOr<AlignedBuffer> b = Allocate(n, kHugePageBytes);
    if (b.ok() && !b->empty()) AdviseHugePages(b->data(), b->bytes());
    return b;
  }

  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }
  bool empty() const { return size_ == 0; }
  absl::Span<T> span() { return absl::Span<T>(data_, size_); }
  absl::Span<const T> span() const { return absl::Span<const T>(data_, size_); }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moe::common

#endif  // MOE_COMMON_ALIGNED_BUFFER_H_
