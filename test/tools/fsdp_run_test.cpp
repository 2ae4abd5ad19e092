// fsdp_run end to end: the binary starts /bin/sh scripts as its ranks. What each rank
// sees, how their output comes out, and how a failure, a signal or a timeout ends the job.
#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "test/tools/child_process.hpp"

namespace {

using namespace test_tools;
using namespace std::string_literals;

// Bazel puts the binary in the test's runfiles; a direct build names it in FSDP_RUN.
std::string fsdp_run_path() {
  if (const char* p = std::getenv("FSDP_RUN")) return p;
  const char* runfiles = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  REQUIRE_MESSAGE(runfiles, "set FSDP_RUN to the fsdp_run binary when running outside Bazel");
  return std::string(runfiles) + "/" + (workspace ? workspace : "fsdp") + "/tools/fsdp_run";
}

// fsdp_run FLAGS... sh -c SCRIPT, run to the end. The job gets no token from the test's
// environment unless `env_changes` gives one.
Finished fsdp_run(std::vector<std::string> flags, const std::string& script,
                  std::vector<std::string> env_changes = {}) {
  std::vector<std::string> argv{fsdp_run_path()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), {"/bin/sh", "-c", script});
  env_changes.insert(env_changes.begin(), {"FSDP_STORE_TOKEN", "FSDP_STORE_BIND"});
  return ChildProcess(argv, env_changes).wait();
}

const char* const kPrintEnv =
    "echo \"RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE "
    "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT TOKEN=$FSDP_STORE_TOKEN BIND=${FSDP_STORE_BIND-unset} "
    "HOST=${FSDP_STORE_HOST-unset}\"";

// rank -> the rest of its one line "[rank R] ..."; fails on a line without a prefix.
std::map<int, std::string> by_rank(const std::string& out) {
  std::map<int, std::string> lines;
  static const std::regex prefixed(R"(\[rank (\d+)\] (.*))");
  for (const auto& line : lines_of(out)) {
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_match(line, m, prefixed), "line without a rank prefix: '", line, "'");
    CHECK_MESSAGE(lines.emplace(std::stoi(m[1]), m[2]).second, "rank ", m[1], " printed twice");
  }
  return lines;
}

// Every process whose pid rank r wrote to dir/<name><r> is gone.
void check_gone(const TempDir& dir, const std::string& name, std::initializer_list<int> ranks) {
  for (int r : ranks) {
    const std::string path = dir.file(name + std::to_string(r)), pid = read_file(path);
    REQUIRE_MESSAGE(!pid.empty(), path, " is empty");
    CHECK_MESSAGE(process_gone(std::stoi(pid)), "pid ", pid, " (from ", path, ") still runs");
  }
}

}  // namespace

TEST_CASE("every rank sees torchrun's six variables, one port and one random token (nproc 1..4)") {
  std::set<std::string> tokens;
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const Finished f = fsdp_run({"--nproc", std::to_string(n)}, kPrintEnv);
    REQUIRE(f.status == 0);
    CHECK(f.err.empty());
    const auto lines = by_rank(f.out);
    REQUIRE(lines.size() == static_cast<std::size_t>(n));
    std::smatch m;
    REQUIRE(std::regex_search(lines.at(0), m, std::regex(R"(MASTER_PORT=(\d+) TOKEN=([0-9a-f]{32}) )")));
    const std::string port = m[1], token = m[2];
    CHECK(std::stoi(port) > 0);
    CHECK(std::stoi(port) < 65536);
    tokens.insert(token);
    for (int r = 0; r < n; ++r)
      CHECK(lines.at(r) == "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(n) +
                               " LOCAL_RANK=" + std::to_string(r) + " LOCAL_WORLD_SIZE=" + std::to_string(n) +
                               " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " TOKEN=" + token + " BIND=unset HOST=launcher");
  }
  CHECK(tokens.size() == 4);  // drawn afresh for every job
  // Who hosts the store is --store's to say: an FSDP_STORE_EXTERNAL of fsdp_run's own
  // environment does not reach the ranks, where it would contradict FSDP_STORE_HOST.
  const Finished f = fsdp_run({"--nproc", "1"}, "echo \"${FSDP_STORE_EXTERNAL-unset} $FSDP_STORE_HOST\"",
                              {"FSDP_STORE_EXTERNAL=1"});
  REQUIRE(f.status == 0);
  CHECK(by_rank(f.out) == std::map<int, std::string>{{0, "unset launcher"}});
}

