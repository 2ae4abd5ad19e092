"""fsdp_test: a doctest cc_test against the header-only //:fsdp library."""

load("@rules_cc//cc:defs.bzl", "cc_test")

def fsdp_test(name, srcs, deps = [], **kwargs):
    """Declares a cc_test linked with //:fsdp and the shared doctest main.

    Args:
      name: target name, e.g. "core_dtype_test".
      srcs: sources relative to test/, e.g. ["core/dtype_test.cpp"].
      deps: extra deps (e.g. "@fmt", "@nlohmann_json").
      **kwargs: forwarded to cc_test (size, tags, data, args, ...).
    """
    cc_test(
        name = name,
        srcs = srcs,
        deps = deps + [
            "//:fsdp",
            "//test:doctest_main",
            "@doctest",
        ],
        **kwargs
    )
