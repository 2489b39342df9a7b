// A stand-in libmlx5 for verbs_transport_test: exports mlx5dv_init_obj at MLX5_1.2 (the version
// mlx5dv.h binds to) and a deliberately failing MLX5_1.0 one, over QPs/CQs made by the stand-in
// libibverbs (fake_ibverbs.cpp). Queue memory is made here on first use, laid out like the
// provider's: the SQ ring page-aligned (wqe_cnt = max_send_wr rounded up to a power of two, one
// 64-byte block per WR), doorbell records packed into one shared page, doorbell registers two per
// fake UAR page (offsets 0x800 and 0xa00), CQ rings of cqe_cnt = pow2(cqe + 1) 64-byte CQEs with
// op_own = MLX5_CQE_INVALID << 4 and every other byte zero. Memory stays until fake_mlx5_reset(),
// which tests call between cases (objects are keyed by address, which a later QP may reuse).
// Test controls (fake_mlx5_*) are looked up with dlsym.
#include <infiniband/mlx5dv.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fake_verbs_objects.hpp"

namespace {

constexpr size_t kPage = 4096;

struct QpMemory {
  uint32_t qpn;
  mlx5dv_qp qp;
  mlx5dv_cq cq;
};

std::mutex gMutex;
std::map<ibv_qp*, QpMemory> gQps;
std::map<ibv_cq*, mlx5dv_cq> gCqs;
std::map<std::string, long>
    gOverrides;  // "stride", "cqe_size", "wqe_cnt", "cqe_cnt", "fail", "null_bf"
std::vector<void*> gAllocations;
uint8_t* gDbrecPage = nullptr;
size_t gDbrecUsed = 0;
uint8_t* gUarPage = nullptr;
int gUarUsed = 2;  // registers handed out in the current UAR page
int gOldAbiCalls = 0;

long Override(const char* what, long fallback) {
  auto it = gOverrides.find(what);
  return it == gOverrides.end() ? fallback : it->second;
}

void* PageAlloc(size_t bytes) {
  void* p = std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
  std::memset(p, 0, (bytes + kPage - 1) / kPage * kPage);
  gAllocations.push_back(p);
  return p;
}

uint32_t Pow2AtLeast(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

__be32* NewDbrec() {
  if (gDbrecPage == nullptr || gDbrecUsed + 8 > kPage) {
    gDbrecPage = static_cast<uint8_t*>(PageAlloc(kPage));
    gDbrecUsed = 0;
  }
  auto* r = reinterpret_cast<__be32*>(gDbrecPage + gDbrecUsed);
  gDbrecUsed += 8;  // two dwords per record (QP: receive, send; CQ: consumer, arm)
  return r;
}

void* NewUarReg() {
  if (gUarUsed == 2) {
    gUarPage = static_cast<uint8_t*>(PageAlloc(kPage));
    gUarUsed = 0;
  }
  return gUarPage + 0x800 + 0x200 * gUarUsed++;
}

mlx5dv_cq& CqMemory(ibv_cq* cq) {
  auto it = gCqs.find(cq);
  if (it != gCqs.end()) return it->second;
  mlx5dv_cq c{};
  c.cqe_cnt = Pow2AtLeast(static_cast<uint32_t>(cq->cqe) + 1);
  c.cqe_size = 64;
  c.buf = PageAlloc(size_t{c.cqe_cnt} * 64);
  for (uint32_t i = 0; i < c.cqe_cnt; i++) {
    static_cast<mlx5_cqe64*>(c.buf)[i].op_own = MLX5_CQE_INVALID << 4;
  }
  c.dbrec = NewDbrec();
  c.cqn = static_cast<uint32_t>(0x400 + gCqs.size());
  return gCqs.emplace(cq, c).first->second;
}

QpMemory& QpMemoryOf(ibv_qp* qp) {
  auto it = gQps.find(qp);
  if (it != gQps.end()) return it->second;
  QpMemory m{};
  m.qpn = qp->qp_num;
  const auto* obj = reinterpret_cast<const FakeQpObject*>(qp);
  m.qp.sq.wqe_cnt = Pow2AtLeast(obj->maxSendWr);
  m.qp.sq.stride = 64;
  m.qp.sq.buf = PageAlloc(size_t{m.qp.sq.wqe_cnt} * 64);
  m.qp.dbrec = NewDbrec();
  m.qp.bf.reg = NewUarReg();
  m.qp.bf.size = 256;
  m.cq = CqMemory(qp->send_cq);
  return gQps.emplace(qp, m).first->second;
}

}  // namespace

extern "C" {

int fake_mlx5_init_obj_1_2(struct mlx5dv_obj* obj, uint64_t type) {
  std::lock_guard<std::mutex> lock(gMutex);
  if (long e = Override("fail", 0)) return static_cast<int>(e);
  if ((type & MLX5DV_OBJ_QP) != 0) {
    mlx5dv_qp q = QpMemoryOf(obj->qp.in).qp;
    q.sq.stride = static_cast<uint32_t>(Override("stride", q.sq.stride));
    q.sq.wqe_cnt = static_cast<uint32_t>(Override("wqe_cnt", q.sq.wqe_cnt));
    if (Override("null_bf", 0) != 0) q.bf.reg = nullptr;
    *obj->qp.out = q;
  }
  if ((type & MLX5DV_OBJ_CQ) != 0) {
    mlx5dv_cq c = CqMemory(obj->cq.in);
    c.cqe_size = static_cast<uint32_t>(Override("cqe_size", c.cqe_size));
    c.cqe_cnt = static_cast<uint32_t>(Override("cqe_cnt", c.cqe_cnt));
    *obj->cq.out = c;
  }
  return 0;
}

// The old ABI: a caller that binds to it gets an error (and the test sees the count).
int fake_mlx5_init_obj_1_0(struct mlx5dv_obj*, uint64_t) {
  std::lock_guard<std::mutex> lock(gMutex);
  gOldAbiCalls++;
  return EINVAL;
}

__asm__(".symver fake_mlx5_init_obj_1_0, mlx5dv_init_obj@MLX5_1.0");
__asm__(".symver fake_mlx5_init_obj_1_2, mlx5dv_init_obj@@MLX5_1.2");

// --- test-only controls ---
void fake_mlx5_set(const char* what, long value) {
  std::lock_guard<std::mutex> lock(gMutex);
  gOverrides[what] = value;
}

// Clears overrides and frees every queue memory handed out (call only when no QP uses it).
void fake_mlx5_reset() {
  std::lock_guard<std::mutex> lock(gMutex);
  gOverrides.clear();
  gQps.clear();
  gCqs.clear();
  for (void* p : gAllocations) std::free(p);
  gAllocations.clear();
  gDbrecPage = nullptr;
  gDbrecUsed = 0;
  gUarPage = nullptr;
  gUarUsed = 2;
}

// Queue memory handed out for the QP with number `qpn` (and its CQ); -1 when unknown.
int fake_mlx5_lookup(uint32_t qpn, struct mlx5dv_qp* q, struct mlx5dv_cq* c) {
  std::lock_guard<std::mutex> lock(gMutex);
  for (auto& [qp, m] : gQps) {
    if (m.qpn == qpn) {
      *q = m.qp;
      *c = m.cq;
      return 0;
    }
  }
  return -1;
}

int fake_mlx5_old_abi_calls() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gOldAbiCalls;
}

}  // extern "C"
