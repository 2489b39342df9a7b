// Shared by the stand-in libibverbs (fake_ibverbs.cpp) and libmlx5 (fake_mlx5.cpp): the fake
// ibv_create_qp allocates this larger object so that the fake mlx5dv_init_obj knows the send
// queue depth the QP was created with (as the real provider does from its own QP struct).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

struct FakeQpObject {
  ibv_qp qp;  // first member: ibv_qp* and FakeQpObject* are interchangeable
  uint32_t maxSendWr;
  uint32_t maxInlineData;
};
