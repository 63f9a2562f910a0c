// The gpu tests' main: exits 77 (CTest: skipped) with the driver's own
// reason where no GPU is usable, else runs the Catch session. (Catch's
// implementation lives here, in a file built without the project's
// warnings, as conformance/main.cpp is.)
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <anydoor/cuda.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  const auto& d = anydoor::cuda::driver();
  if (!d.usable) {
    std::printf("skipped: no usable GPU: %s\n", d.why.c_str());
    return 77;
  }
  std::printf("CUDA driver %d.%d, %d GPU(s)\n", d.version / 1000, d.version % 1000 / 10, d.devices);
  return Catch::Session().run(argc, argv);
}
