// Interop with an independent implementation of the published safetensors format
// (safetensors_interop.py: Python 3 and numpy, no safetensors package): a file fsdp writes
// is read there with equal tensors, and a file written there loads in fsdp with equal
// values. Without python3 + numpy the cases report as skipped, never as passed.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fsdp/checkpoint/safetensors.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"

namespace checkpoint_safetensors_interop_test {

using fsdp::DType;
using fsdp::checkpoint::SafetensorsFile;
using fsdp::checkpoint::SafetensorsWriter;
using fsdp::checkpoint::Shape;

namespace {

const char* const script = "test/checkpoint/safetensors_interop.py";  // from the workspace root (Bazel's test cwd too)

// The first Python with numpy: the one on PATH, else Debian's (PATH may hold another one).
std::string find_python() {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    const std::string probe = std::string(python) + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return python;
  }
  return "";
}
const std::string python = find_python();

struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;
};

template <class T>
Tensor tensor(std::string name, DType dtype, Shape shape, const std::vector<T>& values) {
  Tensor t{std::move(name), dtype, std::move(shape), std::vector<std::byte>(values.size() * sizeof(T))};
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

// The tensors of expected() in safetensors_interop.py, computed the same way.
std::vector<Tensor> expected() {
  std::vector<float> f32;
  for (int i = 0; i < 6; ++i) f32.push_back(static_cast<float>((i - 2.5) * 0.25));
  std::vector<double> f64;
  for (int i = 0; i < 4; ++i) f64.push_back(i * 0.1 - 1.0);
  std::vector<std::uint16_t> f16;
  for (int i = 0; i < 5; ++i) f16.push_back(fsdp::float_to_f16_bits(static_cast<float>(i * 0.5 - 1.0)));
  return {tensor("f32", DType::f32, {2, 3}, f32),
          tensor("f64", DType::f64, {4}, f64),
          tensor("f16", DType::f16, {5}, f16),
          tensor("bf16", DType::bf16, {3}, std::vector<std::uint16_t>{0x3F80, 0xC000, 0x4049}),
          tensor("i64", DType::i64, {3}, std::vector<std::int64_t>{-(1LL << 40), 0, (1LL << 62) + 7}),
          tensor("i32", DType::i32, {2, 2}, std::vector<std::int32_t>{-1, 2, INT32_MAX, INT32_MIN}),
          tensor("i8", DType::i8, {3}, std::vector<std::int8_t>{-128, 0, 127}),
          tensor("u8", DType::u8, {4}, std::vector<std::uint8_t>{0, 1, 128, 255}),
          tensor("scalar", DType::f32, {}, std::vector<float>{3.5f}),
          tensor("empty", DType::f32, {0}, std::vector<float>{})};
}

// Runs the script; its exit status and what it printed.
struct ScriptRun {
  int status;
  std::string output;
};
ScriptRun run_script(const std::string& command, const std::filesystem::path& file) {
  const std::filesystem::path out = file.string() + ".out";
  const std::string line = python + " " + script + " " + command + " '" + file.string() + "' >'" + out.string() + "' 2>&1";
  const int status = std::system(line.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, test_support::read_bytes(out)};
}

}  // namespace

TEST_CASE("the interop script is where the tests expect it") {
  CHECK(std::filesystem::exists(script));
}

TEST_CASE("a file written by fsdp is read by the independent Python reader with equal tensors" *
          doctest::skip(python.empty())) {
  test_support::TempDir dir;
  const auto path = dir / "fsdp.safetensors";
  const std::vector<Tensor> tensors = expected();
  SafetensorsWriter w;
  for (const Tensor& t : tensors) w.add(t.name, t.dtype, t.shape, t.bytes.data());
  w.set_metadata("format", "pt");
  w.set_metadata("step", "7");
  w.write(path);
  const ScriptRun run = run_script("check", path);
  INFO(run.output);
  CHECK(run.status == 0);
}

TEST_CASE("a file written by the independent Python writer loads in fsdp with equal values" *
          doctest::skip(python.empty())) {
  test_support::TempDir dir;
  const auto path = dir / "numpy.safetensors";
  const ScriptRun run = run_script("write", path);
  INFO(run.output);
  REQUIRE(run.status == 0);
  const SafetensorsFile f = SafetensorsFile::open(path);
  CHECK(f.metadata() == std::map<std::string, std::string, std::less<>>{{"format", "pt"}, {"step", "7"}});
  const std::vector<Tensor> tensors = expected();
  CHECK(f.tensors().size() == tensors.size());
  for (const Tensor& t : tensors) {
    CAPTURE(t.name);
    const auto* info = f.find(t.name);
    REQUIRE(info != nullptr);
    CHECK(info->dtype == t.dtype);
    CHECK(info->shape == t.shape);
    std::vector<std::byte> got(info->bytes());
    f.read(t.name, got.data(), got.size());
    CHECK(got == t.bytes);
  }
}

}  // namespace checkpoint_safetensors_interop_test
