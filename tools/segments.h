#pragma once
// `tdshm ls`, `tdshm inspect NAME`, `tdshm gc`: the operator's view of the segments in /dev/shm
// (see segments.cpp; the reader is src/shm/reader/inspect.h).

#include <cstdio>

namespace tdshm::tools {

/// Each runs its command with the arguments after the command's name and returns the exit code:
///  ls       0 (1: /dev/shm cannot be read; 2: bad arguments)
///  inspect  0 a valid segment of this layout version; 3 the name exists but is not one (refused,
///           corrupt, another layout version, a lock file alone, ...); 1 no such name; 2 bad
///           arguments
///  gc       0 (1: a removal failed; 2: bad arguments)
int run_ls(int argc, char** argv);
int run_inspect(int argc, char** argv);
int run_gc(int argc, char** argv);
void print_segments_usage(FILE* out);

}  // namespace tdshm::tools
