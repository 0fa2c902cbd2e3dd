#!/usr/bin/env bash
# Configures, builds and runs tdshm's libFuzzer targets (tests/fuzz/CMakeLists.txt), for the
# test fuzz.smoke and for `tools/dev.sh fuzz`.
#
#   run_fuzzers.sh --build-dir DIR --seconds N [--split] [--corpus-dir DIR] [--cxx COMPILER]
#                  [--jobs N] [--build-only]
#
#   --build-dir DIR   the clang build folder (configured once, then built incrementally)
#   --seconds N       how long each target runs; with --split, N seconds in all, shared equally
#   --corpus-dir DIR  keep what each target finds in DIR/<target>/ from run to run; without it a
#                     scratch folder under the build folder is emptied before each run
#   --cxx COMPILER    the clang++ to build with (default: clang++-14)
#   --jobs N          parallel build jobs (default 2)
#   --build-only      configure and build, run nothing
#
# Each target also reads its committed seeds, tests/fuzz/corpus/<target>/, but never writes
# there: libFuzzer adds new inputs only to the first corpus folder it is given. A target stops
# at its first crash (any sanitizer report, an uncaught exception, an abort, a hang past
# -timeout, an allocation past -malloc_limit_mb or memory past -rss_limit_mb); the input is kept
# under <build-dir>/artifacts/<target>/ and its full log in <build-dir>/logs/<target>.log.
# Prints executions, seconds, executions per second and crashes per target, then the totals.
# Exit status: 0 when no target crashed, 1 when one did, 2 on a usage or build error, 77 when no
# clang++ is found (the test reports itself skipped).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly ROOT

log() { printf 'fuzz: %s\n' "$*" >&2; }
die() {
  log "$*"
  exit 2
}

build_dir="" seconds="" split=0 corpus_dir="" cxx="clang++-14" jobs=2 build_only=0
while (($# > 0)); do
  case "$1" in
    --build-dir) build_dir="${2:?}"; shift 2 ;;
    --seconds) seconds="${2:?}"; shift 2 ;;
    --split) split=1; shift ;;
    --corpus-dir) corpus_dir="${2:?}"; shift 2 ;;
    --cxx) cxx="${2:?}"; shift 2 ;;
    --jobs) jobs="${2:?}"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    *) die "unknown argument '$1' (see the top of ${BASH_SOURCE[0]})" ;;
  esac
done
[[ -n "${build_dir}" ]] || die "--build-dir is required"
if ((build_only == 0)); then
  [[ "${seconds}" =~ ^[0-9]+$ ]] && ((seconds > 0)) || die "--seconds needs a positive whole number, got '${seconds}'"
fi

if ! cxx_path="$(command -v "${cxx}")"; then
  log "SKIPPED: ${cxx} not found (Debian: apt-get install clang-14 libclang-rt-14-dev)"
  exit 77
fi

# --- build -------------------------------------------------------------------------------------
if [[ ! -f "${build_dir}/build.ninja" ]]; then
  log "configuring ${build_dir} with ${cxx_path}"
  cmake -S "${ROOT}/tests/fuzz" -B "${build_dir}" -G Ninja "-DCMAKE_CXX_COMPILER=${cxx_path}" >/dev/null ||
    die "configuring ${build_dir} failed"
fi
cmake --build "${build_dir}" --parallel "${jobs}" || die "building ${build_dir} failed"
mapfile -t targets < <(grep -v '^$' "${build_dir}/fuzzers.txt")
((${#targets[@]} > 0)) || die "no fuzz target listed in ${build_dir}/fuzzers.txt"
if ((build_only)); then
  log "built ${targets[*]} in ${build_dir}"
  exit 0
fi

# --- run ---------------------------------------------------------------------------------------
per_target="${seconds}"
if ((split)); then
  per_target=$((seconds / ${#targets[@]}))
  ((per_target > 0)) || per_target=1
fi
build_abs="$(cd "${build_dir}" && pwd)"
if [[ -z "${corpus_dir}" ]]; then
  corpus_dir="${build_abs}/scratch-corpus"
  rm -rf "${corpus_dir}"
fi
mkdir -p "${corpus_dir}" "${build_abs}/logs"

# Symbolized reports: llvm-symbolizer from the same LLVM as the compiler (Debian: llvm-14).
symbolizer="$(dirname "$(readlink -f "${cxx_path}")")/llvm-symbolizer"
if [[ -x "${symbolizer}" ]]; then
  export ASAN_SYMBOLIZER_PATH="${symbolizer}" UBSAN_SYMBOLIZER_PATH="${symbolizer}"
fi
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"

total_execs=0 total_seconds=0 total_crashes=0 summary=()
for target in "${targets[@]}"; do
  seeds="${ROOT}/tests/fuzz/corpus/${target}"
  work="${corpus_dir}/${target}"
  artifacts="${build_abs}/artifacts/${target}/"
  target_log="${build_abs}/logs/${target}.log"
  mkdir -p "${work}" "${artifacts}"
  inputs=("${work}")
  if [[ -d "${seeds}" ]]; then
    inputs+=("${seeds}")
  else
    log "warning: ${target} has no seed corpus (${seeds#"${ROOT}/"}/)"
  fi
  marker="$(mktemp)"
  log "running ${target} for ${per_target} s"
  start_ns="$(date +%s%N)"
  rc=0
  "${build_abs}/${target}" -max_total_time="${per_target}" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=128 \
    -print_final_stats=1 -artifact_prefix="${artifacts}" "${inputs[@]}" >"${target_log}" 2>&1 || rc=$?
  elapsed=$((($(date +%s%N) - start_ns) / 1000000000))
  execs="$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "${target_log}" | tail -n 1)"
  execs="${execs:-0}"
  new_units="$(sed -n 's/^stat::new_units_added: *\([0-9]*\).*/\1/p' "${target_log}" | tail -n 1)"
  rate=$((elapsed > 0 ? execs / elapsed : execs))
  crashes=0
  if ((rc != 0)); then
    crashes=1
    mapfile -t found < <(find "${artifacts}" -type f -newer "${marker}")
    log "${target} FAILED (exit ${rc}); the end of its log (${target_log}):"
    tail -n 60 "${target_log}" >&2
    for input in "${found[@]}"; do
      log "input kept: ${input}; reproduce with: ${build_abs}/${target} ${input}"
    done
  fi
  rm -f "${marker}"
  line="${target}: ${execs} executions in ${elapsed} s (${rate}/s), ${crashes} crashes, ${new_units:-0} new inputs, corpus ${work}"
  log "${line}"
  summary+=("${line}")
  total_execs=$((total_execs + execs))
  total_seconds=$((total_seconds + elapsed))
  total_crashes=$((total_crashes + crashes))
done

for line in "${summary[@]}"; do printf '%s\n' "${line}"; done
printf 'fuzz: %d targets, %d executions in %d s, %d crashes\n' \
  "${#targets[@]}" "${total_execs}" "${total_seconds}" "${total_crashes}"
((total_crashes == 0)) || exit 1
