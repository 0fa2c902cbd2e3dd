#pragma once
// `tdshm demo`: the seed scenarios as two real processes (see demo.cpp).

#include <cstdio>

namespace tdshm::tools {

/// Runs the demo with the arguments after "demo"; returns the exit code.
int run_demo(int argc, char** argv);
void print_demo_usage(FILE* out);

}  // namespace tdshm::tools
