#pragma once
// What a unit's flat parameters are made of, decided once as the unit is built: the
// collected parameters grouped into one flat parameter per dtype (FlatParamGroup::build),
// what every rank must agree on about them (hashed into the unit's fingerprint), and how
// a setup mismatch message shows them. No storage and no collectives: those are
// fsdp/unit/flat_param_group.hpp's.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/param_checks.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/tensor.hpp"

namespace fsdp::detail {

// One flat parameter per dtype, in order of first appearance, parameters in visit order,
// laid out for `shard_size` ranks as `layout` cuts them; a tied parameter's other names
// follow it (shown wherever it is, never stored twice).
inline std::vector<FlatParam> build_flat_params(const std::vector<CollectedParam>& params,
                                                const std::vector<TiedAlias>& aliases, int shard_size,
                                                ShardLayout layout = {}) {
  std::vector<DType> order;
  for (auto& p : params)
    if (std::find(order.begin(), order.end(), p.dtype) == order.end()) order.push_back(p.dtype);
  std::vector<FlatParam> flat;
  flat.reserve(order.size());
  for (DType t : order) {
    std::vector<ParamInfo> infos;
    std::vector<ParamBinding> bindings;
    std::vector<std::pair<std::size_t, ParamBinding>> alias_bindings;
    for (std::size_t j = 0; j < params.size(); ++j) {
      if (params[j].dtype != t) continue;
      infos.push_back(params[j].info);
      bindings.push_back(params[j].binding);
      for (auto& a : aliases)
        if (a.canonical == j) { infos.back().aliases.push_back(a.fqn); alias_bindings.emplace_back(infos.size() - 1, a.binding); }
    }
    auto& fp = flat.emplace_back(FlatParamLayout(t, std::move(infos), shard_size, layout));
    fp.bindings = std::move(bindings);
    fp.alias_bindings = std::move(alias_bindings);
  }
  return flat;
}

// What every rank must agree on: dtypes, FQNs and shapes, in order, and how they are cut.
inline void add_flat_params_to(Fingerprint& f, const std::vector<FlatParam>& flat) {
  f.add_count(flat.size());
  for (auto& fp : flat) {
    f.add_count(static_cast<std::uint64_t>(fp.layout.dtype()));
    f.add(name_of(fp.layout.layout()));
    for (auto& p : fp.layout.params()) {
      f.add(p.fqn);
      f.add_count(p.aliases.size());
      for (auto& a : p.aliases) f.add(a);
      f.add_count(p.shape.size());
      for (auto d : p.shape) f.add_count(static_cast<std::uint64_t>(d));
    }
  }
}

// "N parameters, E elements: a [2,3] f32, ...", for setup mismatch messages.
inline std::string describe_flat_params(const std::vector<FlatParam>& flat) {
  std::ostringstream os;
  std::size_t n = 0;
  std::int64_t elems = 0;
  for (auto& fp : flat) { n += fp.layout.params().size(); elems += fp.layout.param_numel(); }
  os << n << " parameters, " << elems << " elements";
  const char* sep = ": ";
  for (auto& fp : flat)
    for (auto& p : fp.layout.params()) {
      os << sep << p.fqn;
      for (auto& a : p.aliases) os << " = " << a;
      os << " " << format_shape(p.shape) << " " << name_of(fp.layout.dtype());
      sep = ", ";
    }
  return os.str();
}

}  // namespace fsdp::detail
