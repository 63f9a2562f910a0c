# Runs a command and checks its exit code AND its output (CTest's
# PASS_REGULAR_EXPRESSION alone ignores the exit code: a program that prints
# the expected line and then fails would pass).
#
#   cmake -DCMD=<program>[;args...] [-DPASS_REGEX=<re>] [-DFAIL_REGEX=<re>]
#         [-DTIMEOUT=<seconds>] -P check_output.cmake
#
# Fails when the command cannot start, times out or exits non-zero, when
# PASS_REGEX does not match its output (stdout and stderr together), or when
# FAIL_REGEX does. The output is printed either way.
cmake_minimum_required(VERSION 3.20)

if(NOT CMD)
  message(FATAL_ERROR "check_output: CMD is not set")
endif()
if(NOT TIMEOUT)
  set(TIMEOUT 110)  # below the tests' 120 s: the child is killed, not orphaned
endif()

execute_process(COMMAND ${CMD}
                OUTPUT_VARIABLE out ERROR_VARIABLE out  # one variable: merged, in order
                RESULT_VARIABLE rc TIMEOUT ${TIMEOUT})
message("${out}")

set(problems "")
if(NOT rc STREQUAL "0")
  string(APPEND problems "\n  exit: ${rc} (expected 0)")
endif()
if(DEFINED PASS_REGEX AND NOT out MATCHES "${PASS_REGEX}")
  string(APPEND problems "\n  output lacks /${PASS_REGEX}/")
endif()
if(FAIL_REGEX AND out MATCHES "${FAIL_REGEX}")
  string(APPEND problems "\n  output has /${FAIL_REGEX}/: '${CMAKE_MATCH_0}'")
endif()
if(problems)
  message(FATAL_ERROR "check_output: ${CMD} failed:${problems}")
endif()
