// Single doctest main shared by every fsdp_test target (see test/defs.bzl).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
