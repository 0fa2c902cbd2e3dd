#pragma once
// `tdshm stress`: SIGKILL at random instants of real lifecycles (rendezvous, per-leaf and
// consolidated transfers, init_remote, broadcast, a sender blocked on a full ring, segment
// creation), each followed by a fresh group under the same name; and destroy/init loops under one
// name (`--scenario recreate`). Only the public API is used. See stress/run.cpp.

#include <cstdio>

namespace tdshm::tools {

/// Runs `tdshm stress` with the arguments after "stress"; returns the exit code (0: no hang,
/// crash, wrong data, recovery failure or leak; 1: some; 2: bad arguments).
int run_stress(int argc, char** argv);
void print_stress_usage(FILE* out);

}  // namespace tdshm::tools
