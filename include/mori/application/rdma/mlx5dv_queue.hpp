// libmlx5 direct verbs, loaded on first use with dlopen("libmlx5.so.1") like libibverbs (never
// linked), and the one thing mori takes from it: the provider-owned memory of a verbs-created QP
// and CQ (mlx5dv_init_obj), which the posting protocol (core/transport/rdma_queue.hpp) then drives
// directly. mlx5 types are only forward-declared here.
#pragma once

#include <cstdint>
#include <string>

struct mlx5dv_obj;
struct ibv_qp;
struct ibv_cq;

namespace mori::application {

struct Mlx5dvApi {
  void* handle = nullptr;  // never closed
  // `mlx5dv_init_obj` at MLX5_1.2, the version mlx5dv.h's declaration binds to (MLX5_1.0 is an
  // older ABI kept for old binaries).
  int (*initObj)(mlx5dv_obj* obj, uint64_t objType) = nullptr;
};

// The process-wide table (thread-safe, loaded once); null with the reason in *why when libmlx5
// cannot be loaded or lacks mlx5dv_init_obj. A status, not an error.
const Mlx5dvApi* Mlx5dv(std::string* why);
// Uncached load of `soname` (tests load a stand-in). False with the reason in *why.
bool LoadMlx5dvApi(const char* soname, Mlx5dvApi* api, std::string* why);

// Provider-owned queue memory of one RC QP and its CQ (host addresses, as the provider mapped
// them). The SQ ring holds sqBlocks 64-byte basic blocks; the CQ ring numCqes 64-byte CQEs,
// initialised by the provider (mori never rewrites it).
struct Mlx5QueueMemory {
  uint32_t qpn = 0;
  void* sqBuf = nullptr;
  uint32_t sqBlocks = 0;
  uint32_t* sqDbrec = nullptr;  // doorbell record dword 1 (send queue)
  void* uarReg = nullptr;       // the QP's doorbell register (bf.reg) in the mapped UAR page
  uint32_t bfSize = 0;
  void* cqBuf = nullptr;
  uint32_t numCqes = 0;
  uint32_t* cqDbrec = nullptr;  // CQ doorbell record dword 0 (consumer index)
  uint32_t cqn = 0;
};

// mlx5dv_init_obj on `qp` and `cq`, then checks what the posting protocol relies on: SQ stride 64,
// wqe_cnt == expectedSqBlocks (a power of two), CQE size 64, cqe_cnt a power of two and >=
// expectedSqBlocks, no null pointer. A failure raises SystemError naming the call or the
// mismatch and `device`.
Mlx5QueueMemory InitMlx5Queue(const Mlx5dvApi& api, ibv_qp* qp, ibv_cq* cq,
                              uint32_t expectedSqBlocks, const std::string& device);

}  // namespace mori::application
