// bench/compile_cost.sh: the cost of fsdp/fsdp.hpp alone, nothing instantiated.
#include <fsdp/fsdp.hpp>

int main() {}