TEST_CASE("one node with a master address that is not loopback: the store listens there") {
  // 10.1.2.3 is no address of this machine, so a store cannot listen there: fsdp_run, which
  // hosts it by default, fails before any rank starts, naming the address.
  const Finished f = fsdp_run({"--nproc", "1", "--master-addr", "10.1.2.3", "--master-port", "29556"}, kPrintEnv);
  CHECK(f.status == 1);
  CHECK(f.out.empty());
  CHECK(f.err.find("launch: cannot host the job's store (--store launcher): store server: could not listen on "
                   "10.1.2.3:29556") != std::string::npos);
  // Left to rank 0, the store is told where to listen.
  const Finished g =
      fsdp_run({"--nproc", "1", "--master-addr", "10.1.2.3", "--master-port", "29556", "--store", "rank0"}, kPrintEnv);
  REQUIRE(g.status == 0);
  const auto lines = by_rank(g.out);
  REQUIRE(lines.size() == 1);
  CHECK(lines.at(0).find("MASTER_ADDR=10.1.2.3 ") != std::string::npos);
  CHECK(lines.at(0).find(" BIND=10.1.2.3 HOST=rank0") != std::string::npos);
}

TEST_CASE("node 1 of 2: global ranks, the store's place and the user's token") {
  const std::vector<std::string> flags{"--nnodes",      "2",        "--node-rank",     "1",    "--nproc", "2",
                                       "--master-addr", "10.1.2.3", "--master-port", "29555"};
  // Node 0's fsdp_run hosts the store (this one hosts none: nothing listens here, and the
  // ranks start), or rank 0 does, told to listen on the master address.
  for (const std::string store : {"launcher", "rank0"}) {
    CAPTURE(store);
    auto with_store = flags;
    with_store.insert(with_store.end(), {"--store", store});
    const Finished f = fsdp_run(with_store, kPrintEnv, {"FSDP_STORE_TOKEN=s3cret"});
    REQUIRE(f.status == 0);
    const auto lines = by_rank(f.out);
    REQUIRE(lines.size() == 2);
    for (int local = 0; local < 2; ++local)
      CHECK(lines.at(2 + local) == "RANK=" + std::to_string(2 + local) + " WORLD_SIZE=4 LOCAL_RANK=" +
                                       std::to_string(local) +
                                       " LOCAL_WORLD_SIZE=2 MASTER_ADDR=10.1.2.3 MASTER_PORT=29555 TOKEN=s3cret " +
                                       (store == "rank0" ? "BIND=10.1.2.3 HOST=rank0" : "BIND=unset HOST=launcher"));
  }

  SUBCASE("--env carries the token too, and other variables") {
    auto with_env = flags;
    with_env.insert(with_env.end(), {"--env", "FSDP_STORE_TOKEN=t2", "--env", "EXTRA=a=b"});
    const Finished g = fsdp_run(with_env, "echo \"$FSDP_STORE_TOKEN $EXTRA\"");
    REQUIRE(g.status == 0);
    CHECK(by_rank(g.out) == std::map<int, std::string>{{2, "t2 a=b"}, {3, "t2 a=b"}});
  }
  SUBCASE("without a token on several nodes nothing starts") {
    const Finished g = fsdp_run(flags, "echo started");
    CHECK(g.status == 1);
    CHECK(g.out.empty());
    CHECK(g.err.find("--nnodes 2 needs FSDP_STORE_TOKEN set to the same secret on every node") != std::string::npos);
  }
}

TEST_CASE("stdout and stderr lines of 4 ranks stay whole, prefixed, in order and on their own stream") {
  // Each line is written in two pieces, so the launcher has to join them.
  const int kLines = 300;
  const Finished f = fsdp_run({"--nproc", "4"}, "i=0; while [ $i -lt " + std::to_string(kLines) +
                                                     " ]; do printf \"r$RANK-$i-\"; printf 'out\\n'; "
                                                     "printf \"r$RANK-$i-\" >&2; printf 'err\\n' >&2; i=$((i+1)); done");
  REQUIRE(f.status == 0);
  for (const auto& output : {std::pair{"out", f.out}, std::pair{"err", f.err}}) {
    const char* stream = output.first;  // not a binding: CAPTURE captures it
    const std::string& text = output.second;
    CAPTURE(stream);
    std::map<int, int> next;  // rank -> the line number expected next
    static const std::regex line_re(R"(\[rank (\d)\] r(\d)-(\d+)-(out|err))");
    for (const auto& line : lines_of(text)) {
      std::smatch m;
      REQUIRE_MESSAGE(std::regex_match(line, m, line_re), "mangled line: '", line, "'");
      const int rank = std::stoi(m[1]);
      CHECK(m[2] == m[1]);
      CHECK(m[4] == stream);
      CHECK(std::stoi(m[3]) == next[rank]++);
    }
    REQUIRE(next.size() == 4);
    for (const auto& [rank, count] : next) CHECK(count == kLines);
  }
}

