"""fsdp_test and fsdp_test_group: doctest cc_tests against the //:fsdp library.

Test programs are compiled in the separately compiled mode (//:fsdp_separate, which defines
FSDP_SEPARATE_COMPILATION for every file of the program: fsdp/core/config.hpp): the unit's
implementation compiles once, in src/fsdp_separate.cpp, instead of in every test file, which
took 62% of a test file's compile (the precision tests, then core_precision_test: 41.7 s
header-only, 15.9 s separate, g++ -O0, December 2026), and that for each of CI's three
builds (g++, and clang under ASan and under TSan). The header-only mode runs too: core_sharding_test
(header_only = True), the examples' tests (examples/ builds header-only) and the benches;
test/tools:header_warnings_test compiles every header header-only, and in the separately
compiled mode the engine file, that mode's source and each header with code for it.
"""

load("@rules_cc//cc:defs.bzl", "cc_test")

# What a test program links the library through: one program is in one mode.
def _fsdp_lib(header_only):
    return "//:fsdp" if header_only else "//:fsdp_separate"


def fsdp_test(name, srcs, deps = [], header_only = False, **kwargs):
    """Declares a cc_test linked with //:fsdp_separate (or //:fsdp) and the shared doctest main.

    Args:
      name: target name, e.g. "core_trace_test".
      srcs: sources relative to this package, e.g. ["core/trace_test.cpp"].
      deps: extra deps (e.g. "@fmt", "@nlohmann_json").
      header_only: compile the program header-only (//:fsdp) instead of in the separately
        compiled mode.
      **kwargs: forwarded to cc_test (size, tags, data, args, ...).
    """
    cc_test(
        name = name,
        srcs = srcs,
        deps = deps + [
            _fsdp_lib(header_only),
            "//test:doctest_main",
            "@doctest",
        ],
        **kwargs
    )

def fsdp_test_group(name, srcs, deps = [], hdrs = [], header_only = False, **kwargs):
    """Declares one fsdp_test built from several test files as one translation unit.

    Most of a test file's compile time is the library code it instantiates (every unit's
    hooks, setup and checks), which every file used to compile again: four core test
    files took 29.5 s compiled apart and 12.6 s as one unit (g++ -O0). So related files
    share a binary. Each file keeps its code in a namespace named after it
    (<directory>_<file stem>, e.g. core_prefetch_test) so that names never clash; an
    explicit specialization of a library trait goes outside it. A file that changes the
    whole program (replaces operator new, interposes libc) stays an fsdp_test of its own.
    doctest reports every case with its own file and line; run one file's cases with
    --test_arg=--source-file='*prefetch_test*'.

    Args:
      name: target name, e.g. "core_sharding_test".
      srcs: the test files (.cpp), relative to this package (doctest runs the cases
        ordered by file path, then line).
      deps: extra deps, the union of what the files need.
      hdrs: headers of this package that the files include.
      header_only: as fsdp_test's.
      **kwargs: forwarded to cc_test (size, tags, data, args, ...).
    """
    pkg = native.package_name()

    # Each file must open its namespace (<directory>_<file stem>); checked here, so that a file
    # added without one fails with this message rather than mixing its names with its group's.
    checks = []
    for src in srcs:
        if not src.endswith(".cpp"):
            fail("fsdp_test_group %s: %s is not a .cpp test file" % (name, src))
        parts = (pkg + "/" + src).split("/")
        namespace = parts[-2] + "_" + parts[-1][:-len(".cpp")]
        checks.append(
            "grep -q '^namespace %s {' $(location %s) || " % (namespace, src) +
            "{ echo '%s/%s: its code must be in namespace %s (fsdp_test_group, test/defs.bzl)' >&2; exit 1; }" % (pkg, src, namespace),
        )
    native.genrule(
        name = name + "_unity",
        srcs = srcs,
        outs = [name + "_unity.cpp"],
        tags = kwargs.get("tags", []),
        cmd = " && ".join(checks + [
            "printf '%s\\n' " + " ".join(["'#include \"%s/%s\"'" % (pkg, s) for s in srcs]) + " > $@",
        ]),
        testonly = True,
    )
    native.cc_library(
        name = name + "_files",
        testonly = True,
        tags = kwargs.get("tags", []),
        textual_hdrs = srcs + hdrs,
    )
    fsdp_test(
        name = name,
        srcs = [name + "_unity.cpp"],
        deps = deps + [":" + name + "_files"],
        header_only = header_only,
        **kwargs
    )

