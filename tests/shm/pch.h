// Precompiled header of the shared-memory transport tests: the heavy, stable headers only.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
