// fsdp_store: the rendezvous store's server as a process of its own, for jobs whose store
// should live in neither rank 0 nor the launcher (ranks then run with FSDP_STORE_EXTERNAL=1;
// fsdp_run --store external). A restarted job's ranks begin a new generation of it at
// their hello (TcpStoreServer, "Generations"), so it may serve one start after another.
//
//   fsdp_store [--host 127.0.0.1] [--port 29500] [--token-env FSDP_STORE_TOKEN] ...
//
// The token is read from an environment variable, never from the command line, where
// other users of the machine could see it. Prints "fsdp_store: listening on HOST:PORT"
// once it listens (--port 0 picks a free port), then serves until SIGINT or SIGTERM.
// Listening beyond loopback needs a token (--no-token to go without, knowingly). Why each
// connection it closed was closed goes to stderr (--quiet: nothing).
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include <fsdp/asio/tcp_store_server.hpp>

int main(int argc, char** argv) {
  CLI::App app{"Serve an fsdp rendezvous store (the server of fsdp::TcpStore)"};
  fsdp::TcpStoreServerOptions options;
  options.port = 29500;
  std::string token_env = "FSDP_STORE_TOKEN";
  long long handshake_ms = options.handshake_timeout.count();
  long long frame_ms = options.frame_timeout.count();
  app.add_option("--host", options.host, "address to listen on (0.0.0.0: every interface)")->capture_default_str();
  app.add_option("--port", options.port, "port to listen on; 0 picks a free one")->capture_default_str()->check(CLI::Range(0, 65535));
  auto* token_flag = app.add_option("--token-env", token_env, "environment variable holding the token clients must present")->capture_default_str();
  app.add_option("--max-clients", options.max_clients, "connections served at once")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-key-bytes", options.limits.max_key_bytes, "largest key")->capture_default_str();
  app.add_option("--max-value-bytes", options.limits.max_value_bytes, "largest value")->capture_default_str();
  app.add_option("--handshake-timeout-ms", handshake_ms, "drop a connection that has not said hello by then")->capture_default_str()->check(CLI::Range(1LL, 86400000LL));
  app.add_option("--frame-timeout-ms", frame_ms, "drop a connection whose frame, once begun, is not complete by then")->capture_default_str()->check(CLI::Range(1LL, 86400000LL));
  app.add_option("--max-pending", options.max_pending, "connections without a hello kept at once; past it the oldest is closed")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_flag("--no-token", options.allow_without_token, "listen beyond loopback without a token (anyone who reaches the port may use the store)");
  bool quiet = false;
  app.add_flag("--quiet", quiet, "do not print why connections were closed");
  CLI11_PARSE(app, argc, argv);

  // Blocked before the server's thread starts (threads inherit the mask), so that only
  // sigwait() below receives them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  const char* token = std::getenv(token_env.c_str());
  if (token_flag->count() && (!token || !*token)) {  // an empty token would silently admit anyone
    std::fprintf(stderr, "fsdp_store: --token-env %s: that variable is not set or is empty\n", token_env.c_str());
    return 2;
  }
  options.token = token ? token : "";
  options.handshake_timeout = std::chrono::milliseconds(handshake_ms);
  options.frame_timeout = std::chrono::milliseconds(frame_ms);
  if (!quiet) options.log = [](const std::string& line) { std::fprintf(stderr, "fsdp_store: %s\n", line.c_str()); };
  try {
    fsdp::TcpStoreServer server(options);
    std::printf("fsdp_store: listening on %s:%u%s\n", server.host().c_str(), unsigned(server.port()),
                options.token.empty() ? "" : " (token required)");
    std::fflush(stdout);
    int signal = 0;
    sigwait(&stop, &signal);
    std::printf("fsdp_store: stopping on signal %d\n", signal);
  } catch (const fsdp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