TEST_CASE("split writes, a partial last line and binary bytes come through intact") {
  const Finished f = fsdp_run({}, "printf 'ab'; sleep 0.05; printf 'c\\nd\\000e\\377\\n'; printf 'tail'");
  REQUIRE(f.status == 0);
  CHECK(f.out == "[rank 0] abc\n[rank 0] d\0e\xff\n[rank 0] tail\n"s);  // "s": keeps the NUL

  const Finished plain = fsdp_run({"--no-prefix"}, "printf 'as is'; printf ' err' >&2");
  CHECK(plain.status == 0);
  CHECK(plain.out == "as is");
  CHECK(plain.err == " err");
}

TEST_CASE("a rank exiting 3 stops the sleeping ranks at once and fsdp_run exits 3") {
  TempDir dir;
  const Finished f = fsdp_run({"--nproc", "4"}, "echo $$ > " + dir.path() +
                                                    "/pid$RANK; if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; "
                                                    "exec sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s (rank 1 failed after 0.2 s; grace 3 s)");
  CHECK(f.status == 3);
  CHECK(f.seconds < 2.0);  // SIGTERM ended the sleepers; no wait for the grace period
  CHECK(f.err == "fsdp_run: rank 1 exited with status 3; stopping the other ranks\n");
  check_gone(dir, "pid", {0, 2, 3});
}

TEST_CASE("ranks that ignore SIGTERM get SIGKILL after --grace-ms, and what they started goes too") {
  TempDir dir;
  const std::string d = dir.path();
  // Ranks 1 and 2 ignore SIGTERM and leave a background sleep behind; rank 0 fails once
  // both are ready.
  const Finished f = fsdp_run(
      {"--nproc", "3", "--grace-ms", "300"},
      "trap '' TERM; if [ $RANK = 0 ]; then i=0; while [ ! -e " + d + "/ready1 ] || [ ! -e " + d +
          "/ready2 ]; do i=$((i+1)); [ $i -gt 1000 ] && exit 99; sleep 0.01; done; exit 5; fi; "
          "sleep 30 & echo $! > " + d + "/child$RANK; touch " + d + "/ready$RANK; wait");
  MESSAGE("fsdp_run returned after ", f.seconds, " s with --grace-ms 300");
  CHECK(f.status == 5);
  CHECK(f.seconds >= 0.3);
  CHECK(f.seconds < 3.0);
  CHECK(f.err == "fsdp_run: rank 0 exited with status 5; stopping the other ranks\n");
  check_gone(dir, "child", {1, 2});
}

TEST_CASE("a rank killed by SIGKILL: fsdp_run exits 137 and names the signal") {
  const Finished f = fsdp_run({"--nproc", "3"}, "if [ $RANK = 2 ]; then kill -KILL $$; fi; exec sleep 30");
  CHECK(f.status == 137);
  CHECK(f.seconds < 2.0);
  CHECK(f.err == "fsdp_run: rank 2 exited with status 137 (signal SIGKILL); stopping the other ranks\n");
}

TEST_CASE("failures fsdp_run sees at once: the rank killed by a signal is named first and gives the status") {
  // A killed rank's neighbours fail a moment later; should fsdp_run wake only after both,
  // rank order must not make the neighbour the culprit. fsdp_run is stopped (SIGSTOP)
  // while rank 1 exits 1 and rank 2 is killed, so it surely sees both in one look.
  TempDir dir;
  const std::string d = dir.path();
  ChildProcess job({fsdp_run_path(), "--nproc", "3", "/bin/sh", "-c",
                    "echo $$ > " + d + "/pid$RANK; touch " + d + "/ready$RANK; i=0; while [ ! -e " + d +
                        "/go ]; do i=$((i+1)); [ $i -gt 1000 ] && exit 99; sleep 0.01; done; "
                        "[ $RANK = 1 ] && exit 1; [ $RANK = 2 ] && kill -KILL $$; exec sleep 30"},
                   {"FSDP_STORE_TOKEN"});
  REQUIRE(wait_for_files({dir.file("ready0"), dir.file("ready1"), dir.file("ready2")}));
  ::kill(job.pid(), SIGSTOP);
  std::ofstream(dir.file("go")).put('1');
  for (int r : {1, 2}) CHECK(process_gone(std::stoi(read_file(dir.file("pid" + std::to_string(r)))), 5s));
  ::kill(job.pid(), SIGCONT);
  const Finished f = job.wait();
  CHECK(f.status == 137);
  CHECK(f.err ==
        "fsdp_run: rank 2 exited with status 137 (signal SIGKILL); rank 1 exited with status 1 too; stopping the other "
        "ranks\n");
}

