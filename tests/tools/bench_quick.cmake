# ctest tdshm_bench_quick: runs `tdshm bench --quick` over every transport at two sizes and
# checks the JSON Lines it writes: one row per transport and size, with positive p50_us,
# p99_us and gbps, and p99 >= p50.
#
#   cmake -DTDSHM=<path of the tdshm tool> -DJSON=<file to write> -P bench_quick.cmake

cmake_minimum_required(VERSION 3.25)

set(transports spin futex memcpy shm shm-blocking gloo)
set(sizes 8 65536)
list(JOIN transports "," transport_list)
list(JOIN sizes "," size_list)

file(REMOVE "${JSON}")
execute_process(
  COMMAND "${TDSHM}" bench --quick --transports ${transport_list} --sizes ${size_list} --json "${JSON}"
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 50)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tdshm bench exited with '${rc}'")
endif()
if(NOT EXISTS "${JSON}")
  message(FATAL_ERROR "tdshm bench wrote no ${JSON}")
endif()

file(STRINGS "${JSON}" rows)
set(seen "")
foreach(row IN LISTS rows)
  string(JSON transport GET "${row}" transport)
  string(JSON mode GET "${row}" mode)
  string(JSON bytes GET "${row}" bytes)
  string(JSON iters GET "${row}" iters)
  if(mode STREQUAL "" OR iters LESS 1)
    message(FATAL_ERROR "bad mode or iters in: ${row}")
  endif()
  foreach(field p50_us p99_us gbps)
    string(JSON value GET "${row}" ${field})
    # Numbers as the tool prints them (%.6g): positive means no sign and not all zeros.
    if(NOT value MATCHES "^[0-9.]+(e[-+][0-9]+)?$" OR value MATCHES "^[0.]+$")
      message(FATAL_ERROR "${field} is not a positive number in: ${row}")
    endif()
  endforeach()
  string(JSON p50 GET "${row}" p50_us)
  string(JSON p99 GET "${row}" p99_us)
  # if(LESS) compares numbers as integers: the whole microseconds are enough here.
  string(REGEX MATCH "^[0-9]+" p50_int "${p50}")
  string(REGEX MATCH "^[0-9]+" p99_int "${p99}")
  if(p99_int LESS p50_int)
    message(FATAL_ERROR "p99_us < p50_us in: ${row}")
  endif()
  list(APPEND seen "${transport}@${bytes}")
endforeach()

foreach(transport IN LISTS transports)
  foreach(size IN LISTS sizes)
    if(NOT "${transport}@${size}" IN_LIST seen)
      message(FATAL_ERROR "no JSON row for transport ${transport} at ${size} bytes (rows: ${seen})")
    endif()
  endforeach()
endforeach()
list(LENGTH rows n)
message(STATUS "tdshm_bench_quick: ${n} rows, one per transport and size, all positive")
