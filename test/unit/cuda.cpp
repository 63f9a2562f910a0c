// The CUDA driver, loaded at run time: what a host without a GPU (every CI
// machine) sees, in a build with CUDA and in one without. With
// ANYDOOR_TEST_CUDA_EXPECT=stub (the cuda-stub-driver CTest, which puts the
// toolkit's stub libcuda first on LD_LIBRARY_PATH) the stub must be named.
#include <anydoor/cuda.hpp>
#include <anydoor/fabric.hpp>

#include <boost/asio/io_context.hpp>

#include <catch2/catch.hpp>

#include "cuda/driver.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {
std::string expectation() {
  const char* e = std::getenv("ANYDOOR_TEST_CUDA_EXPECT");
  return e != nullptr ? e : "";
}
}  // namespace

TEST_CASE("cuda: the driver is opened at run time and says what it found", "[unit][cuda]") {
  const auto& d = anydoor::cuda::driver();
  CHECK(&d == &anydoor::cuda::driver());  // loaded once
  INFO("driver: usable " << d.usable << ", version " << d.version << ", devices " << d.devices << ", why: " << d.why);
#ifdef ANYDOOR_TEST_BUILT_WITH_CUDA
  CHECK(anydoor::cuda::built_with_cuda());
#else
  CHECK_FALSE(anydoor::cuda::built_with_cuda());
  CHECK_FALSE(d.usable);
  CHECK(d.why.find("built without CUDA") != std::string::npos);
#endif
  if (d.usable) {
    CHECK(d.devices > 0);
    CHECK(d.version >= 11070);
    CHECK(d.why.empty());
  } else {
    CHECK_FALSE(d.why.empty());
    CHECK(d.devices == 0);
  }
  if (expectation() == "stub") {
    REQUIRE(anydoor::cuda::built_with_cuda());
    CHECK_FALSE(d.usable);
    CHECK(d.why.find("stub library (CUDA_ERROR_STUB_LIBRARY)") != std::string::npos);
  } else if (anydoor::cuda::built_with_cuda()) {
    // Without the stub: on a host with no driver library the reason names it.
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr && !d.usable && ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) == nullptr) {
      CHECK(d.why.find("libcuda.so.1 cannot be loaded (no NVIDIA driver installed)") != std::string::npos);
    }
  }
}

TEST_CASE("cuda: without a usable driver every pointer is host memory, and regions say so", "[unit][cuda]") {
  using anydoor::memory_kind;
  CHECK(anydoor::to_string(memory_kind::host) == "host");
  CHECK(anydoor::to_string(memory_kind::cuda_device) == "cuda_device");
  CHECK(anydoor::to_string(memory_kind::cuda_managed) == "cuda_managed");
  CHECK(anydoor::to_string(memory_kind::cuda_host) == "cuda_host");
  std::vector<std::byte> heap(4096);
  int stack = 0;
  CHECK(anydoor::cuda::kind_of(heap.data()) == memory_kind::host);  // host memory is host, driver or not
  CHECK(anydoor::cuda::kind_of(&stack) == memory_kind::host);
  CHECK(anydoor::cuda::kind_of(nullptr) == memory_kind::host);

  boost::asio::io_context io;
  anydoor::fabric fab(io, {.device = {.provider = "tcp"}});
  anydoor::memory_region r = fab.register_memory(std::span(heap), anydoor::access::local_write);
  CHECK(r.kind() == memory_kind::host);
  anydoor::memory_region moved = std::move(r);
  CHECK(moved.kind() == memory_kind::host);
  CHECK(moved.size() == heap.size());
  moved.reset();
  CHECK(moved.kind() == memory_kind::host);
  // A kind other than the default goes with a move, and reset forgets it.
  anydoor::memory_region pinned(fab.protection_domain().register_memory(heap.data(), heap.size(),
                                                                        anydoor::access::local_write),
                                memory_kind::cuda_host);
  CHECK(pinned.kind() == memory_kind::cuda_host);
  anydoor::memory_region other;
  other = std::move(pinned);
  CHECK(other.kind() == memory_kind::cuda_host);
  CHECK(pinned.kind() == memory_kind::host);  // NOLINT: moved-from is empty
  anydoor::memory_region third(std::move(other));
  CHECK(third.kind() == memory_kind::cuda_host);
  third.reset();
  CHECK(third.kind() == memory_kind::host);
}

// process_has_cuda runs on the data path (every 10 ms at most): it asked
// the loader with dlopen(RTLD_NOLOAD), which searched the library path (six
// failed openat calls, about 40 us) while the driver was not loaded. It
// now reads the loaded objects' names, and only when the loader has added
// an object since it last did.
TEST_CASE("cuda: the look for a loaded driver reads the loaded objects only when one was added", "[unit][cuda]") {
  namespace cd = anydoor::cuda::detail;
  if (!anydoor::cuda::built_with_cuda()) {
    CHECK_FALSE(cd::process_has_cuda(true));
    CHECK(cd::loaded_object_looks() == 0);
    return;
  }
  const bool had = cd::process_has_cuda(true);
  INFO("the CUDA driver was loaded before this case: " << had);
  if (!had) {
    const std::uint64_t looks = cd::loaded_object_looks();
    for (int i = 0; i < 100; ++i) CHECK_FALSE(cd::process_has_cuda(true));
    CHECK(cd::loaded_object_looks() == looks);  // nothing added: no look
    // An object added (not the driver): looked at once, and still no driver.
    void* other = ::dlopen("libanl.so.1", RTLD_NOW | RTLD_LOCAL);
    REQUIRE(other != nullptr);
    CHECK_FALSE(cd::process_has_cuda(true));
    CHECK(cd::loaded_object_looks() == looks + 1);
    CHECK_FALSE(cd::process_has_cuda(true));
    CHECK(cd::loaded_object_looks() == looks + 1);
    ::dlclose(other);
  }
#ifdef ANYDOOR_TEST_CUDA_STUB_PATH
  // The driver's library loaded from a path of its own (the toolkit's stub,
  // file name libcuda.so, soname libcuda.so.1): found by its name.
  void* stub = ::dlopen(ANYDOOR_TEST_CUDA_STUB_PATH, RTLD_LAZY | RTLD_LOCAL);
  REQUIRE(stub != nullptr);
  CHECK(cd::process_has_cuda(true));
  CHECK(cd::process_has_cuda());  // and for good
#else
  WARN("no toolkit stub libcuda found at configure time: the driver-found half of this case did not run");
#endif
}
