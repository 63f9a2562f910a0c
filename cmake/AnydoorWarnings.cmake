# Warnings as errors for anydoor's own targets (never for third-party code).
add_library(anydoor_warnings INTERFACE)
target_compile_options(anydoor_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Woverloaded-virtual
  -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough
  -Wno-missing-field-initializers  # designated initializers leave fields defaulted by design
  # (-Wnull-dereference is left out: GCC 12 reports it inside inlined Boost.Asio code)
  -Werror)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  # GCC 12 reports Asio's coroutine frames as freed by a mismatched operator
  # delete when it inlines a frame's allocation (at -O1 and in some -O2
  # files): a false positive, both are awaitable_frame_base's own
  # operators (its thread-local recycling allocator).
  target_compile_options(anydoor_warnings INTERFACE -Wno-mismatched-new-delete)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND ANYDOOR_SANITIZE)
  # Under the sanitizers' instrumentation (and at -O1, as scripts/test builds
  # them) GCC 12 reports Boost.Asio's own locals as maybe-uninitialized
  # (use_future's async_completion, inlined into our files): false
  # positives. The plain build keeps the warning.
  target_compile_options(anydoor_warnings INTERFACE -Wno-maybe-uninitialized)
endif()
function(anydoor_own_target target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:anydoor_warnings>)
endfunction()
