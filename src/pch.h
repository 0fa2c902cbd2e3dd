// Precompiled header of the library (CMakeLists.txt): the heavy, stable LibTorch headers most of
// its translation units include, parsed once per build instead of once per file. Nothing of
// tdshm's own goes here, so an edit to tdshm never rebuilds it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
