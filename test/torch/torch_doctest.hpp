#pragma once
// The first include of every torch test: libtorch, then doctest. Debian's libtorch logs
// through glog, whose logging.h (reached from <torch/torch.h>) defines CHECK, CHECK_EQ, ...
// as aborting checks that doctest would never count; included after doctest they silently
// replace doctest's (torch's headers are system headers: no redefinition warning). Here
// glog's go first and doctest defines its own.
#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LE
#undef CHECK_LT
#undef CHECK_GE
#undef CHECK_GT

#include <doctest/doctest.h>
