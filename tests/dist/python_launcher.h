#pragma once
// Python ranks for the tests that mix them with C++ ranks (tdshm_dist_tests' mixed worlds,
// tdshm_interop_tests), started from a warm interpreter.
//
// `import torch` costs a fresh python3 about a second of CPU, and those tests start about a
// hundred Python ranks. So one interpreter per python3 path (tests/python/zygote.py) imports
// torch, torch.distributed and numpy once and forks every rank from there. The rank is handed
// to this process (it becomes a child subreaper), so the test waits for it, kills it and reads
// its exit status as for a child it forked itself (Child::adopt).
#include <string>
#include <vector>

#include "shm/shm_test_support.h"

namespace tdshm::test {

struct PythonRun {
  std::string script;              // run as __main__
  std::vector<std::string> args;   // sys.argv[1:]
  std::vector<std::string> env;    // "NAME=value": the whole environment of the rank
  std::string log;                 // stdout and stderr of the rank; empty: this process's stderr
};

/// The rank's environment: this process's, without the names in `overrides`, plus `overrides`.
std::vector<std::string> environment_with(const std::vector<std::string>& overrides);

/// Starts `run` under `python` (forked from that interpreter's warm process, started on first
/// use). Throws std::runtime_error when the warm process cannot be started or does not answer
/// within 120 s.
Child start_python(const std::string& python, const PythonRun& run);

}  // namespace tdshm::test
