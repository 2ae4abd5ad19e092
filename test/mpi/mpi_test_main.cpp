// doctest main for tests that run as every rank of an mpirun job.
//
// Each rank runs the same test cases in the same order (their collectives pair up) with
// doctest's console output captured; a rank prints its captured failures, tagged with its
// rank, and rank 0 alone prints the job's summary in doctest's format, where a case counts
// as passed only if it passed on every rank:
//   [doctest] test cases: 14 | 14 passed | 0 failed | 0 skipped
// Every rank exits 0 only if every case passed everywhere, so mpirun's status is the job's.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test/mpi/mpi_test_support.hpp"

namespace {

fsdp::MpiSession* g_session = nullptr;

// This rank's verdict on each test case, in the order they ran.
std::vector<std::pair<std::string, bool>>& case_results() {
  static std::vector<std::pair<std::string, bool>> results;
  return results;
}

struct CaseRecorder : doctest::IReporter {
  explicit CaseRecorder(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData& tc) override { name_ = tc.m_name; }
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    case_results().emplace_back(name_, st.testCaseSuccess);
  }
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

 private:
  std::string name_;
};

REGISTER_LISTENER("mpi_case_recorder", 1, CaseRecorder);

// Totals the ranks' verdicts; prints the failed cases and the summary on rank 0. Returns
// the number of cases that failed on some rank (or 1 if the ranks ran different cases).
int total_over_ranks(fsdp::MpiComm& comm) {
  const auto& mine = case_results();
  std::int64_t counts[2] = {static_cast<std::int64_t>(mine.size()), -static_cast<std::int64_t>(mine.size())};
  comm.all_reduce(counts, counts, 2, fsdp::DType::i64, fsdp::ReduceOp::max).wait();
  if (counts[0] != -counts[1]) {
    std::printf("[mpi] rank %d: ranks ran different numbers of test cases (%lld to %lld)\n", comm.rank(),
                static_cast<long long>(-counts[1]), static_cast<long long>(counts[0]));
    return 1;
  }
  std::vector<std::int32_t> failed(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) failed[i] = mine[i].second ? 0 : 1;
  comm.all_reduce(failed.data(), failed.data(), failed.size(), fsdp::DType::i32, fsdp::ReduceOp::max).wait();
  const int n_failed = static_cast<int>(std::count(failed.begin(), failed.end(), 1));
  if (comm.rank() == 0) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (failed[i]) std::printf("[mpi] test case failed on at least one rank: %s\n", mine[i].first.c_str());
    const int n = static_cast<int>(mine.size());
    std::printf("[mpi] world size %d\n", comm.size());
    std::printf("[doctest] test cases: %d | %d passed | %d failed | 0 skipped\n", n, n - n_failed, n_failed);
    std::fflush(stdout);
  }
  // Nobody leaves (and, in the teardown run, aborts the job) before the summary is out.
  comm.barrier().wait();
  return n_failed;
}

}  // namespace

fsdp::MpiSession& test_mpi::session() { return *g_session; }

int main(int argc, char** argv) {
  fsdp::MpiSession session(argc, argv);
  g_session = &session;
  const int rank = session.world_rank();

  // Made before the tests, so that no communicator a test leaves half-made (the teardown
  // case's) can pair with it.
  auto totals = fsdp::MpiComm::world(session, fsdp::MpiCommOptions{std::chrono::seconds(30)});

  doctest::Context context(argc, argv);
  std::ostringstream captured;
  context.setCout(&captured);
  context.setOption("minimal", true);  // failures only; rank 0 prints the summary below
  context.setOption("no-colors", true);
  const int rc = context.run();
  if (context.shouldExit()) {  // --help, --list-test-cases, ...
    if (rank == 0) std::cout << captured.str();
    return rc;
  }
  // Failures, tagged so that only rank 0's summary reads as a doctest summary.
  const std::string tag = "[doctest rank " + std::to_string(rank) + "]";
  std::string output = std::regex_replace(captured.str(), std::regex("\\[doctest\\]"), tag);
  if (!output.empty()) std::printf("%s", output.c_str());
  std::fflush(stdout);

  // A test failed this rank's MPI job on purpose (the teardown and fatal runs): fsdp makes
  // no more MPI calls, so this rank reports its own cases, not as a doctest summary (which
  // the suite's total would count once per rank). In a run where that happens to some
  // ranks only (FSDP_MPI_TEST_PER_RANK set), the others report theirs too, before the
  // failed ranks end the job.
  if (session.failed() || std::getenv("FSDP_MPI_TEST_PER_RANK")) {
    const auto& mine = case_results();
    const auto passed = std::count_if(mine.begin(), mine.end(), [](const auto& c) { return c.second; });
    std::printf("[mpi] rank %d (%s): test cases: %zu | %zu passed | %zu failed\n", rank,
                session.failed() ? "its MPI job failed: no totals across ranks" : "its MPI job goes on", mine.size(),
                static_cast<std::size_t>(passed), mine.size() - static_cast<std::size_t>(passed));
    std::fflush(stdout);
  }
  if (session.failed()) {
    // This rank's session aborts the job when it ends, killing every rank: give the other
    // ranks whose job failed (their timeouts end within milliseconds of this one's) time to
    // print their line first. No MPI call can order this any more.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    return rc;
  }
  int failures = 0;
  try {
    failures = total_over_ranks(totals);
  } catch (const fsdp::Error& e) {
    std::printf("[mpi] rank %d: could not total the test cases: %s\n", rank, e.what());
    failures = 1;
  }
  return failures == 0 && rc == 0 ? 0 : 1;
}
