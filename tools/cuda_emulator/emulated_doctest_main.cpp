// doctest's main for tests linked with the emulated CUDA runtime: every test case must end
// without emulator violations (stream-order races, invalid memory uses). A listener
// collects them after each case under its name; main prints them and fails the run.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tools/cuda_emulator/emulator.hpp"

namespace {

std::vector<std::string> found;  // "case: violation"

struct ViolationListener : doctest::IReporter {
  explicit ViolationListener(const doctest::ContextOptions&) {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {
    for (auto& v : cuda_emulator::take_violations()) found.push_back(std::string(current_) + ": " + v);
  }
  void test_case_start(const doctest::TestCaseData& tc) override { current_ = tc.m_name; }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
  const char* current_ = "";
};

}  // namespace

DOCTEST_REGISTER_LISTENER("cuda_emulator_violations", 1, ViolationListener);

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  std::fprintf(stderr, "cuda_emulator: these cases run on the emulated CUDA runtime: they test host code, not a GPU\n");
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  for (const auto& v : found) std::fprintf(stderr, "cuda_emulator violation in %s\n", v.c_str());
  if (!found.empty()) {
    std::fprintf(stderr, "cuda_emulator: %zu violation(s): the run fails\n", found.size());
    return rc ? rc : 1;
  }
  return rc;
}
