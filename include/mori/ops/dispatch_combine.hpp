// Expert-parallel dispatch/combine: config, buffer layout and size hints, the handle, and the
// phase trace's record layout.
#pragma once

#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"
#include "mori/ops/dispatch_combine/trace.hpp"
