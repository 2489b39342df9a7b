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
#include <mutex>
#include <string>

#include "fake_verbs_objects.hpp"

namespace {

constexpr int kNumDevices = 4;
ibv_device gDevices[kNumDevices];
ibv_device* gList[kNumDevices + 1];

int Index(ibv_device* d) { return static_cast<int>(d - gDevices); }
int IndexOf(ibv_context* c) { return Index(c->device); }

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
  // Filled once: ranks running as threads list devices concurrently while others use them.
  static std::once_flag filled;
  std::call_once(filled, [] {
    for (int i = 0; i < kNumDevices; i++) {
      std::memset(&gDevices[i], 0, sizeof(ibv_device));
      std::strcpy(gDevices[i].name, (std::string("mlx5_") + std::to_string(i)).c_str());
      gList[i] = &gDevices[i];
    }
    gList[kNumDevices] = nullptr;
  });
  if (num != nullptr) *num = kNumDevices;
  return gList;
}

void ibv_free_device_list(struct ibv_device**) {}

const char* ibv_get_device_name(struct ibv_device* d) { return d->name; }

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

// --- control path (rdma_setup_test) ------------------------------------------------------------
// PD, MR (ibv_reg_mr and ibv_reg_dmabuf_mr), CQ and QP calls succeed on every device that opens.
// They record what they were given and count live objects; the test reads both through the
// fake_ibverbs_* functions below (looked up with dlsym). fake_ibverbs_fail() makes a call fail.
// ibv_modify_qp also enforces the RESET -> INIT -> RTR -> RTS order (EINVAL otherwise).
#include <map>
#include <mutex>
#include <vector>

namespace {

struct FakeModifyRecord {
  uint32_t qpn;
  ibv_qp_attr attr;
  int mask;
};

struct FakeRegMrRecord {
  void* addr;
  size_t length;
  int access;
  int dmabufFd;  // -1: ibv_reg_mr
  uint64_t offset;
  uint64_t iova;
};

std::mutex gFakeMutex;
std::map<std::string, std::pair<int, int>> gFailures;  // call -> (errno, qp state or -1)
std::map<std::string, int> gLive;                      // "pd", "mr", "cq", "qp"
std::vector<FakeModifyRecord> gModifies;
FakeRegMrRecord gLastRegMr{};
std::vector<FakeRegMrRecord> gRegMrs;  // every successful registration since the last reset
ibv_qp_init_attr gLastCreateQp{};
int gLastCqe = 0;
uint32_t gSerial = 0;

// errno to fail `call` with (0: succeed); `qpState` narrows ibv_modify_qp to one target state.
int FailureFor(const char* call, int qpState = -1) {
  auto it = gFailures.find(call);
  if (it == gFailures.end()) return 0;
  if (it->second.second >= 0 && it->second.second != qpState) return 0;
  return it->second.first;
}

ibv_mr* NewMr(ibv_pd* pd, const FakeRegMrRecord& r) {
  auto* mr = new ibv_mr{};
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = reinterpret_cast<void*>(static_cast<uintptr_t>(r.iova));
  mr->length = r.length;
  mr->handle = ++gSerial;
  mr->lkey = 0x1000 + mr->handle;
  mr->rkey = 0x2000 + mr->handle;
  gLastRegMr = r;
  gRegMrs.push_back(r);
  gLive["mr"]++;
  return mr;
}

}  // namespace

extern "C" {

struct ibv_pd* ibv_alloc_pd(struct ibv_context* c) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_alloc_pd")) {
    errno = e;
    return nullptr;
  }
  auto* pd = new ibv_pd{};
  pd->context = c;
  pd->handle = ++gSerial;
  gLive["pd"]++;
  return pd;
}

int ibv_dealloc_pd(struct ibv_pd* pd) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_dealloc_pd")) return e;
  delete pd;
  gLive["pd"]--;
  return 0;
}

struct ibv_mr*(ibv_reg_mr)(struct ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_reg_mr")) {
    errno = e;
    return nullptr;
  }
  return NewMr(pd, {addr, length, access, -1, 0, reinterpret_cast<uintptr_t>(addr)});
}

struct ibv_mr* ibv_reg_dmabuf_mr(struct ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova,
                                 int fd, int access) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_reg_dmabuf_mr")) {
    errno = e;
    return nullptr;
  }
  return NewMr(pd, {nullptr, length, access, fd, offset, iova});
}

int ibv_dereg_mr(struct ibv_mr* mr) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_dereg_mr")) return e;
  delete mr;
  gLive["mr"]--;
  return 0;
}

struct ibv_cq* ibv_create_cq(struct ibv_context* c, int cqe, void* cqContext,
                             struct ibv_comp_channel* channel, int) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_create_cq")) {
    errno = e;
    return nullptr;
  }
  auto* cq = new ibv_cq{};
  cq->context = c;
  cq->channel = channel;
  cq->cq_context = cqContext;
  cq->handle = ++gSerial;
  cq->cqe = cqe;
  gLastCqe = cqe;
  gLive["cq"]++;
  return cq;
}

