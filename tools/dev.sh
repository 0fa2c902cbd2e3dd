#!/usr/bin/env bash
# Developer and CI entry point for tdshm.
#
#   tools/dev.sh test  [ctest args...]   build everything into build/ and run the test suite
#   tools/dev.sh demo  [args...]         build the tdshm tool and run `tdshm demo args...`
#   tools/dev.sh bench [args...]         build the tdshm tool and run `tdshm bench args...`
#                                        (two-process ping-pong; --help lists its options)
#   tools/dev.sh bench-consolidate [args...]  build and run the consolidate micro-benchmark
#   tools/dev.sh fuzz  [seconds]         build the libFuzzer targets (clang, build-fuzz/) and run
#                                        each for `seconds` (default 600) with a corpus kept in
#                                        build-fuzz/corpus/; prints executions, time, crashes
#   tools/dev.sh sanitize                build and run the whole suite under ASan+UBSan (preset
#                                        asan) and the thread tests under TSan (preset tsan)
#
# Each subcommand first makes sure the Debian packages tdshm needs are installed: as root it
# installs the missing ones with apt-get, otherwise it prints the apt-get line and stops. The
# build directory is configured once (CMake preset "default": Ninja, RelWithDebInfo, warnings as
# errors) and then built incrementally; Ninja re-runs CMake by itself when a CMakeLists changes.
set -euo pipefail

# Everything is relative to the repository root, found from this script's own location.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly ROOT
readonly BUILD_DIR=build
# The build machines have 2 cores and are shared: never run more than 2 jobs.
readonly JOBS=2

# What a build and test run needs. libtorch-dev brings the -dev packages its CMake config looks
# for (libgflags-dev, libgoogle-glog-dev, libprotobuf-dev) as Depends, so
# --no-install-recommends is enough. The fuzz targets (tests/fuzz, also run by the test
# fuzz.smoke) need clang-14 and the runtimes of -fsanitize=fuzzer,address,undefined, which are in
# libclang-rt-14-dev (clang-14 only recommends it; libfuzzer-14-dev holds a standalone
# libFuzzer.a that -fsanitize=fuzzer does not use); llvm-14 brings llvm-symbolizer for readable
# crash reports. The Python package (python/, built by the default preset, which requires it)
# and the tests with Python ranks need Debian's python3 with torch (python3-torch, whose
# libtorch_python the module links), its headers (python3-dev), pybind11-dev, and python3-numpy.
# gnuplot-nox draws `tdshm bench --plot` (and its test tdshm_bench_scenarios) without X11.
# python3-venv, python3-setuptools and python3-wheel: `pip install .` in a venv (the test
# python.pip_install; docs/python-install.md). clang-format-14: tools/format_check.sh.
readonly PACKAGES=(g++ cmake ninja-build libtorch-dev libgloo-dev libspdlog-dev
                   libgtest-dev libbenchmark-dev clang-14 libclang-rt-14-dev llvm-14
                   python3-torch python3-numpy python3-dev pybind11-dev gnuplot-nox
                   python3-venv python3-setuptools python3-wheel clang-format-14)

log() { printf 'dev.sh: %s\n' "$*" >&2; }

usage() {
  sed -n '2,14s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
}

ensure_packages() {
  if ! command -v dpkg-query >/dev/null 2>&1; then
    log "dpkg-query not found: not a Debian system, skipping the package check"
    return 0
  fi
  local missing=() pkg
  for pkg in "${PACKAGES[@]}"; do
    # Status abbreviation "ii" = desired install, currently installed.
    if [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "${pkg}" 2>/dev/null || true)" != ii* ]]; then
      missing+=("${pkg}")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  if ((EUID != 0)); then
    log "missing Debian packages: ${missing[*]}"
    log "install them with:"
    printf '  sudo apt-get install -y --no-install-recommends %s\n' "${missing[*]}" >&2
    exit 1
  fi
  log "installing missing Debian packages: ${missing[*]}"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# Configures build/ only when it has never been generated; after that Ninja itself re-runs CMake
# whenever a CMakeLists.txt or another configure input changes.
ensure_configured() {
  if [[ ! -f "${BUILD_DIR}/build.ninja" ]]; then
    log "configuring ${BUILD_DIR}/ (preset default)"
    cmake --preset default
  fi
}

build() {
  cmake --build "${BUILD_DIR}" --parallel "${JOBS}" "$@"
}

main() {
  local cmd="${1:-}"
  if (($# > 0)); then
    shift
  fi
  cd "${ROOT}"
  case "${cmd}" in
    test)
      ensure_packages
      ensure_configured
      build
      ctest --test-dir "${BUILD_DIR}" --output-on-failure -j"${JOBS}" "$@"
      ;;
    demo)
      ensure_packages
      ensure_configured
      build --target tdshm_cli
      exec "${BUILD_DIR}/tools/tdshm" demo "$@"
      ;;
    bench)
      ensure_packages
      ensure_configured
      build --target tdshm_cli
      exec "${BUILD_DIR}/tools/tdshm" bench "$@"
      ;;
    bench-consolidate)
      ensure_packages
      ensure_configured
      build --target tdshm_bench_consolidate
      exec "${BUILD_DIR}/benchmarks/tdshm_bench_consolidate" "$@"
      ;;
    fuzz)
      ensure_packages
      # Its own clang build folder (the main build uses g++); the corpus grows there from run
      # to run, next to each target's committed seeds (tests/fuzz/corpus/, never written).
      exec bash tests/fuzz/run_fuzzers.sh --build-dir build-fuzz --corpus-dir build-fuzz/corpus \
        --seconds "${1:-600}" --jobs "${JOBS}"
      ;;
    sanitize)
      # Apart from `test` because the two sanitizer builds cost more than the main one; CI runs
      # both commands (.ci/run).
      ensure_packages
      cmake --preset asan
      cmake --build build-asan --parallel "${JOBS}"
      # A test that fails is run once more (--repeat until-pass:2) and fails the run only if it
      # fails again: under ASan a forked gloo rank of dist.DistErrors overstayed its 60 s deadline
      # in some runs. One cause was found (2026-12-01): a child forked while the test's watchdog
      # thread was still starting inherited an ASan allocator lock held (fixed in
      # shm_test_support.cpp); the rerun stays for any other. ctest's summary names every test
      # that needed it.
      ctest --preset asan --repeat until-pass:2
      cmake --preset tsan
      cmake --build build-tsan --parallel "${JOBS}" --target tdshm_shm_tests
      TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" OMP_NUM_THREADS=1 \
        build-tsan/tests/tdshm_shm_tests --gtest_filter='*Threads*'
      ;;
    -h | --help | help)
      usage
      ;;
    *)
      usage
      exit 2
      ;;
  esac
}

main "$@"
