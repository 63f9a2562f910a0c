// anydoor: everything a user of the runtime needs.
#pragma once

#include <anydoor/buffer_pool.hpp>
#include <anydoor/connection.hpp>
#include <anydoor/cuda.hpp>
#include <anydoor/error.hpp>
#include <anydoor/fabric.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/metrics.hpp>
#include <anydoor/reactor.hpp>
#include <anydoor/reactor_group.hpp>
#include <anydoor/transport/provider.hpp>
