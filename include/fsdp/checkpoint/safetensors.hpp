#pragma once
// Safetensors files: the header format and its validation, the writer and the reader.
#include "fsdp/checkpoint/safetensors_file.hpp"    // IWYU pragma: export
#include "fsdp/checkpoint/safetensors_header.hpp"  // IWYU pragma: export
#include "fsdp/checkpoint/safetensors_writer.hpp"  // IWYU pragma: export
