// rdma-core's verbs header when the build machine has it (private to src/application/rdma).
// MORI_HAVE_VERBS_H says which; without it the verbs code paths report why they are empty.
#pragma once

#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define MORI_HAVE_VERBS_H 1
#else
#define MORI_HAVE_VERBS_H 0
#endif
