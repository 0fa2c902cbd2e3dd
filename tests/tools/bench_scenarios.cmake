# ctest tdshm_bench_scenarios: the workload scenarios and reports of `tdshm bench`.
#
#   cmake -DTDSHM=<path of the tdshm tool> -DDIR=<scratch folder> -P bench_scenarios.cmake
#
#  1. --scenario loader --quick --workers 1,2 --progress --json: exit 0; one row per pattern
#     (blocking, irecv-ahead, consolidated: shm, gloo, memcpy; loan-copy, loan-view-c: shm,
#     gloo; loan-view: shm, gloo, inplace; feed: shm) and N with positive
#     batches_per_s, gbps, worker_write_s and main_read_s, batches = 30 N; the ceilings' lines;
#     the progress lines go to stderr, stdout has no \r;
#     the oversubscription note for N=2 on a machine with fewer than 3 CPUs.
#  2. --scenario actor-learner --quick --json: exit 0; a row per transport (shm, gloo, memcpy),
#     positive steps_per_s; --scenario board --quick: a row per board / TorchRL pattern with a
#     positive p50_us, and the goal lines.
#  3. --compare: a file against itself exits 0 with every row matched; against three runs (two
#     like it, one twice as fast) too, by their median; against a doctored copy
#     whose throughputs are doubled exits 3 and says REGRESSION, but 0 with --threshold 60; rows
#     on one side only are listed, not failures.
#  4. --world 2,9,65: a line per world size with its segment bytes, growing with the world;
#     the same in the JSON rows.
#  5. --plot out.svg from the rows above and a small size sweep: a non-empty SVG with the
#     charts' titles (when gnuplot is installed); without gnuplot in PATH: exit 1 naming it.
#  6. TDSHM_BENCH_FAULT: a wrong value from a worker, or a worker that exits, fails the run
#     (exit 1) with the reason, and no segment of the run is left in /dev/shm.

cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")

# Runs `tdshm bench <args...>`; sets <prefix>_rc, <prefix>_out, <prefix>_err in the caller.
function(bench prefix)
  execute_process(
    COMMAND "${TDSHM}" bench ${ARGN}
    RESULT_VARIABLE rc
    OUTPUT_VARIABLE out
    ERROR_VARIABLE err
    TIMEOUT 60)
  message("---- tdshm bench ${ARGN} (exit ${rc})\n${out}${err}")
  set(${prefix}_rc "${rc}" PARENT_SCOPE)
  set(${prefix}_out "${out}" PARENT_SCOPE)
  set(${prefix}_err "${err}" PARENT_SCOPE)
endfunction()

function(expect_rc what rc expected)
  if(NOT "${rc}" STREQUAL "${expected}")
    message(FATAL_ERROR "${what}: exit code '${rc}', expected ${expected}")
  endif()
endfunction()

