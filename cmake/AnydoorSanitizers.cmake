# ANYDOOR_SANITIZE: "address,undefined" or "thread" (applies to everything built here).
if(ANYDOOR_SANITIZE)
  if(ANYDOOR_SANITIZE MATCHES "thread" AND ANYDOOR_SANITIZE MATCHES "address")
    message(FATAL_ERROR "ANYDOOR_SANITIZE: thread cannot be combined with address")
  endif()
  if(NOT ANYDOOR_SANITIZE MATCHES "^(address|undefined|thread)(,(address|undefined|thread))*$")
    message(FATAL_ERROR "ANYDOOR_SANITIZE='${ANYDOOR_SANITIZE}': use 'address,undefined' or 'thread'")
  endif()
  add_compile_options(-fsanitize=${ANYDOOR_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  if(ANYDOOR_SANITIZE MATCHES "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12 warns (-Wtsan) that TSan does not model atomic_thread_fence, which
    # Boost.Asio's scheduler uses; the warning is about that code, not ours.
    add_compile_options(-Wno-tsan)
  endif()
  add_link_options(-fsanitize=${ANYDOOR_SANITIZE})
endif()