int ibv_destroy_cq(struct ibv_cq* cq) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_destroy_cq")) return e;
  delete cq;
  gLive["cq"]--;
  return 0;
}

struct ibv_qp* ibv_create_qp(struct ibv_pd* pd, struct ibv_qp_init_attr* init) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_create_qp")) {
    errno = e;
    return nullptr;
  }
  gLastCreateQp = *init;
  auto* obj = new FakeQpObject{};
  obj->maxSendWr = init->cap.max_send_wr;
  obj->maxInlineData = init->cap.max_inline_data;
  ibv_qp* qp = &obj->qp;
  qp->context = pd->context;
  qp->qp_context = init->qp_context;
  qp->pd = pd;
  qp->send_cq = init->send_cq;
  qp->recv_cq = init->recv_cq;
  qp->srq = init->srq;
  qp->handle = ++gSerial;
  qp->qp_num = 0x100 + qp->handle;
  qp->state = IBV_QPS_RESET;
  qp->qp_type = init->qp_type;
  gLive["qp"]++;
  return qp;
}

int ibv_destroy_qp(struct ibv_qp* qp) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (int e = FailureFor("ibv_destroy_qp")) return e;
  delete reinterpret_cast<FakeQpObject*>(qp);
  gLive["qp"]--;
  return 0;
}

int ibv_modify_qp(struct ibv_qp* qp, struct ibv_qp_attr* attr, int mask) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  gModifies.push_back({qp->qp_num, *attr, mask});
  int target = (mask & IBV_QP_STATE) != 0 ? attr->qp_state : -1;
  if (int e = FailureFor("ibv_modify_qp", target)) return e;
  if (target < 0) return EINVAL;
  bool legal = (qp->state == IBV_QPS_RESET && target == IBV_QPS_INIT) ||
               (qp->state == IBV_QPS_INIT && target == IBV_QPS_RTR) ||
               (qp->state == IBV_QPS_RTR && target == IBV_QPS_RTS);
  if (!legal) return EINVAL;
  qp->state = static_cast<ibv_qp_state>(target);
  return 0;
}

// --- test-only controls ---
// Make `call` ("ibv_create_qp", ...) fail with errno `err` until fake_ibverbs_reset(); for
// "ibv_modify_qp", qpState >= 0 limits it to transitions into that state.
void fake_ibverbs_fail(const char* call, int err, int qpState) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  gFailures[call] = {err, qpState};
}

// Clears failures and records (live counts stay).
void fake_ibverbs_reset() {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  gFailures.clear();
  gModifies.clear();
  gLastRegMr = FakeRegMrRecord{};
  gRegMrs.clear();
  gLastCreateQp = ibv_qp_init_attr{};
  gLastCqe = 0;
}

// Live objects of one kind: "pd", "mr", "cq", "qp".
int fake_ibverbs_live(const char* kind) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  auto it = gLive.find(kind);
  return it == gLive.end() ? 0 : it->second;
}

// ibv_modify_qp calls since the last reset (failed ones included), oldest first.
int fake_ibverbs_modify_qp_count() {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  return static_cast<int>(gModifies.size());
}

int fake_ibverbs_modify_qp_record(int i, uint32_t* qpn, struct ibv_qp_attr* attr, int* mask) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (i < 0 || i >= static_cast<int>(gModifies.size())) return -1;
  *qpn = gModifies[i].qpn;
  *attr = gModifies[i].attr;
  *mask = gModifies[i].mask;
  return 0;
}

// The last ibv_modify_qp call: its QP number, attributes and mask; -1 when there was none.
int fake_ibverbs_last_modify_qp(uint32_t* qpn, struct ibv_qp_attr* attr, int* mask) {
  return fake_ibverbs_modify_qp_record(fake_ibverbs_modify_qp_count() - 1, qpn, attr, mask);
}

void fake_ibverbs_last_create_qp(struct ibv_qp_init_attr* init, int* cqe) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  *init = gLastCreateQp;
  *cqe = gLastCqe;
}

// Registration i (oldest first) since the last reset; -1 when there is none. dmabufFd is -1 for
// ibv_reg_mr.
int fake_ibverbs_reg_mr_record(int i, void** addr, size_t* length, int* dmabufFd, uint64_t* offset,
                               uint64_t* iova) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  if (i < 0 || i >= static_cast<int>(gRegMrs.size())) return -1;
  *addr = gRegMrs[i].addr;
  *length = gRegMrs[i].length;
  *dmabufFd = gRegMrs[i].dmabufFd;
  *offset = gRegMrs[i].offset;
  *iova = gRegMrs[i].iova;
  return 0;
}

// The last successful registration; dmabufFd is -1 for ibv_reg_mr.
void fake_ibverbs_last_reg_mr(void** addr, size_t* length, int* access, int* dmabufFd,
                              uint64_t* offset, uint64_t* iova) {
  std::lock_guard<std::mutex> lock(gFakeMutex);
  *addr = gLastRegMr.addr;
  *length = gLastRegMr.length;
  *access = gLastRegMr.access;
  *dmabufFd = gLastRegMr.dmabufFd;
  *offset = gLastRegMr.offset;
  *iova = gLastRegMr.iova;
}

}  // extern "C"
