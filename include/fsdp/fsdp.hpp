#pragma once
// Everything an engine needs on the host, layer by layer (docs/layout.md): the concepts,
// the policies, the unit, the model and its training-loop features, the communicator
// adapters and the host backend. Included on their own, each with its Bazel target:
// checkpoints (fsdp/checkpoint/checkpoint.hpp), the memory planner
// (fsdp/model/memory_plan.hpp: it builds units of its own, which every file including this
// one would otherwise compile the declarations of), the multi-process backends (fsdp/asio/,
// fsdp/mpi/), the CUDA adapters (fsdp/cuda/, fsdp/nccl/), traces written as JSON
// (fsdp/core/trace_json.hpp, with nlohmann::json) and the testing tools (fsdp/testing/).

// Concepts: what the library needs from an engine and a backend.
#include "fsdp/core/cast.hpp"
#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/exit_status.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/core/work.hpp"

// Policies and settings: the choices.
#include "fsdp/policy/policies.hpp"
#include "fsdp/policy/post_accumulate_grad_hook.hpp"
#include "fsdp/policy/strategy_name.hpp"

// The unit.
#include "fsdp/core/config.hpp"
#if !defined(FSDP_SEPARATE_COMPILATION)  // then fsdp/unit/sharded.hpp comes in where units are built by hand
#include "fsdp/unit/sharded.hpp"
#endif
#include "fsdp/unit/unit.hpp"

// The model: shard(), the root, and the training-loop features.
#include "fsdp/model/clip_grad_norm.hpp"
#include "fsdp/model/deferred_init.hpp"
#include "fsdp/model/grad_scaler.hpp"
#include "fsdp/model/module_adapter.hpp"
#include "fsdp/model/shard.hpp"
#include "fsdp/model/sharded_model.hpp"

// Communicator adapters and the host backend.
#include "fsdp/comm/async_communicator.hpp"
#include "fsdp/comm/staged_communicator.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/host_tensor.hpp"
#include "fsdp/host/thread_group.hpp"
