// Expert-parallel dispatch/combine: config, buffer layout and size hints, and the handle.
#pragma once

#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"