function(expect_in what text needle)
  string(FIND "${text}" "${needle}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "${what}: '${needle}' not found")
  endif()
endfunction()

# A number as the tool writes it (%.6g) that is positive: no sign, not all zeros.
function(expect_positive what value)
  if(NOT value MATCHES "^[0-9.]+(e[-+][0-9]+)?$" OR value MATCHES "^[0.]+$")
    message(FATAL_ERROR "${what}: '${value}' is not a positive number")
  endif()
endfunction()

# The rows of a JSON Lines file whose "scenario" is `scenario`, as a list.
function(rows_of json scenario out_var)
  file(STRINGS "${json}" lines)
  set(rows "")
  foreach(line IN LISTS lines)
    string(JSON s ERROR_VARIABLE no GET "${line}" scenario)
    if(NOT no AND s STREQUAL "${scenario}")
      list(APPEND rows "${line}")
    endif()
  endforeach()
  set(${out_var} "${rows}" PARENT_SCOPE)
endfunction()

file(GLOB segments_before "/dev/shm/tdshm.tdshm-bench-*")

# ---- 1. loader ----
set(loader_json "${DIR}/loader.jsonl")
bench(l --scenario loader --quick --workers 1,2 --progress --json "${loader_json}")
expect_rc("loader" "${l_rc}" 0)
string(FIND "${l_out}" "\r" cr)
if(NOT cr EQUAL -1)
  message(FATAL_ERROR "loader: a carriage return in stdout (the progress line belongs on stderr)")
endif()
expect_in("loader: progress on stderr" "${l_err}" "[scenario loader ")
expect_in("loader: progress on stderr" "${l_err}" "irecv-ahead gloo N=2")
cmake_host_system_information(RESULT cpus QUERY NUMBER_OF_LOGICAL_CORES)
if(cpus LESS 3)
  expect_in("loader: N=2 on ${cpus} CPUs" "${l_out}" "oversubscribed")
endif()
expect_in("loader: the write-and-read ceiling" "${l_out}" "CPU(s) doing nothing else")
rows_of("${loader_json}" loader rows)
list(LENGTH rows n)
if(NOT n EQUAL 34)
  message(FATAL_ERROR "loader: ${n} rows in ${loader_json}, expected 34 (17 pattern/transport pairs x 2 N)")
endif()
set(seen "")
foreach(row IN LISTS rows)
  string(JSON pattern GET "${row}" pattern)
  string(JSON transport GET "${row}" transport)
  string(JSON workers GET "${row}" workers)
  string(JSON batches GET "${row}" batches)
  string(JSON rate GET "${row}" batches_per_s)
  string(JSON gbps GET "${row}" gbps)
  string(JSON repeats GET "${row}" repeats)
  expect_positive("loader batches_per_s in ${row}" "${rate}")
  expect_positive("loader gbps in ${row}" "${gbps}")
  string(JSON write GET "${row}" worker_write_s)
  string(JSON read GET "${row}" main_read_s)
  expect_positive("loader worker_write_s in ${row}" "${write}")
  expect_positive("loader main_read_s in ${row}" "${read}")
  math(EXPR want "30 * ${workers}")
  if(NOT batches EQUAL want OR NOT repeats EQUAL 1)
    message(FATAL_ERROR "loader: batches ${batches} (expected ${want}) or repeats ${repeats} (expected 1) in ${row}")
  endif()
  list(APPEND seen "${pattern}/${transport}/${workers}")
endforeach()
set(pairs "")
foreach(pattern blocking irecv-ahead consolidated)
  list(APPEND pairs ${pattern}/shm ${pattern}/gloo ${pattern}/memcpy)
endforeach()
list(APPEND pairs loan-copy/shm loan-copy/gloo loan-view/shm loan-view/gloo loan-view/inplace loan-view-c/shm
     loan-view-c/gloo feed/shm)
foreach(pair IN LISTS pairs)
  foreach(workers 1 2)
    if(NOT "${pair}/${workers}" IN_LIST seen)
      message(FATAL_ERROR "loader: no row for ${pair} N=${workers} (rows: ${seen})")
    endif()
  endforeach()
endforeach()

# ---- 2. actor-learner ----
set(actor_json "${DIR}/actor.jsonl")
bench(a --scenario actor-learner --quick --json "${actor_json}")
expect_rc("actor-learner" "${a_rc}" 0)
rows_of("${actor_json}" actor-learner rows)
set(seen "")
foreach(row IN LISTS rows)
  string(JSON transport GET "${row}" transport)
  string(JSON actors GET "${row}" actors)
  string(JSON rate GET "${row}" steps_per_s)
  expect_positive("actor-learner steps_per_s in ${row}" "${rate}")
  if(NOT actors EQUAL 2)
    message(FATAL_ERROR "actor-learner: actors ${actors}, expected the default 2, in ${row}")
  endif()
  list(APPEND seen "${transport}")
endforeach()
if(NOT "shm" IN_LIST seen OR NOT "gloo" IN_LIST seen OR NOT "memcpy" IN_LIST seen)
  message(FATAL_ERROR "actor-learner: rows for shm, gloo and memcpy expected, got: ${seen}")
endif()

# ---- 2b. board: the board against TorchRL's pattern, 2 readers ----
set(board_json "${DIR}/board.jsonl")
bench(b --scenario board --quick --json "${board_json}")
expect_rc("board" "${b_rc}" 0)
expect_in("board: the view's goal line" "${b_out}" "goal: view (us)")
expect_in("board: the writer at full speed" "${b_out}" "goal: full speed: reader copy / memcpy")
expect_in("board: each reader's p50" "${b_out}" "each reader's p50 us")
rows_of("${board_json}" board rows)
set(seen "")
foreach(row IN LISTS rows)
  string(JSON pattern GET "${row}" pattern)
  string(JSON transport GET "${row}" transport)
  string(JSON p50 GET "${row}" p50_us)
  expect_positive("board p50_us in ${row}" "${p50}")
  list(APPEND seen "${transport}/${pattern}")
endforeach()
foreach(want board/publish-to-visible board/commit-to-visible board/commit-to-visible-sleeping
             torchrl/update-to-visible torchrl/notify-to-visible)
  if(NOT "${want}" IN_LIST seen)
    message(FATAL_ERROR "board: no row ${want} (rows: ${seen})")
  endif()
endforeach()

# ---- 3. --compare ----
bench(same --from "${loader_json}" --compare "${loader_json}")
expect_rc("compare with itself" "${same_rc}" 0)
expect_in("compare with itself" "${same_out}" "34 matched, 0 regression(s)")

# The old run twice as fast: every matched throughput dropped by 50 %.
file(STRINGS "${loader_json}" lines)
set(doctored "${DIR}/doctored.jsonl")
file(WRITE "${doctored}" "")
foreach(line IN LISTS lines)
  # Text edits keep the row on one line (string(JSON SET) would pretty-print it).
  if(NOT line MATCHES "\"batches_per_s\":([0-9]+)[.0-9]*,")
    message(FATAL_ERROR "no plain batches_per_s in: ${line}")
  endif()
  math(EXPR doubled "2 * ${CMAKE_MATCH_1} + 2")
  string(REGEX REPLACE "\"batches_per_s\":[0-9.]+," "\"batches_per_s\":${doubled}," line "${line}")
  file(APPEND "${doctored}" "${line}\n")
endforeach()
bench(worse --from "${loader_json}" --compare "${doctored}")
expect_rc("compare with a doctored run" "${worse_rc}" 3)
expect_in("compare with a doctored run" "${worse_out}" "REGRESSION")
expect_in("compare with a doctored run" "${worse_out}" "34 matched, 34 regression(s)")
bench(lenient --from "${loader_json}" --compare "${doctored}" --threshold 60)
expect_rc("compare with --threshold 60" "${lenient_rc}" 0)
# Runs repeated on one side count by their median: two runs like this one and one twice as fast
# are no regression, and the row shows its three runs' range.
file(READ "${loader_json}" like_this)
file(READ "${doctored}" twice_as_fast)
set(three "${DIR}/three_runs.jsonl")
file(WRITE "${three}" "${like_this}${twice_as_fast}${like_this}")
bench(median --from "${loader_json}" --compare "${three}")
expect_rc("compare with the median of three runs" "${median_rc}" 0)
expect_in("compare with the median of three runs" "${median_out}" "34 matched, 0 regression(s)")
expect_in("compare with the median of three runs" "${median_out}" "old [3: ")
bench(disjoint --from "${actor_json}" --compare "${loader_json}")
expect_rc("compare of disjoint rows" "${disjoint_rc}" 0)
expect_in("compare of disjoint rows" "${disjoint_out}" "only in ${loader_json}")
expect_in("compare of disjoint rows" "${disjoint_out}" "only in this run")

# ---- 4. --world ----
set(world_json "${DIR}/world.jsonl")
bench(w --world 2,9,65 --json "${world_json}")
expect_rc("--world" "${w_rc}" 0)
set(last 0)
foreach(world 2 9 65)
  string(REGEX MATCH "\n +${world} +([0-9]+) " line "${w_out}")
  if(NOT line)
    message(FATAL_ERROR "--world: no line for world ${world}")
  endif()
  set(bytes "${CMAKE_MATCH_1}")
  expect_positive("--world ${world}" "${bytes}")
  if(bytes LESS_EQUAL last)
    message(FATAL_ERROR "--world: ${bytes} bytes for world ${world} is not more than ${last} for the smaller world")
  endif()
  set(last "${bytes}")
endforeach()
rows_of("${world_json}" segment rows)
list(LENGTH rows n)
if(NOT n EQUAL 3)
  message(FATAL_ERROR "--world: ${n} segment rows in ${world_json}, expected 3")
endif()

# ---- 5. --plot ----
set(sweep_json "${DIR}/sweep.jsonl")
file(WRITE "${sweep_json}"
  "{\"transport\":\"shm\",\"mode\":\"spinning\",\"workload\":\"\",\"leaves\":1,\"bytes\":8,\"p50_us\":1.5,\"gbps\":0.0053}\n"
  "{\"transport\":\"shm\",\"mode\":\"spinning\",\"workload\":\"\",\"leaves\":1,\"bytes\":65536,\"p50_us\":9,\"gbps\":7.3}\n"
  "{\"transport\":\"gloo\",\"mode\":\"tcp-loopback\",\"workload\":\"\",\"leaves\":1,\"bytes\":8,\"p50_us\":30,\"gbps\":0.00027}\n"
  "{\"transport\":\"gloo\",\"mode\":\"tcp-loopback\",\"workload\":\"\",\"leaves\":1,\"bytes\":65536,\"p50_us\":60,\"gbps\":1.1}\n")
set(svg "${DIR}/out.svg")
find_program(GNUPLOT gnuplot)
bench(p --from "${sweep_json},${loader_json},${actor_json}" --plot "${svg}")
if(GNUPLOT)
  expect_rc("--plot" "${p_rc}" 0)
  file(SIZE "${svg}" size)
  if(size EQUAL 0)
    message(FATAL_ERROR "--plot: ${svg} is empty")
  endif()
  file(READ "${svg}" text)
  foreach(needle "<svg" "p50 one-way latency" "loader: batches/s" "actor-learner: steps/s" "consolidated N=2")
    expect_in("--plot: ${svg}" "${text}" "${needle}")
  endforeach()
else()
  message(WARNING "gnuplot is not installed: only the error path of --plot is checked")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env PATH=/nonexistent "${TDSHM}" bench --from "${loader_json}" --plot "${DIR}/none.svg"
  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET TIMEOUT 60)