TEST_CASE("an echo (status 86) exits first: fsdp_run waits for the rank that failed on its own and names it first") {
  // Rank 2 fails because rank 0 did (it exits fsdp::kEchoExitStatus at once); rank 0 is
  // still writing its message and exits 0.3 s after rank 2 is on its way out. Without the
  // wait fsdp_run would name rank 2, stop rank 0 before its message, and exit 86.
  TempDir dir;
  const std::string echoed = dir.file("rank2_exits");
  const Finished f = fsdp_run({"--nproc", "3"},
                              "[ $RANK = 2 ] && { touch " + echoed + "; exit 86; }; [ $RANK = 0 ] && { i=0; while [ ! -e " +
                                  echoed + " ] && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; sleep 0.3; "
                                  "echo 'the real reason' >&2; exit 2; }; exec sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s");
  CHECK(f.status == 2);
  CHECK(f.seconds < 2.0);  // stopped as soon as the cause came, not after --echo-wait-ms
  CHECK(f.err ==
        "[rank 0] the real reason\n"
        "fsdp_run: rank 0 exited with status 2; rank 2 exited with status 86 (an echo of that failure) too; stopping "
        "the other ranks\n");
}

TEST_CASE("only echoes: after --echo-wait-ms fsdp_run stops the job with the echo's status, saying no cause came") {
  const Finished f = fsdp_run({"--nproc", "3", "--echo-wait-ms", "300"}, "[ $RANK = 1 ] && exit 86; exec sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s with --echo-wait-ms 300");
  CHECK(f.status == 86);
  CHECK(f.seconds >= 0.3);
  CHECK(f.seconds < 2.5);
  CHECK(f.err ==
        "fsdp_run: rank 1 exited with status 86 (an echo of another rank's failure; no rank reported a failure of its "
        "own within 300 ms); stopping the other ranks\n");
  // Every rank an echo: nothing left to wait for.
  const Finished all = fsdp_run({"--nproc", "2"}, "exit 86");
  CHECK(all.status == 86);
  CHECK(all.seconds < 1.5);
  CHECK(all.err.find("fsdp_run: rank ") == 0);
  CHECK(all.err.find("(an echo of another rank's failure; every rank has exited, none with a failure of its own)") !=
        std::string::npos);
}

TEST_CASE("--max-restarts: a failed job is started again, every rank, with its restart count; then it succeeds") {
  // The first start fails on rank 1 (rank 0 waits for it, as a rank waits for a lost peer);
  // the second succeeds. Each start says which it is and what limit it was given.
  TempDir dir;
  const std::string ready = dir.file("rank0_started");
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "2"},
                              "echo \"start $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS\"; "
                              "[ $TORCHELASTIC_RESTART_COUNT = 0 ] || exit 0; [ $RANK = 0 ] && { touch " + ready +
                                  "; exec sleep 30; }; i=0; while [ ! -e " + ready +
                                  " ] && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; exit 3");
  MESSAGE("fsdp_run returned after ", f.seconds, " s");
  CHECK(f.status == 0);
  CHECK(f.seconds < 3.0);
  CHECK(f.err ==
        "fsdp_run: rank 1 exited with status 3; stopping the other ranks\n"
        "fsdp_run: restarting every rank (restart 1 of 2)\n");
  std::vector<std::string> lines = lines_of(f.out);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"[rank 0] start 0 of 2", "[rank 0] start 1 of 2", "[rank 1] start 0 of 2",
                                          "[rank 1] start 1 of 2"});
}

TEST_CASE("TORCHELASTIC_RUN_ID: one id for every start; fsdp_run's own is passed on, torchrun's default 'none' is not") {
  const std::string script =
      "echo \"$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_RUN_ID\"; [ $TORCHELASTIC_RESTART_COUNT = 0 ] && exit 3; exit 0";
  const Finished given = fsdp_run({"--max-restarts", "1"}, script, {"TORCHELASTIC_RUN_ID=job-17"});
  CHECK(given.status == 0);
  CHECK(lines_of(given.out) == std::vector<std::string>{"[rank 0] 0 job-17", "[rank 0] 1 job-17"});
  for (const std::string inherited : {"TORCHELASTIC_RUN_ID=none", "TORCHELASTIC_RUN_ID"}) {
    CAPTURE(inherited);
    const Finished drawn = fsdp_run({"--max-restarts", "1"}, script, {inherited});
    const std::vector<std::string> lines = lines_of(drawn.out);
    REQUIRE(lines.size() == 2);
    const std::string first = lines[0].substr(std::string("[rank 0] 0 ").size());
    CHECK(first.size() == 32);  // a random 128-bit id, not "none"
    CHECK(lines[1] == "[rank 0] 1 " + first);  // the same for the restart
  }
}

