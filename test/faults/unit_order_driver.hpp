#pragma once
// A training iteration driven by hand, units entered in a given order and no computation
// (the order is all that matters), logging each hook that returned: what the engine was
// shown before an error came. For the tests of order checks across ranks.
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

namespace test_support {

inline const std::vector<std::string> usual{"blocks.0", "blocks.1", "blocks.2", "gain"};
inline const std::vector<std::string> swapped{"blocks.1", "blocks.0", "blocks.2", "gain"};

// The root, then `order` (names), forward; backward in reverse; or reshard() after a
// forward-only pass. `log` gets "<hook> <unit>" as each hook returns.
inline void iteration(fsdp::ShardedModel& sm, const std::vector<std::string>& order, std::vector<std::string>& log,
                      bool backward = true) {
  auto run = [&](const std::string& unit, void (fsdp::Unit::*hook)(), const char* name) {
    (sm.unit(unit).*hook)();
    log.push_back(std::string(name) + " " + unit);
  };
  sm.zero_grad();
  run("", &fsdp::Unit::pre_forward, "pre_forward");
  for (const auto& n : order) run(n, &fsdp::Unit::pre_forward, "pre_forward"), run(n, &fsdp::Unit::post_forward, "post_forward");
  run("", &fsdp::Unit::post_forward, "post_forward");
  if (!backward) return sm.reshard();
  run("", &fsdp::Unit::pre_backward, "pre_backward");
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    run(*it, &fsdp::Unit::pre_backward, "pre_backward"), run(*it, &fsdp::Unit::post_backward, "post_backward");
  run("", &fsdp::Unit::post_backward, "post_backward");
  sm.finish_backward();
  log.push_back("finish_backward");
}

// The same, when what the engine was shown does not matter.
inline void iteration(fsdp::ShardedModel& sm, const std::vector<std::string>& order, bool backward = true) {
  std::vector<std::string> log;
  iteration(sm, order, log, backward);
}

// Whether `parts` occur in `text` in this order.
inline bool in_order(const std::string& text, const std::vector<std::string>& parts) {
  std::size_t at = 0;
  for (const auto& p : parts) {
    at = text.find(p, at);
    if (at == std::string::npos) return false;
    at += p.size();
  }
  return true;
}

}  // namespace test_support
