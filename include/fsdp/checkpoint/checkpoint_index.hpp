#pragma once
// CheckpointIndex, the index.json of a sharded checkpoint directory, whole: its types
// (checkpoint_index_types.hpp, where the format is shown), reading and writing it as JSON
// (checkpoint_index_json.hpp) and its checks (read_planner.hpp, which shares the checks'
// tables with the planner of reads). Include this one.
#include "fsdp/checkpoint/checkpoint_index_json.hpp"
#include "fsdp/checkpoint/checkpoint_index_types.hpp"
#include "fsdp/checkpoint/read_planner.hpp"