TEST_CASE("--max-restarts: when the restarts run out, the last start's failure is the job's status") {
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "1"}, "[ $RANK = 0 ] && exit 4; exec sleep 30");
  CHECK(f.status == 4);
  CHECK(f.err ==
        "fsdp_run: rank 0 exited with status 4; stopping the other ranks\n"
        "fsdp_run: restarting every rank (restart 1 of 1)\n"
        "fsdp_run: rank 0 exited with status 4; stopping the other ranks\n"
        "fsdp_run: no restart left (--max-restarts 1); the job failed with status 4\n");
  // Without --max-restarts nothing restarts, and each rank sees a count of 0.
  const Finished once = fsdp_run({"--nproc", "2"}, "[ $RANK = 0 ] && { echo $TORCHELASTIC_RESTART_COUNT/$TORCHELASTIC_MAX_RESTARTS; exit 5; }; exec sleep 30");
  CHECK(once.status == 5);
  CHECK(once.err.find("restarting") == std::string::npos);
  CHECK(once.out.find("[rank 0] 0/0") != std::string::npos);
}

TEST_CASE("--restart-scope rank: only the failed rank is started again, with its count and epoch; the others go on") {
  // Rank 1 fails on its first start (killed, or an echo's status: replaced all the same);
  // ranks 0 and 2 wait (bounded) for its replacement and exit 0 only once it ran. Each
  // start appends to $DIR/starts and writes its environment to $DIR/env<RANK>.<count>.
  for (const std::string fail : {"kill -KILL $$", "exit 86"}) {
    CAPTURE(fail);
    TempDir dir;
    const std::string d = dir.path();
    const Finished f = fsdp_run(
        {"--nproc", "3", "--max-restarts", "2", "--restart-scope", "rank"},
        "echo \"$RANK $TORCHELASTIC_RESTART_COUNT ${FSDP_COMM_EPOCH-unset}\" >> " + d + "/starts; env | sort > " + d +
            "/env$RANK.$TORCHELASTIC_RESTART_COUNT; "
            "if [ $RANK = 1 ]; then [ $TORCHELASTIC_RESTART_COUNT = 0 ] && " + fail + "; echo replacement; touch " + d +
            "/replaced; exit 0; fi; "
            "i=0; while [ ! -e " + d + "/replaced ] && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; "
            "[ -e " + d + "/replaced ] && echo done",
        {"FSDP_COMM_EPOCH=7"});  // fsdp_run's own is not passed on
    MESSAGE("fsdp_run returned after ", f.seconds, " s");
    CHECK(f.status == 0);
    CHECK(f.seconds < 4.0);
    const std::string status = fail == "exit 86" ? "86" : "137 (signal SIGKILL)";
    CHECK(f.err == "fsdp_run: rank 1 exited with status " + status +
                       "; starting a replacement for rank 1 (restart 1 of 2); the other ranks go on\n");
    CHECK(by_rank(f.out) == std::map<int, std::string>{{0, "done"}, {1, "replacement"}, {2, "done"}});
    std::vector<std::string> starts = lines_of(read_file(dir.file("starts")));
    std::sort(starts.begin(), starts.end());
    CHECK(starts == std::vector<std::string>{"0 0 unset", "1 0 unset", "1 1 1", "2 0 unset"});
    // The replacement's environment is the original's but for its count and epoch.
    std::vector<std::string> original = lines_of(read_file(dir.file("env1.0")));
    std::vector<std::string> replacement = lines_of(read_file(dir.file("env1.1")));
    REQUIRE(!original.empty());
    auto drop = [](std::vector<std::string>& env, const std::string& line) {
      const auto it = std::find(env.begin(), env.end(), line);
      CHECK_MESSAGE(it != env.end(), "no ", line);
      if (it != env.end()) env.erase(it);
    };
    drop(original, "TORCHELASTIC_RESTART_COUNT=0");
    drop(replacement, "TORCHELASTIC_RESTART_COUNT=1");
    drop(replacement, "FSDP_COMM_EPOCH=1");
    CHECK(original == replacement);
  }
}

