// operator new and delete replaced for one test binary: include this in
// exactly one of its sources. On the calling thread, allocations can be
// counted (counting), those of exactly watch_size bytes counted
// (watched), and those of exactly fail_size bytes refused with
// std::bad_alloc (refused counts them). Not for sanitizer builds: they
// replace operator new themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace anydoor::test::alloc {

inline thread_local bool counting = false;
inline thread_local std::uint64_t allocations = 0;  // while counting
inline thread_local std::size_t fail_size = 0;      // 0: none is refused
inline thread_local std::uint64_t refused = 0;
inline thread_local std::size_t watch_size = 0;     // allocations of exactly this many bytes
inline thread_local std::uint64_t watched = 0;      // are counted here (always)

inline void* allocate(std::size_t n, std::size_t align) {
  if (counting) ++allocations;
  if (watch_size != 0 && n == watch_size) ++watched;
  if (fail_size != 0 && n == fail_size) {
    ++refused;
    throw std::bad_alloc();
  }
  void* p = align <= alignof(std::max_align_t) ? std::malloc(n == 0 ? 1 : n)
                                               : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace anydoor::test::alloc

void* operator new(std::size_t n) { return anydoor::test::alloc::allocate(n, alignof(std::max_align_t)); }
void* operator new[](std::size_t n) { return anydoor::test::alloc::allocate(n, alignof(std::max_align_t)); }
void* operator new(std::size_t n, std::align_val_t a) {
  return anydoor::test::alloc::allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return anydoor::test::alloc::allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