def fsdp_emulated_cuda_test(name, srcs, deps = [], **kwargs):
    """Declares a cc_test of the CUDA host code against the emulated CUDA runtime.

    Linked with //tools/cuda_emulator instead of libcudart and libnvrtc, and with its doctest
    main, which fails the run when the emulator found a stream-order race or an invalid
    memory use. No NVIDIA library is linked, so these also run under the sanitizers.

    Args:
      name: target name, e.g. "cuda_sharded_emulated_test".
      srcs: test files, relative to this package.
      deps: extra deps; nothing that links //:fsdp_cuda (use //:fsdp_cuda_api).
      **kwargs: forwarded to cc_test.
    """
    cc_test(
        name = name,
        srcs = srcs,
        deps = deps + [
            "//:fsdp_separate",
            "//:fsdp_cuda_api",
            "//tools/cuda_emulator",
            "//tools/cuda_emulator:emulated_doctest_main",
            "@doctest",
        ],
        **kwargs
    )

def fsdp_cuda_tests(name, emulated_name, srcs, deps = [], gpu_deps = ["//:fsdp_cuda"], emulated_env = {}, **kwargs):
    """Declares a CUDA test twice from one compile: on the CUDA runtime and on the emulated one.

    The sources are compiled once (<name>_objects: the test files see only the CUDA and NCCL
    headers, which both runtimes share) and linked into two cc_tests:
      - `name`: with gpu_deps (//:fsdp_cuda, or //:fsdp_nccl: the NVIDIA libraries) and the
        plain doctest main; not under the sanitizer configs (the NVIDIA libraries are not
        instrumented, see NO_SANITIZERS in test/BUILD.bazel); its GPU cases report as
        skipped without a GPU;
      - `emulated_name`: with //tools/cuda_emulator and its doctest main, which fails the run
        when the emulator found a stream-order race or an invalid memory use (as
        fsdp_emulated_cuda_test); also under the sanitizers.

    Args:
      name: the GPU test's name, e.g. "cuda_sharded_test".
      emulated_name: the emulated test's name, e.g. "cuda_sharded_emulated_test".
      srcs: test files, relative to this package.
      deps: what the files include besides //:fsdp_separate and //:fsdp_cuda_api (headers only:
        e.g. //:fsdp_nccl_api, not //:fsdp_nccl).
      gpu_deps: the NVIDIA libraries the GPU test links.
      emulated_env: environment of the emulated test only (e.g. its device count).
      **kwargs: forwarded to both cc_tests (size, timeout, tags, ...); the GPU test's tags
        gain no_asan and no_tsan; copts, defines and local_defines go to the compile.
    """
    if "env" in kwargs:
        fail("fsdp_cuda_tests %s: pass the emulated test's environment as emulated_env" % name)
    tags = kwargs.pop("tags", [])
    compile_args = {k: kwargs.pop(k) for k in ["copts", "defines", "local_defines"] if k in kwargs}
    native.cc_library(
        name = name + "_objects",
        testonly = True,
        srcs = srcs,
        deps = deps + [
            "//:fsdp_separate",
            "//:fsdp_cuda_api",
            "@doctest",
        ],
        alwayslink = True,
        tags = tags,
        **compile_args
    )
    cc_test(
        name = name,
        deps = [":" + name + "_objects"] + gpu_deps + [
            "//test:doctest_main",
            "@doctest",
        ],
        tags = tags + [
            "no_asan",
            "no_tsan",
        ],
        **kwargs
    )
    cc_test(
        name = emulated_name,
        env = emulated_env,
        deps = [
            ":" + name + "_objects",
            "//tools/cuda_emulator",
            "//tools/cuda_emulator:emulated_doctest_main",
            "@doctest",
        ],
        tags = tags,
        **kwargs
    )
