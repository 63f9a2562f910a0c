# Warnings as errors for anydoor's own targets (never for third-party code).
add_library(anydoor_warnings INTERFACE)
target_compile_options(anydoor_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Woverloaded-virtual
  -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough
  -Wno-missing-field-initializers  # designated initializers leave fields defaulted by design
  # (-Wnull-dereference is left out: GCC 12 reports it inside inlined Boost.Asio code)
  -Werror)
function(anydoor_own_target target)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:anydoor_warnings>)
endfunction()
