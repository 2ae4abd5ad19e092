#pragma once
// ShardedModel: the root over a model's units (FSDP's root instance). It owns the units,
// finds the unit of a module, ends each backward (finish_backward waits for every
// reduction, the job of FSDP's queued root callback) and lists the flat shards for the
// optimizer. fsdp::shard builds one from a model and a wrap policy.
#include <memory>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fsdp/sharded.hpp"

namespace fsdp {

class ShardedModel {
 public:
  ShardedModel() = default;
  ShardedModel(ShardedModel&&) noexcept = default;
  ShardedModel& operator=(ShardedModel&&) noexcept = default;

  // Adds a unit built in place; returns it.
  template <class Unit, class... Args>
  Unit& emplace(Args&&... args) {
    auto u = std::make_unique<Unit>(std::forward<Args>(args)...);
    Unit& ref = *u;
    add(std::move(u));
    return ref;
  }

  void add(std::unique_ptr<UnitBase> unit) {
    for (auto& u : units_)
      if (u->fqn() == unit->fqn())
        detail::fail("ShardedModel: two units named '", unit->fqn().empty() ? "<root>" : unit->fqn(), "' on rank ",
                     unit->rank());
    by_module_[unit->module_address()] = unit.get();
    views_.insert(views_.end(), unit->shards().begin(), unit->shards().end());
    units_.push_back(std::move(unit));
  }

  std::size_t size() const { return units_.size(); }
  UnitBase& operator[](std::size_t i) { return *units_.at(i); }
  auto begin() { return units_.begin(); }
  auto end() { return units_.end(); }

  // The unit that manages `module`, or nullptr.
  UnitBase* find_unit_for(const void* module) const {
    auto it = by_module_.find(module);
    return it == by_module_.end() ? nullptr : it->second;
  }
  UnitBase& unit_for(const void* module) const {
    if (auto* u = find_unit_for(module)) return *u;
    detail::fail("ShardedModel: the module at ", module, " is not a unit; units are: ", unit_names());
  }
  UnitBase& unit(std::string_view fqn) const {
    for (auto& u : units_) if (u->fqn() == fqn) return *u;
    detail::fail("ShardedModel: no unit named '", fqn, "'; units are: ", unit_names());
  }

  // Ends a backward pass: every unit that ran backward has finished its reduction, and
  // every unit is IDLE again. A unit left in FORWARD or BACKWARD_PRE is an error.
  void finish_backward() {
    for (auto& u : units_) u->finish_backward();
  }

  void zero_grad() {
    for (auto& u : units_) u->zero_grad();
  }

  // This rank's flat shards of every unit, for the optimizer.
  std::span<const ShardView> shards() const { return views_; }

 private:
  std::string unit_names() const {
    std::ostringstream os;
    for (std::size_t i = 0; i < units_.size(); ++i)
      os << (i ? ", " : "") << "'" << (units_[i]->fqn().empty() ? "<root>" : units_[i]->fqn()) << "'";
    return os.str();
  }

  std::vector<std::unique_ptr<UnitBase>> units_;
  std::unordered_map<const void*, UnitBase*> by_module_;
  std::vector<ShardView> views_;
};

namespace detail {
// Calls f(child, fqn) for each descendant whose type is in Wrap, depth first; does not
// descend into them.
template <class Wrap, class M, class F>
void for_each_wrapped(M& m, const std::string& prefix, F&& f) {
  for_each_child(m, [&](std::string_view name, auto& child) {
    using Child = std::remove_cvref_t<decltype(child)>;
    std::string fqn = join_fqn(prefix, name);
    if constexpr (Wrap::template contains<Child>) f(child, std::move(fqn));
    else for_each_wrapped<Wrap>(child, fqn, f);
  });
}
}  // namespace detail

// Shards `model` over `comm`: every descendant whose type is in Wrap becomes a unit (with
// its whole subtree), and the parameters left over form the root unit, named "". Units are
// listed root first, then in depth-first order. Every rank must make the same call.
template <class... Ps, Module M, class C, class D, class... Wrap>
ShardedModel shard(M& model, C& comm, D& device, wrap_types<Wrap...> wrap = {}) {
  check_communicator<C>();
  check_device<D>();
  using W = wrap_types<Wrap...>;
  // Agree on the set of units first: a rank with a different model structure would
  // otherwise pair its collectives with the wrong unit's.
  detail::Fingerprint f;
  std::ostringstream names;
  std::size_t count = 1;
  detail::for_each_wrapped<W>(model, "", [&](auto&, const std::string& fqn) {
    f.add(fqn);
    names << (count == 1 ? ": " : ", ") << fqn;
    ++count;
  });
  f.add_count(count);
  detail::check_same_across_ranks(detail::CommRef(comm), f, "the set of units",
                                  std::to_string(count) + " units (root" + (count > 1 ? " + wrapped" : "") +
                                      names.str() + ")");
  ShardedModel out;
  out.emplace<Sharded<M, Ps...>>(model, comm, device, UnitOptions{}, wrap);
  detail::for_each_wrapped<W>(model, "", [&](auto& child, std::string fqn) {
    out.emplace<Sharded<std::remove_cvref_t<decltype(child)>, Ps...>>(child, comm, device, UnitOptions{std::move(fqn)});
  });
  return out;
}

}  // namespace fsdp