TEST_CASE("--restart-scope rank: when the replacements run out, the job stops as in scope job") {
  // Rank 1 fails on every start, once ranks 0 and 2 run (each with a child of its own).
  TempDir dir;
  const std::string d = dir.path();
  const Finished f = fsdp_run({"--nproc", "3", "--max-restarts", "2", "--restart-scope", "rank", "--grace-ms", "2000"},
                              "echo \"$RANK $TORCHELASTIC_RESTART_COUNT\" >> " + d + "/starts; "
                              "if [ $RANK = 1 ]; then i=0; while ! { [ -s " + d + "/child0 ] && [ -s " + d +
                                  "/child2 ]; } && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; exit 3; fi; "
                              "sleep 30 & echo $! > " + d + "/child$RANK.tmp; mv " + d + "/child$RANK.tmp " + d +
                                  "/child$RANK; wait");
  MESSAGE("fsdp_run returned after ", f.seconds, " s");
  CHECK(f.status == 3);
  CHECK(f.seconds < 3.0);  // sh dies of the SIGTERM at once: no wait for the SIGKILL
  CHECK(f.err ==
        "fsdp_run: rank 1 exited with status 3; starting a replacement for rank 1 (restart 1 of 2); the other ranks go on\n"
        "fsdp_run: rank 1 exited with status 3; starting a replacement for rank 1 (restart 2 of 2); the other ranks go on\n"
        "fsdp_run: rank 1 exited with status 3; stopping the other ranks\n"
        "fsdp_run: no restart left (--max-restarts 2); the job failed with status 3\n");
  std::vector<std::string> starts = lines_of(read_file(dir.file("starts")));
  std::sort(starts.begin(), starts.end());
  CHECK(starts == std::vector<std::string>{"0 0", "1 0", "1 1", "1 2", "2 0"});
  check_gone(dir, "child", {0, 2});  // the others were stopped, with what they started
}

TEST_CASE("--restart-scope rank: a rank exiting 87 (no replacement can mend it) is not replaced: every rank starts again") {
  // Rank 1 is killed on the first start and replaced; its replacement exits 87 (no copy
  // to restore it from). The whole job starts again as in scope job, counting both
  // restarts, without an epoch; then every rank succeeds.
  TempDir dir;
  const std::string d = dir.path();
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "3", "--restart-scope", "rank", "--grace-ms", "2000"},
                              "echo \"$RANK $TORCHELASTIC_RESTART_COUNT ${FSDP_COMM_EPOCH-unset}\" >> " + d + "/starts; "
                              "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then kill -KILL $$; fi; "
                              "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 1 ]; then exit 87; fi; "
                              "if [ $TORCHELASTIC_RESTART_COUNT = 2 ]; then echo whole; exit 0; fi; sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s");
  CHECK(f.status == 0);
  CHECK(f.seconds < 4.0);
  CHECK(f.err ==
        "fsdp_run: rank 1 exited with status 137 (signal SIGKILL); starting a replacement for rank 1 (restart 1 of 3); the "
        "other ranks go on\n"
        "fsdp_run: rank 1 exited with status 87 (a replacement cannot mend it); stopping the other ranks\n"
        "fsdp_run: in-memory recovery is not possible; restarting every rank (restart 2 of 3)\n");
  CHECK(by_rank(f.out) == std::map<int, std::string>{{0, "whole"}, {1, "whole"}});
  std::vector<std::string> starts = lines_of(read_file(dir.file("starts")));
  std::sort(starts.begin(), starts.end());
  CHECK(starts == std::vector<std::string>{"0 0 unset", "0 2 unset", "1 0 unset", "1 1 1", "1 2 unset"});
}

TEST_CASE("--restart-scope rank: a rank exiting 87 with no restart left ends the job with its status") {
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "1", "--restart-scope", "rank", "--grace-ms", "2000"},
                              "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then kill -KILL $$; fi; "
                              "if [ $RANK = 1 ]; then exit 87; fi; sleep 30");
  CHECK(f.status == 87);
  CHECK(f.seconds < 3.0);
  CHECK(f.err ==
        "fsdp_run: rank 1 exited with status 137 (signal SIGKILL); starting a replacement for rank 1 (restart 1 of 1); the "
        "other ranks go on\n"
        "fsdp_run: rank 1 exited with status 87 (a replacement cannot mend it); stopping the other ranks\n"
        "fsdp_run: no restart left (--max-restarts 1); the job failed with status 87\n");
}

