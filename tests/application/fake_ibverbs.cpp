// A stand-in libibverbs for rdma_devices_test: exports the discovery entry points over four fake
// devices, so the verbs-querying path of discovery runs on a host without RDMA hardware.
//   mlx5_0  port 1 ACTIVE InfiniBand (lid 7, mtu 4096), port 2 DOWN; legacy (non-extended) context
//   mlx5_1  port 1 ACTIVE Ethernet (mtu 1024), GIDs 0 fe80::1 RoCE v1, 1 ::ffff:10.0.0.1 RoCE v2;
//           extended context (query_port through verbs_context)
//   mlx5_2  port 1 DOWN
//   mlx5_3  ibv_open_device fails (EACCES)
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int kNumDevices = 4;
ibv_device gDevices[kNumDevices];
ibv_device* gList[kNumDevices + 1];

int Index(ibv_device* d) {
  return static_cast<int>(d - gDevices);
}
int IndexOf(ibv_context* c) {
  return Index(c->device);
}

void FillPort(int dev, uint8_t port, ibv_port_attr* a) {
  std::memset(a, 0, sizeof(*a));
  a->state = IBV_PORT_DOWN;
  a->active_mtu = IBV_MTU_1024;
  a->link_layer = IBV_LINK_LAYER_INFINIBAND;
  a->gid_tbl_len = 4;
  if (dev == 0 && port == 1) {
    a->state = IBV_PORT_ACTIVE;
    a->active_mtu = IBV_MTU_4096;
    a->lid = 7;
  } else if (dev == 1 && port == 1) {
    a->state = IBV_PORT_ACTIVE;
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
  }
}

int ExtQueryPort(ibv_context* c, uint8_t port, ibv_port_attr* a, size_t) {
  FillPort(IndexOf(c), port, a);
  return 0;
}

void FillGid(int dev, int index, ibv_gid* g, uint32_t* type) {
  std::memset(g, 0, sizeof(*g));
  *type = IBV_GID_TYPE_IB;
  if (dev == 0 && index == 0) {
    g->raw[0] = 0xfe;
    g->raw[1] = 0x80;
    g->raw[15] = 0x07;
  } else if (dev == 1 && index == 0) {
    g->raw[0] = 0xfe;
    g->raw[1] = 0x80;
    g->raw[15] = 0x01;
    *type = IBV_GID_TYPE_ROCE_V1;
  } else if (dev == 1 && index == 1) {
    g->raw[10] = 0xff;
    g->raw[11] = 0xff;
    g->raw[12] = 10;
    g->raw[15] = 1;
    *type = IBV_GID_TYPE_ROCE_V2;
  }
}

}  // namespace

extern "C" {

struct ibv_device**(ibv_get_device_list)(int* num) {
  for (int i = 0; i < kNumDevices; i++) {
    std::memset(&gDevices[i], 0, sizeof(ibv_device));
    std::strcpy(gDevices[i].name, (std::string("mlx5_") + std::to_string(i)).c_str());
    gList[i] = &gDevices[i];
  }
  gList[kNumDevices] = nullptr;
  if (num != nullptr) *num = kNumDevices;
  return gList;
}

void ibv_free_device_list(struct ibv_device**) {}

const char* ibv_get_device_name(struct ibv_device* d) {
  return d->name;
}

struct ibv_context* ibv_open_device(struct ibv_device* d) {
  if (Index(d) == 3) {
    errno = EACCES;
    return nullptr;
  }
  auto* v = static_cast<verbs_context*>(std::calloc(1, sizeof(verbs_context)));
  v->context.device = d;
  if (Index(d) == 1) {
    v->sz = sizeof(verbs_context);
    v->context.abi_compat = __VERBS_ABI_IS_EXTENDED;
    v->query_port = ExtQueryPort;
  }
  return &v->context;
}

int ibv_close_device(struct ibv_context* c) {
  std::free(reinterpret_cast<uint8_t*>(c) - offsetof(verbs_context, context));
  return 0;
}

int ibv_query_device(struct ibv_context* c, struct ibv_device_attr* a) {
  std::memset(a, 0, sizeof(*a));
  a->vendor_id = 0x02c9;
  a->vendor_part_id = 4129;
  std::strcpy(a->fw_ver, "28.39.1002");
  a->phys_port_cnt = IndexOf(c) == 0 ? 2 : 1;
  return 0;
}

// Only the legacy device reaches the exported function (the extended one uses its context op).
int(ibv_query_port)(struct ibv_context* c, uint8_t port, struct _compat_ibv_port_attr* a) {
  if (IndexOf(c) == 1) return EINVAL;
  FillPort(IndexOf(c), port, reinterpret_cast<ibv_port_attr*>(a));
  return 0;
}

int ibv_query_gid(struct ibv_context* c, uint8_t, int index, union ibv_gid* gid) {
  uint32_t type;
  FillGid(IndexOf(c), index, gid, &type);
  return 0;
}

// mlx5_0 has no extended GID query (so discovery falls back to ibv_query_gid + sysfs).
int _ibv_query_gid_ex(struct ibv_context* c, uint32_t, uint32_t index, struct ibv_gid_entry* e,
                      uint32_t, size_t) {
  if (IndexOf(c) == 0) return EOPNOTSUPP;
  std::memset(e, 0, sizeof(*e));
  FillGid(IndexOf(c), static_cast<int>(index), &e->gid, &e->gid_type);
  e->gid_index = index;
  return 0;
}

}  // extern "C"
