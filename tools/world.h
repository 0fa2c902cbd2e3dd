#pragma once
// `tdshm world tcp://HOST:PORT [--group NAME]`: a running "shm" world seen from its store: its
// hosts, the route between each rank and each host, the ranks' heartbeats (world.cpp;
// docs/hosts.md).

namespace tdshm::tools {

/// Runs the command with the arguments after its name. Exit code: 0 a world that runs (or lives
/// on one host), 3 a world that is lost (the reason is printed), 1 no such world or the store does
/// not answer, 2 bad arguments.
int run_world(int argc, char** argv);

}  // namespace tdshm::tools