TEST_CASE("--restart-scope rank: two ranks failing together are replaced together, under one epoch") {
  // Ranks 1 and 2 fail on their first start, after both have started (so that fsdp_run
  // finds them failed at once); rank 0 waits for both replacements.
  TempDir dir;
  const std::string d = dir.path();
  const Finished f = fsdp_run(
      {"--nproc", "3", "--max-restarts", "2", "--restart-scope", "rank"},
      "echo \"$RANK $TORCHELASTIC_RESTART_COUNT ${FSDP_COMM_EPOCH-unset}\" >> " + d + "/starts; "
      "if [ $RANK != 0 ]; then [ $TORCHELASTIC_RESTART_COUNT != 0 ] && { touch " + d + "/replaced$RANK; exit 0; }; "
      "touch " + d + "/up$RANK; i=0; while ! { [ -e " + d + "/up1 ] && [ -e " + d + "/up2 ]; } && [ $i -lt 500 ]; do "
      "i=$((i+1)); sleep 0.01; done; sleep 0.2; exit 5; fi; "
      "i=0; while ! { [ -e " + d + "/replaced1 ] && [ -e " + d + "/replaced2 ]; } && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; "
      "[ -e " + d + "/replaced1 ] && [ -e " + d + "/replaced2 ] && echo done");
  CHECK(f.status == 0);
  CHECK(by_rank(f.out) == std::map<int, std::string>{{0, "done"}});
  std::vector<std::string> starts = lines_of(read_file(dir.file("starts")));
  std::sort(starts.begin(), starts.end());
  // Both replacements: count 2 and epoch 2, the store's generation (their difference) 0.
  CHECK(starts == std::vector<std::string>{"0 0 unset", "1 0 unset", "1 2 2", "2 0 unset", "2 2 2"});
}

TEST_CASE("--restart-scope rank: a rank failing once every other rank has exited is not replaced") {
  // Rank 0 finishes; rank 1 fails after it: a replacement would find nobody to rejoin.
  TempDir dir;
  const std::string d = dir.path();
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "3", "--restart-scope", "rank"},
                              "echo \"$RANK $TORCHELASTIC_RESTART_COUNT\" >> " + d + "/starts; "
                              "if [ $RANK = 0 ]; then touch " + d + "/finished; exit 0; fi; "
                              "i=0; while [ ! -e " + d + "/finished ] && [ $i -lt 500 ]; do i=$((i+1)); sleep 0.01; done; "
                              "sleep 0.3; exit 3");
  CHECK(f.status == 3);
  CHECK(f.err.find("starting a replacement") == std::string::npos);
  std::vector<std::string> starts = lines_of(read_file(dir.file("starts")));
  std::sort(starts.begin(), starts.end());
  CHECK(starts == std::vector<std::string>{"0 0", "1 0"});
}

TEST_CASE("SIGINT to fsdp_run reaches every rank; fsdp_run exits 130") {
  TempDir dir;
  ChildProcess job({fsdp_run_path(), "--nproc", "2", "/bin/sh", "-c",
                    "trap 'echo \"rank $RANK got INT\"; exit 0' INT; sleep 30 & echo $! > " + dir.path() +
                        "/child$RANK; touch " + dir.path() + "/ready$RANK; wait"},
                   {"FSDP_STORE_TOKEN"});
  REQUIRE(wait_for_files({dir.file("ready0"), dir.file("ready1")}));
  ::kill(job.pid(), SIGINT);
  const Finished f = job.wait();
  CHECK(f.status == 130);
  CHECK(f.seconds < 5.0);
  const auto lines = by_rank(f.out);
  CHECK(lines == std::map<int, std::string>{{0, "rank 0 got INT"}, {1, "rank 1 got INT"}});
  CHECK(f.err == "fsdp_run: received SIGINT; forwarding it to the ranks\n");
  // A shell's background job ignores SIGINT: it outlives its rank until fsdp_run, having
  // stopped the job, kills what the ranks left behind.
  check_gone(dir, "child", {0, 1});
}

TEST_CASE("--restart-scope rank: --timeout-ms bounds the whole job, its restarts after an exit 87 included") {
  // Every start: rank 1 exits 87 after 0.6 s; 1.5 s of timeout leaves room for two starts, not four.
  const Finished f = fsdp_run({"--nproc", "2", "--max-restarts", "3", "--restart-scope", "rank", "--timeout-ms", "1500"},
                              "if [ $RANK = 1 ]; then sleep 0.6; exit 87; fi; exec sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s");
  CHECK(f.status != 0);
  CHECK(f.seconds < 4.0);  // about 1.5 s
  CHECK(f.err.find("restarting every rank (restart 1 of 3)") != std::string::npos);
  CHECK(f.err.find("restart 3 of 3") == std::string::npos);
}

