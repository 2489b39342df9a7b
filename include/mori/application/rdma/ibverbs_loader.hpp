// libibverbs, loaded on first use with dlopen("libibverbs.so.1"). mori never links -libverbs: a
// process that only uses P2P peers never loads it, and a host without rdma-core still runs.
// The table holds the entry points of device discovery and of the PD/MR/CQ/QP set-up
// (rdma_setup.hpp); optional newer ones (dma-buf registration) may be absent. The verbs types are
// only forward-declared, so this header does not need the rdma-core headers; the .cpp that calls
// through these pointers includes <infiniband/verbs.h>.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct ibv_device;
struct ibv_context;
struct ibv_device_attr;
struct ibv_port_attr;
struct ibv_gid_entry;
union ibv_gid;
struct ibv_pd;
struct ibv_mr;
struct ibv_cq;
struct ibv_comp_channel;
struct ibv_qp;
struct ibv_qp_init_attr;
struct ibv_qp_attr;

namespace mori::application {

// Exported libibverbs entry points, resolved at the IBVERBS_1.1 symbol version (the ABI verbs.h
// declares) where the library has one. Every pointer is non-null in a loaded table except those
// marked optional.
struct IbverbsApi {
  void* handle = nullptr;  // the dlopen handle; never closed (providers stay loaded)
  ibv_device** (*getDeviceList)(int* numDevices) = nullptr;
  void (*freeDeviceList)(ibv_device** list) = nullptr;
  const char* (*getDeviceName)(ibv_device* device) = nullptr;
  ibv_context* (*openDevice)(ibv_device* device) = nullptr;
  int (*closeDevice)(ibv_context* context) = nullptr;
  int (*queryDevice)(ibv_context* context, ibv_device_attr* attr) = nullptr;
  // The exported `ibv_query_port`. verbs.h turns calls to ibv_query_port into an inline wrapper
  // that prefers the provider's extended op; call IbvQueryPort() below, not this pointer.
  int (*queryPortExported)(ibv_context* context, uint8_t port, void* compatPortAttr) = nullptr;
  int (*queryGid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid) = nullptr;
  // Optional (libibverbs >= v34): `_ibv_query_gid_ex`, which also reports the GID type.
  int (*queryGidEx)(ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                    uint32_t flags, size_t entrySize) = nullptr;

  // Control path (PD, MR, CQ, RC QP set-up; see rdma_setup.hpp). Required unless marked optional.
  ibv_pd* (*allocPd)(ibv_context* context) = nullptr;
  int (*deallocPd)(ibv_pd* pd) = nullptr;
  // The exported `ibv_reg_mr` (IBVERBS_1.1). verbs.h makes ibv_reg_mr a macro over an inline that
  // calls this for access flags outside IBV_ACCESS_OPTIONAL_RANGE and ibv_reg_mr_iova2 otherwise.
  ibv_mr* (*regMr)(ibv_pd* pd, void* addr, size_t length, int access) = nullptr;
  // Optional (IBVERBS_1.8): `ibv_reg_mr_iova2`, needed only for optional-range access flags.
  ibv_mr* (*regMrIova2)(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                        unsigned int access) = nullptr;
  // Optional (IBVERBS_1.12): `ibv_reg_dmabuf_mr`.
  ibv_mr* (*regDmabufMr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                         int access) = nullptr;
  int (*deregMr)(ibv_mr* mr) = nullptr;
  ibv_cq* (*createCq)(ibv_context* context, int cqe, void* cqContext, ibv_comp_channel* channel,
                      int compVector) = nullptr;
  int (*destroyCq)(ibv_cq* cq) = nullptr;
  ibv_qp* (*createQp)(ibv_pd* pd, ibv_qp_init_attr* initAttr) = nullptr;
  int (*destroyQp)(ibv_qp* qp) = nullptr;
  int (*modifyQp)(ibv_qp* qp, ibv_qp_attr* attr, int attrMask) = nullptr;
};

// The process-wide table, loaded once (thread-safe). Returns null when libibverbs cannot be loaded
// or lacks a required symbol, with the reason in *why (if given), e.g.
// "libibverbs not available: libibverbs.so.1: cannot open shared object file: ...".
// That is a status, not an error: nothing is thrown and nothing is logged above INFO.
const IbverbsApi* Ibverbs(std::string* why);

// Uncached load of `soname` into *api (tests use a name that does not exist). Returns false with
// the reason in *why; on failure *api is left empty and the library is not kept open.
bool LoadIbverbsApi(const char* soname, IbverbsApi* api, std::string* why);

// ibv_query_port with verbs.h's semantics: the provider's extended query_port op when the context
// has one, else the exported function on a zeroed attribute struct. Returns 0 or an errno value.
int IbvQueryPort(const IbverbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr);

}  // namespace mori::application
