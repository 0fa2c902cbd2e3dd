#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

namespace tdshm::detail {

spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto l = std::make_shared<spdlog::logger>("tdshm", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    l->set_level(spdlog::level::warn);
    if (const char* level = std::getenv("TDSHM_LOG_LEVEL")) {
      l->set_level(spdlog::level::from_str(level));
    }
    return l;
  }();
  return *logger;
}

}  // namespace tdshm::detail
