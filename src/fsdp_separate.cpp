// //:fsdp_separate: fsdp's unit implementation compiled once (fsdp/separate_compilation.hpp).
#include "fsdp/separate_compilation.hpp"
