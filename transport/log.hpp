// The "anydoor" spdlog logger; its level comes from ANYDOOR_LOG
// (trace, debug, info, warn, error, critical, off; default info).
#pragma once

#include <spdlog/spdlog.h>

namespace anydoor {
spdlog::logger& log();
}
