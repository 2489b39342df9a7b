#include "mori/application/rdma/mlx5dv_queue.hpp"

#include <dlfcn.h>

#include <cstring>
#include <mutex>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

#if __has_include(<infiniband/mlx5dv.h>)
#include <infiniband/mlx5dv.h>
#define MORI_HAVE_MLX5DV_H 1
#else
#define MORI_HAVE_MLX5DV_H 0
#endif

namespace mori::application {
namespace {
constexpr const char* kMlx5Soname = "libmlx5.so.1";
constexpr const char* kInitObjVersion = "MLX5_1.2";

bool IsPowerOfTwo(uint32_t v) { return v != 0 && (v & (v - 1)) == 0; }
}  // namespace

bool LoadMlx5dvApi(const char* soname, Mlx5dvApi* api, std::string* why) {
  *api = Mlx5dvApi{};
  (void)dlerror();
  void* handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    if (why != nullptr) *why = std::string("libmlx5 not available: ") + (e ? e : "dlopen failed");
    return false;
  }
  void* sym = dlvsym(handle, "mlx5dv_init_obj", kInitObjVersion);
  if (sym == nullptr) sym = dlsym(handle, "mlx5dv_init_obj");
  if (sym == nullptr) {
    if (why != nullptr)
      *why = std::string("libmlx5 not usable: ") + soname + " lacks mlx5dv_init_obj";
    dlclose(handle);
    return false;
  }
  api->handle = handle;
  api->initObj = reinterpret_cast<int (*)(mlx5dv_obj*, uint64_t)>(sym);
  return true;
}

const Mlx5dvApi* Mlx5dv(std::string* why) {
  static std::once_flag once;
  static Mlx5dvApi api;
  static bool loaded = false;
  static std::string reason;
  std::call_once(once, [] {
#if MORI_HAVE_MLX5DV_H
    loaded = LoadMlx5dvApi(kMlx5Soname, &api, &reason);
    MORI_INFO(kLogRdma, "%s", loaded ? "loaded libmlx5.so.1" : reason.c_str());
#else
    reason = "libmlx5 not available: this mori was built without <infiniband/mlx5dv.h>";
#endif
  });
  if (!loaded && why != nullptr) *why = reason;
  return loaded ? &api : nullptr;
}

#if MORI_HAVE_MLX5DV_H
Mlx5QueueMemory InitMlx5Queue(const Mlx5dvApi& api, ibv_qp* qp, ibv_cq* cq,
                              uint32_t expectedSqBlocks, const std::string& device) {
  MORI_ENSURE(qp != nullptr && cq != nullptr && IsPowerOfTwo(expectedSqBlocks), InvalidUsageError,
              "InitMlx5Queue on %s: needs a QP, a CQ and a power-of-two SQ size (got %u)",
              device.c_str(), expectedSqBlocks);
  mlx5dv_qp dq{};
  mlx5dv_cq dc{};
  mlx5dv_obj obj{};
  obj.qp.in = qp;
  obj.qp.out = &dq;
  obj.cq.in = cq;
  obj.cq.out = &dc;
  int rc = api.initObj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ);
  if (rc != 0) {
    MORI_THROW(SystemError, "mlx5dv_init_obj failed on %s for QP %u: %s (errno %d)", device.c_str(),
               qp->qp_num, std::strerror(rc > 0 ? rc : -rc), rc);
  }
  Mlx5QueueMemory m;
  m.qpn = qp->qp_num;
  m.sqBuf = dq.sq.buf;
  m.sqBlocks = dq.sq.wqe_cnt;
  m.sqDbrec = dq.dbrec != nullptr ? reinterpret_cast<uint32_t*>(&dq.dbrec[MLX5_SND_DBR]) : nullptr;
  m.uarReg = dq.bf.reg;
  m.bfSize = dq.bf.size;
  m.cqBuf = dc.buf;
  m.numCqes = dc.cqe_cnt;
  m.cqDbrec = reinterpret_cast<uint32_t*>(dc.dbrec);
  m.cqn = dc.cqn;
  auto bad = [&](const char* what, unsigned long long got, unsigned long long want) {
    MORI_THROW(SystemError,
               "mlx5dv_init_obj on %s, QP %u: %s is %llu, mori needs %llu (the posting protocol "
               "drives the provider's queues directly)",
               device.c_str(), m.qpn, what, got, want);
  };
  if (m.sqBuf == nullptr || m.sqDbrec == nullptr || m.uarReg == nullptr || m.cqBuf == nullptr ||
      m.cqDbrec == nullptr) {
    MORI_THROW(
        SystemError,
        "mlx5dv_init_obj on %s, QP %u: null queue memory (sq %p, dbrec %p, bf.reg %p, cq %p, "
        "cq dbrec %p)",
        device.c_str(), m.qpn, m.sqBuf, static_cast<void*>(m.sqDbrec), m.uarReg, m.cqBuf,
        static_cast<void*>(m.cqDbrec));
  }
  if (dq.sq.stride != 64) bad("SQ stride", dq.sq.stride, 64);
  if (m.sqBlocks != expectedSqBlocks)
    bad("SQ wqe_cnt (basic blocks)", m.sqBlocks, expectedSqBlocks);
  if (dc.cqe_size != 64) bad("CQE size (set MLX5_CQE_SIZE=64 or unset it)", dc.cqe_size, 64);
  if (!IsPowerOfTwo(m.numCqes)) bad("cqe_cnt (not a power of two)", m.numCqes, expectedSqBlocks);
  if (m.numCqes < expectedSqBlocks)
    bad("cqe_cnt (fewer CQEs than SQ blocks)", m.numCqes, expectedSqBlocks);
  MORI_DEBUG(
      kLogRdma,
      "%s QP %u: SQ %p x%u blocks, dbrec %p, bf.reg %p (size %u); CQ %u %p x%u CQEs, dbrec %p",
      device.c_str(), m.qpn, m.sqBuf, m.sqBlocks, static_cast<void*>(m.sqDbrec), m.uarReg, m.bfSize,
      m.cqn, m.cqBuf, m.numCqes, static_cast<void*>(m.cqDbrec));
  return m;
}
#else
Mlx5QueueMemory InitMlx5Queue(const Mlx5dvApi&, ibv_qp*, ibv_cq*, uint32_t,
                              const std::string& device) {
  MORI_THROW(SystemError, "mlx5 queues on %s impossible: built without <infiniband/mlx5dv.h>",
             device.c_str());
}
#endif

}  // namespace mori::application
