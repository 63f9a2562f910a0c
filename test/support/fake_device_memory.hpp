// Host memory standing in for GPU device memory, for tests on machines
// without a GPU. The address handed out (dev) is mapped PROT_NONE: a load
// or store by the CPU faults, as one into GPU memory would, so code under
// test that touches it other than through the copier crashes the test.
// The bytes live in a memfd, reached by the test (and by fake_copier)
// through a second, writable mapping (view), as a GPU's bytes are reached
// only by copies.
#pragma once

#include <anydoor/error.hpp>
#include <anydoor/transport/provider.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <mutex>
#include <vector>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

namespace anydoor::test {

class fake_device_memory {
 public:
  explicit fake_device_memory(std::size_t size) : size_(size) {
    fd_ = ::memfd_create("anydoor-fake-device", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(size)) != 0) throw std::runtime_error("memfd");
    void* d = ::mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd_, 0);
    void* v = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (d == MAP_FAILED || v == MAP_FAILED) throw std::runtime_error("mmap");
    dev_ = static_cast<std::byte*>(d);
    view_ = static_cast<std::byte*>(v);
  }
  ~fake_device_memory() {
    ::munmap(dev_, size_);
    ::munmap(view_, size_);
    ::close(fd_);
  }
  fake_device_memory(const fake_device_memory&) = delete;
  fake_device_memory& operator=(const fake_device_memory&) = delete;

  std::byte* dev() const noexcept { return dev_; }    // what code under test gets
  std::byte* view() const noexcept { return view_; }  // what the test reads and writes
  std::size_t size() const noexcept { return size_; }
  bool contains(const void* p, std::size_t n) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= dev_ && n <= size_ && static_cast<std::size_t>(b - dev_) <= size_ - n;
  }
  std::byte* view_of(const void* p) const noexcept { return view_ + (static_cast<const std::byte*>(p) - dev_); }

 private:
  std::size_t size_;
  int fd_ = -1;
  std::byte* dev_ = nullptr;
  std::byte* view_ = nullptr;
};

// Copies between a fake_device_memory and host memory, counting bytes,
// held while `hold` is set (holding: how many wait so; they run on the
// caller's thread, the runtime's copy thread),
// failing every copy after `fail_after` more have succeeded (negative:
// never; with fail_once only the first such copy; with only_to_host or
// only_to_device, copies the other way never fail), and refusing (with a note in bad_range) ranges outside the
// memory, which the caller never should pass.
class fake_copier final : public anydoor::transport::memory_copier {
 public:
  explicit fake_copier(const fake_device_memory& m) : m_(m) {}
  std::error_code to_host(void* dst, const void* src, std::size_t n) noexcept override {
    if (std::error_code ec = admit(src, n, true)) return ec;
    std::memcpy(dst, m_.view_of(src), n);
    to_host_bytes += n;
    return {};
  }
  std::error_code to_device(void* dst, const void* src, std::size_t n) noexcept override {
    if (std::error_code ec = admit(dst, n, false)) return ec;
    std::memcpy(m_.view_of(dst), src, n);
    to_device_bytes += n;
    return {};
  }
  // Started copies run at once; with defer_failures, a failure of one is
  // reported by finish() instead (as a CUDA stream's error is). With
  // defer_copies they run only in finish(), and the destination holds
  // junk meanwhile: a caller that uses a copy before waiting for it reads
  // the junk, or has its bytes overwritten later.
  std::error_code start_to_host(void* dst, const void* src, std::size_t n) noexcept override {
    ++started_to_host;
    return start(true, dst, src, n);
  }
  std::error_code start_to_device(void* dst, const void* src, std::size_t n) noexcept override {
    ++started_to_device;
    return start(false, dst, src, n);
  }
  std::error_code finish() noexcept override {
    ++finishes;
    std::vector<started_copy> run;
    {
      std::lock_guard lock(mutex_);
      run.swap(started_);
    }
    for (const started_copy& c : run) {
      if (deferred(c.to_host ? to_host(c.dst, c.src, c.n) : to_device(c.dst, c.src, c.n))) pending_failure = true;
    }
    return pending_failure.exchange(false) ? make_error_code(errc::device_copy_failed) : std::error_code{};
  }
  std::atomic<bool> defer_failures{false};
  std::atomic<bool> defer_copies{false};
  std::atomic<bool> pending_failure{false};
  std::atomic<int> started{0}, finishes{0}, started_to_host{0}, started_to_device{0};
  // The device's bounce buffers come from here (ordinary memory), counted.
  std::shared_ptr<std::byte> bounce_buffer(std::size_t n) noexcept override {
    ++bounce_buffers;
    return memory_copier::bounce_buffer(n);
  }
  std::atomic<int> bounce_buffers{0};
  std::atomic<std::uint64_t> to_host_bytes{0}, to_device_bytes{0};
  std::atomic<std::uint64_t> copies{0};
  std::atomic<long> fail_after{-1};
  std::atomic<bool> fail_once{false};
  std::atomic<bool> only_to_host{false};
  std::atomic<bool> only_to_device{false};
  std::atomic<bool> bad_range{false};
  std::atomic<bool> hold{false};
  std::atomic<int> holding{0};
  // Every copy asked for, in order: its GPU-side offset, length, direction.
  struct copy_record {
    std::size_t offset;
    std::size_t length;
    bool to_host;
  };
  std::vector<copy_record> log() const {
    std::lock_guard lock(mutex_);
    return log_;
  }
  void clear_log() {
    std::lock_guard lock(mutex_);
    log_.clear();
  }

 private:
  std::error_code admit(const void* p, std::size_t n, bool to_host) noexcept {
    if (!m_.contains(p, n)) {
      bad_range = true;
      return make_error_code(errc::invalid_argument);
    }
    if (hold) {
      ++holding;
      while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      --holding;
    }
    ++copies;
    {
      std::lock_guard lock(mutex_);
      log_.push_back({static_cast<std::size_t>(static_cast<const std::byte*>(p) - m_.dev()), n, to_host});
    }
    if ((only_to_host && !to_host) || (only_to_device && to_host)) return {};
    long left = fail_after.load();
    while (left >= 0) {
      if (left == 0) {
        if (fail_once) fail_after = -1;
        return make_error_code(errc::device_copy_failed);
      }
      if (fail_after.compare_exchange_weak(left, left - 1)) break;
    }
    return {};
  }
  struct started_copy {
    void* dst;
    const void* src;
    std::size_t n;
    bool to_host;
  };
  std::error_code start(bool to_host, void* dst, const void* src, std::size_t n) noexcept {
    ++started;
    if (!defer_copies) return deferred(to_host ? this->to_host(dst, src, n) : to_device(dst, src, n));
    if (!m_.contains(to_host ? src : dst, n)) {
      bad_range = true;
      return make_error_code(errc::invalid_argument);
    }
    std::memset(to_host ? dst : m_.view_of(dst), 0xa5, n);  // junk until finish()
    try {
      std::lock_guard lock(mutex_);
      started_.push_back({dst, src, n, to_host});
    } catch (const std::bad_alloc&) {
      return make_error_code(errc::device_copy_failed);
    }
    return {};
  }
  std::error_code deferred(std::error_code ec) noexcept {
    if (!ec || !defer_failures) return ec;
    pending_failure = true;
    return {};
  }
  std::vector<started_copy> started_;
  const fake_device_memory& m_;
  mutable std::mutex mutex_;
  std::vector<copy_record> log_;
};

}  // namespace anydoor::test