TEST_CASE("--timeout-ms stops a job that runs too long and fails naming the ranks") {
  const Finished f = fsdp_run({"--nproc", "2", "--timeout-ms", "300"}, "exec sleep 30");
  MESSAGE("fsdp_run returned after ", f.seconds, " s with --timeout-ms 300");
  CHECK(f.status == 1);
  CHECK(f.seconds >= 0.3);
  CHECK(f.seconds < 3.0);
  CHECK(f.err.find("ranks 0, 1 were still running after the 300 ms timeout; they were stopped") != std::string::npos);

  // Every rank done before the timeout, but a process it left holds the pipe while
  // fsdp_run drains it: that is no timeout of the job.
  const Finished done = fsdp_run({"--timeout-ms", "450"}, "sleep 3 & exit 0");  // exits at once
  CHECK(done.status == 0);
  CHECK(done.err.empty());
}

TEST_CASE("bad command lines exit 2 naming the flag; nothing starts") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--nproc", "0"}, "--nproc must be in [1, 4096], got 0"},
      {{"--nproc", "many"}, "--nproc = many"},
      {{"--nnodes", "0"}, "--nnodes must be at least 1"},
      {{"--nnodes", "2", "--node-rank", "2", "--master-port", "29500"}, "--node-rank 2 is out of range [0, 1]"},
      {{"--node-rank", "-1"}, "--node-rank -1 is out of range [0, 0]"},
      {{"--master-port", "65536"}, "--master-port must be in [1, 65535] (or 0: pick a free one), got 65536"},
      {{"--nnodes", "2", "--node-rank", "1"}, "--master-port is required with --nnodes 2"},
      {{"--grace-ms", "0"}, "--grace-ms must be in (0 ms, 24 h], got 0 ms"},
      {{"--timeout-ms", "-5"}, "--timeout-ms must be in (0 ms, 24 h] or 0 (none), got -5 ms"},
      {{"--env", "RANK=3"}, "--env RANK: fsdp_run sets RANK itself"},
      {{"--env", "NOEQUALS"}, "--env 'NOEQUALS' is not KEY=VALUE"},
      {{"--bogus"}, "unknown option '--bogus'"},
      {{"--store", "rank1"}, "--store: rank1 not in {launcher,rank0,external}"},
      {{"--store", "external"}, "--store external needs --master-port"},
      {{"--store", "external", "--nnodes", "2", "--master-port", "29500"},
       "--store external with --nnodes 2 needs TORCHELASTIC_RUN_ID set to the same id on every node"},
      {{"--env", "FSDP_STORE_EXTERNAL=1"}, "--env FSDP_STORE_EXTERNAL: fsdp_run says who hosts the store itself"},
      {{"--env", "FSDP_STORE_HOST=rank0"}, "--env FSDP_STORE_HOST: fsdp_run says who hosts the store itself"},
      {{"--restart-scope", "node"}, "--restart-scope: node not in {job,rank}"},
      {{"--restart-scope", "rank"}, "--restart-scope rank needs --max-restarts 1 or more"},
      {{"--restart-scope", "rank", "--max-restarts", "1", "--store", "rank0"},
       "--restart-scope rank with --store rank0: it needs the store fsdp_run hosts"},
      {{"--restart-scope", "rank", "--max-restarts", "1", "--nnodes", "2", "--master-port", "29500"},
       "--restart-scope rank with --nnodes 2"},
      {{"--env", "FSDP_COMM_EPOCH=1"}, "--env FSDP_COMM_EPOCH: fsdp_run sets FSDP_COMM_EPOCH itself"},
  };
  for (const auto& c : cases) {
    const auto& flags = c.first;
    const std::string& expected = c.second;  // not a binding: CAPTURE captures it
    CAPTURE(expected);
    const Finished f = fsdp_run(flags, "echo started");
    CHECK(f.status == 2);
    CHECK(f.out.empty());
    CHECK(f.err.find(expected) != std::string::npos);
  }
  const Finished none = ChildProcess({fsdp_run_path(), "--nproc", "2"}).wait();
  CHECK(none.status == 2);
  CHECK(none.err.find("missing the program to run") != std::string::npos);
}

TEST_CASE("a program that does not exist: exit 1 and a message naming it") {
  const Finished f = ChildProcess({fsdp_run_path(), "--nproc", "2", "no-such-program-fsdp"}).wait();
  CHECK(f.status == 1);
  CHECK(f.err == "fsdp: launch: cannot start 'no-such-program-fsdp' for rank 0: No such file or directory "
                 "(looked in PATH)\n");
}
