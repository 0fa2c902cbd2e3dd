// placeholder: consolidate benchmark is being written
#include <benchmark/benchmark.h>
BENCHMARK_MAIN();
