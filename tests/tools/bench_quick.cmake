# ctest tdshm_bench_quick: runs `tdshm bench --quick` over every transport at two sizes, then
# `tdshm bench --td --quick` over every TD transport and every TensorDict workload but the 1 GiB
# one, and checks the JSON Lines each writes: one row per transport and row (size or workload),
# with the fields workload and leaves, positive p50_us, p99_us and gbps, and p99 >= p50. UCX's row
# (ucx-posix) is measured where ucx_perftest is installed (p99 null: ucx_perftest reports p50);
# where it is not, or $TDSHM_UCX_PERFTEST names nothing, naming it must fail with a message.
#
#   cmake -DTDSHM=<path of the tdshm tool> -DJSON=<file to write> -P bench_quick.cmake
#
# The TD run writes <JSON without .jsonl>-td.jsonl.

cmake_minimum_required(VERSION 3.25)

# Runs `tdshm bench <args...> --json <json>` and fails unless it exits 0 and wrote the file.
function(run_bench json)
  file(REMOVE "${json}")
  execute_process(
    COMMAND "${TDSHM}" bench ${ARGN} --json "${json}"
    RESULT_VARIABLE rc
    OUTPUT_VARIABLE out
    ERROR_VARIABLE err
    TIMEOUT 50)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "tdshm bench ${ARGN} exited with '${rc}'")
  endif()
  if(NOT EXISTS "${json}")
    message(FATAL_ERROR "tdshm bench ${ARGN} wrote no ${json}")
  endif()
endfunction()

# Checks every row of `json` and that each transport in `transports` has a row for each key in
# `keys`: a byte count (size sweep, workload "" and leaves 1) or a workload name (leaves >= 1).
function(check_rows json transports keys)
  file(STRINGS "${json}" rows)
  set(seen "")
  foreach(row IN LISTS rows)
    string(JSON transport GET "${row}" transport)
    string(JSON mode GET "${row}" mode)
    string(JSON bytes GET "${row}" bytes)
    string(JSON iters GET "${row}" iters)
    string(JSON workload ERROR_VARIABLE no_workload GET "${row}" workload)
    string(JSON leaves ERROR_VARIABLE no_leaves GET "${row}" leaves)
    if(no_workload OR no_leaves)
      message(FATAL_ERROR "no workload or leaves field in: ${row}")
    endif()
    if(mode STREQUAL "" OR iters LESS 1 OR leaves LESS 1)
      message(FATAL_ERROR "bad mode, iters or leaves in: ${row}")
    endif()
    if(workload STREQUAL "" AND NOT leaves EQUAL 1)
      message(FATAL_ERROR "a size row (workload \"\") must have leaves 1: ${row}")
    endif()
    set(fields p50_us p99_us gbps)
    if(transport STREQUAL "ucx-posix")
      string(JSON p99_type TYPE "${row}" p99_us)
      if(NOT p99_type STREQUAL "NULL")
        message(FATAL_ERROR "ucx-posix reports no p99: p99_us must be null in: ${row}")
      endif()
      set(fields p50_us gbps)
    endif()
    foreach(field ${fields})
      string(JSON value GET "${row}" ${field})
      # Numbers as the tool prints them (%.6g): positive means no sign and not all zeros.
      if(NOT value MATCHES "^[0-9.]+(e[-+][0-9]+)?$" OR value MATCHES "^[0.]+$")
        message(FATAL_ERROR "${field} is not a positive number in: ${row}")
      endif()
    endforeach()
    if(NOT transport STREQUAL "ucx-posix")
      string(JSON p50 GET "${row}" p50_us)
      string(JSON p99 GET "${row}" p99_us)
      # if(LESS) compares numbers as integers: the whole microseconds are enough here.
      string(REGEX MATCH "^[0-9]+" p50_int "${p50}")
      string(REGEX MATCH "^[0-9]+" p99_int "${p99}")
      if(p99_int LESS p50_int)
        message(FATAL_ERROR "p99_us < p50_us in: ${row}")
      endif()
    endif()
    if(workload STREQUAL "")
      list(APPEND seen "${transport}@${bytes}")
    else()
      list(APPEND seen "${transport}@${workload}")
    endif()
  endforeach()

  foreach(transport IN LISTS transports)
    foreach(key IN LISTS keys)
      if(NOT "${transport}@${key}" IN_LIST seen)
        message(FATAL_ERROR "no JSON row for transport ${transport} at ${key} in ${json} (rows: ${seen})")
      endif()
    endforeach()
  endforeach()
  list(LENGTH rows n)
  message(STATUS "tdshm_bench_quick: ${json}: ${n} rows, one per transport and row, all positive")
endfunction()

# The size sweep.
set(transports spin ring futex c10d-spin memcpy shm shm-blocking gloo)
find_program(UCX_PERFTEST ucx_perftest)
if(UCX_PERFTEST)
  list(APPEND transports ucx-posix)
endif()
set(sizes 8 65536)
list(JOIN transports "," transport_list)
list(JOIN sizes "," size_list)
run_bench("${JSON}" --quick --transports ${transport_list} --sizes ${size_list})
check_rows("${JSON}" "${transports}" "${sizes}")

# ucx-posix named where ucx_perftest cannot be found: not measured, exit 1, and why.
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env TDSHM_UCX_PERFTEST=/nonexistent/ucx_perftest
          "${TDSHM}" bench --quick --transports spin,ucx-posix --sizes 8
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 50)
if(NOT rc EQUAL 1 OR NOT "${out}${err}" MATCHES "ucx-posix: not measured: could not be set up \\(ucx_perftest not found")
  message(FATAL_ERROR "ucx-posix without ucx_perftest: expected exit 1 and a message, got '${rc}':\n${out}${err}")
endif()

# The TensorDict mode, without memmap-1GiB (1 GiB in /dev/shm and ~8 GiB for the floors).
string(REGEX REPLACE "\\.jsonl$" "" json_stem "${JSON}")
set(td_json "${json_stem}-td.jsonl")
set(td_transports spin ring td-shm td-gloo memcpy)
set(workloads seed seed-consolidated 100x1KiB 10x1MiB 64MiB-consolidated memmap-4KiB)
list(JOIN td_transports "," td_transport_list)
list(JOIN workloads "," workload_list)
run_bench("${td_json}" --td --quick --transports ${td_transport_list} --workloads ${workload_list})
check_rows("${td_json}" "${td_transports}" "${workloads}")