expect_rc("--plot without gnuplot" "${rc}" 1)
expect_in("--plot without gnuplot" "${err}" "gnuplot is not in PATH")

# ---- 6. failures ----
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env TDSHM_BENCH_FAULT=loader-data "${TDSHM}" bench --scenario loader --quick --workers 1
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
message("---- TDSHM_BENCH_FAULT=loader-data (exit ${rc})\n${out}${err}")
expect_rc("a wrong batch" "${rc}" 1)
expect_in("a wrong batch" "${out}" "meta.worker[0] is 99, expected 1")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env TDSHM_BENCH_FAULT=worker-exit "${TDSHM}" bench --scenario loader --quick --workers 2
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
message("---- TDSHM_BENCH_FAULT=worker-exit (exit ${rc})\n${out}${err}")
expect_rc("a worker that exits" "${rc}" 1)
expect_in("a worker that exits" "${out}" "worker 1 exited with 7")

file(GLOB segments_after "/dev/shm/tdshm.tdshm-bench-*")
list(REMOVE_ITEM segments_after ${segments_before})
# A segment is named tdshm-bench-<pid of the bench that made it>-...: one whose bench still runs
# belongs to another bench running beside this test (not a leak of these runs, which all ended).
set(leaked "")
foreach(seg IN LISTS segments_after)
  if(seg MATCHES "tdshm\\.tdshm-bench-([0-9]+)-")
    execute_process(COMMAND kill -0 ${CMAKE_MATCH_1} RESULT_VARIABLE alive OUTPUT_QUIET ERROR_QUIET)
    if(alive EQUAL 0)
      continue()
    endif()
  endif()
  list(APPEND leaked "${seg}")
endforeach()
if(leaked)
  message(FATAL_ERROR "segments left in /dev/shm: ${leaked}")
endif()
message(STATUS "tdshm_bench_scenarios: all checks passed")
