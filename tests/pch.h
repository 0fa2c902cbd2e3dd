// Precompiled header of the unit tests: the heavy, stable headers only.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
