#pragma once
// Header-only, or compiled once. By default fsdp is header-only: every file that shards a
// model compiles the unit's implementation (setup, hooks, flat parameters, summon) again,
// about 10 s of an optimised build per file. Defining FSDP_SEPARATE_COMPILATION in every
// file of a program (and linking src/fsdp_separate.cpp once: Bazel's //:fsdp_separate)
// compiles that implementation in one file, and an engine's files see only what they
// call: fsdp::shard, fsdp::Unit, fsdp::ShardedModel and the training-loop features. Boost.Asio's
// BOOST_ASIO_SEPARATE_COMPILATION is the model.
//
// In that mode <fsdp/fsdp.hpp> leaves out fsdp::Sharded<Module, Policies...>, the unit's
// class template: a file that builds units by hand includes <fsdp/unit/sharded.hpp>, and
// compiles the implementation as a header-only file does.
//
// FSDP_DECL marks a function that lives in that one file (inline otherwise);
// FSDP_DEFINES_IMPLEMENTATION says whether this file defines such functions. Besides
// detail::make_unit (the unit's implementation), they are the functions that depend on no
// template argument of what every engine file uses: ShardedModel's and ExecutionOrder's
// members, the thread-rank backend's collectives, HostDevice's quantization, the
// setup's cross-rank check, the host arithmetic; each header declares them and defines
// them under `#if FSDP_DEFINES_IMPLEMENTATION`, and includes there, not at its top, what
// only those definitions use. A free function of them (make_unit, the host arithmetic,
// check_same_across_ranks) is declared inside `inline namespace FSDP_MODE_NAMESPACE`, whose
// name differs between the modes, so that a program compiled in that mode without the one
// file fails to link (an undefined fsdp::detail::separately_compiled::... symbol; the
// members are simply undefined there, fsdp::ShardedModel::add and the like). One program is
// in one mode: mixing them (a library compiled header-only linked with files compiled under
// FSDP_SEPARATE_COMPILATION) is not supported; the templates both modes instantiate would
// differ in what they call (an ODR violation a linker need not report).
#if defined(FSDP_SEPARATE_COMPILATION) && !defined(FSDP_SEPARATE_COMPILATION_SOURCE)
#define FSDP_DECL
#define FSDP_DEFINES_IMPLEMENTATION 0
#define FSDP_MODE_NAMESPACE separately_compiled
#elif defined(FSDP_SEPARATE_COMPILATION)
#define FSDP_DECL
#define FSDP_DEFINES_IMPLEMENTATION 1
#define FSDP_MODE_NAMESPACE separately_compiled
#else
#define FSDP_DECL inline
#define FSDP_DEFINES_IMPLEMENTATION 1
#define FSDP_MODE_NAMESPACE header_only
#endif
