#include "log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>

namespace anydoor {

spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto existing = spdlog::get("anydoor");
    if (existing) return existing;
    auto l = spdlog::stderr_color_mt("anydoor");
    l->set_level(spdlog::level::info);
    if (const char* level = std::getenv("ANYDOOR_LOG"); level != nullptr && *level != '\0') {
      l->set_level(spdlog::level::from_str(level));
    }
    return l;
  }();
  return *logger;
}

}  // namespace anydoor
