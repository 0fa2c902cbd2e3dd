#pragma once
// Internal logging: one spdlog logger named "tdshm", quiet (warnings and up) by default,
// level from TDSHM_LOG_LEVEL (trace, debug, info, warn, error, critical, off).

#include <spdlog/logger.h>

namespace tdshm::detail {

/// The library's logger. Thread safety: safe from any thread.
spdlog::logger& log();

}  // namespace tdshm::detail
