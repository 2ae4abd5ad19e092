#pragma once
// The unit's implementation, compiled once: include this header in exactly one .cpp file
// of a program whose every file defines FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp).
// It defines detail::make_unit, through which fsdp::shard builds each unit, and with it
// everything a unit runs (setup, hooks, flat parameters, summon), and the other functions
// that depend on no template argument (fsdp/core/config.hpp): ShardedModel's and
// ExecutionOrder's members, ThreadComm's and ThreadGroupState's collective steps,
// ThreadGroup::run's threads (run_ranks), HostDevice's quantization, the setup's
// cross-rank check (detail::check_same_across_ranks), the host arithmetic. The engine's
// files then compile only what they call. Bazel: depend on //:fsdp_separate, which compiles
// src/fsdp_separate.cpp (this header) and defines FSDP_SEPARATE_COMPILATION for its users.
#if !defined(FSDP_SEPARATE_COMPILATION)
#error "fsdp/separate_compilation.hpp: define FSDP_SEPARATE_COMPILATION in every file of the program (fsdp/core/config.hpp)"
#endif
#if defined(FSDP_DECL)
#error "fsdp/separate_compilation.hpp: include it before any other fsdp header (best in a .cpp file of its own)"
#endif
#define FSDP_SEPARATE_COMPILATION_SOURCE
#include "fsdp/core/config.hpp"
#include "fsdp/unit/sharded.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
