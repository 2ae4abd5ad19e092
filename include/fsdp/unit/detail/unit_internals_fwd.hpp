#pragma once
// The names a header below fsdp/unit/unit.hpp needs to reach a unit's internals without
// including the unit: the unit, its internal interface and detail::internals(unit), which
// fsdp/unit/unit.hpp defines. Templates that call internals(u) on a dependent `u` are
// checked where they are used, by which point the unit is complete.

namespace fsdp {
class Unit;
namespace detail {
class UnitInternals;
UnitInternals& internals(Unit& unit);
}  // namespace detail
}  // namespace fsdp
