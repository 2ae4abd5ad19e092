// libFuzzer target for the store's frame parser; tools/fuzz_store.sh builds and runs it.
// The invariants are in store_fuzz_check.hpp: a broken one throws, which libFuzzer
// reports as a crash along with the input.
#include <cstddef>
#include <cstdint>

#include "store_fuzz_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  store_fuzz::check_frames(data, size);
  return 0;
}
