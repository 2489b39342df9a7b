#include "mori/application/rdma/ibverbs_loader.hpp"

#include <dlfcn.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "mori/core/logging.hpp"

#include "verbs_headers.hpp"

namespace mori::application {
namespace {

constexpr const char* kIbverbsSoname = "libibverbs.so.1";
// Symbols that exist at two versions (1.0 with the ibv_device_1_0 ABI, 1.1 with today's) must be
// taken at 1.1; plain dlsym would also pick 1.1 (the default version), dlvsym makes it explicit.
constexpr const char* kIbverbsVersion = "IBVERBS_1.1";

std::string DlErrorText() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

template <typename Fn>
bool Resolve(void* handle, const char* name, bool versioned, Fn* out, std::string* missing) {
  void* sym = versioned ? dlvsym(handle, name, kIbverbsVersion) : nullptr;
  if (sym == nullptr) sym = dlsym(handle, name);
  if (sym == nullptr) {
    if (missing != nullptr) {
      if (!missing->empty()) *missing += ", ";
      *missing += name;
    }
    return false;
  }
  *out = reinterpret_cast<Fn>(sym);
  return true;
}

}  // namespace

bool LoadIbverbsApi(const char* soname, IbverbsApi* api, std::string* why) {
  *api = IbverbsApi{};
  (void)dlerror();
  void* handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    if (why != nullptr) *why = "libibverbs not available: " + DlErrorText();
    return false;
  }
  IbverbsApi t;
  t.handle = handle;
  std::string missing;
  bool ok = true;
  ok &= Resolve(handle, "ibv_get_device_list", true, &t.getDeviceList, &missing);
  ok &= Resolve(handle, "ibv_free_device_list", true, &t.freeDeviceList, &missing);
  ok &= Resolve(handle, "ibv_get_device_name", true, &t.getDeviceName, &missing);
  ok &= Resolve(handle, "ibv_open_device", true, &t.openDevice, &missing);
  ok &= Resolve(handle, "ibv_close_device", true, &t.closeDevice, &missing);
  ok &= Resolve(handle, "ibv_query_device", true, &t.queryDevice, &missing);
  ok &= Resolve(handle, "ibv_query_port", true, &t.queryPortExported, &missing);
  ok &= Resolve(handle, "ibv_query_gid", true, &t.queryGid, &missing);
  (void)Resolve(handle, "_ibv_query_gid_ex", false, &t.queryGidEx, nullptr);
  // Control path. Optional ones are taken at their default (newest) version.
  ok &= Resolve(handle, "ibv_alloc_pd", true, &t.allocPd, &missing);
  ok &= Resolve(handle, "ibv_dealloc_pd", true, &t.deallocPd, &missing);
  ok &= Resolve(handle, "ibv_reg_mr", true, &t.regMr, &missing);
  (void)Resolve(handle, "ibv_reg_mr_iova2", false, &t.regMrIova2, nullptr);
  (void)Resolve(handle, "ibv_reg_dmabuf_mr", false, &t.regDmabufMr, nullptr);
  ok &= Resolve(handle, "ibv_dereg_mr", true, &t.deregMr, &missing);
  ok &= Resolve(handle, "ibv_create_cq", true, &t.createCq, &missing);
  ok &= Resolve(handle, "ibv_destroy_cq", true, &t.destroyCq, &missing);
  ok &= Resolve(handle, "ibv_create_qp", true, &t.createQp, &missing);
  ok &= Resolve(handle, "ibv_destroy_qp", true, &t.destroyQp, &missing);
  ok &= Resolve(handle, "ibv_modify_qp", true, &t.modifyQp, &missing);
  if (!ok) {
    if (why != nullptr) {
      *why = std::string("libibverbs not usable: ") + soname + " lacks " + missing;
    }
    dlclose(handle);
    return false;
  }
  *api = t;
  return true;
}

const IbverbsApi* Ibverbs(std::string* why) {
  static std::once_flag once;
  static IbverbsApi api;
  static bool loaded = false;
  static std::string reason;
  std::call_once(once, [] {
#if MORI_HAVE_VERBS_H
    loaded = LoadIbverbsApi(kIbverbsSoname, &api, &reason);
    if (loaded) {
      MORI_INFO(kLogRdma, "loaded %s", kIbverbsSoname);
    } else {
      MORI_INFO(kLogRdma, "%s", reason.c_str());
    }
#else
    reason = "libibverbs not available: this mori was built without the rdma-core headers";
#endif
  });
  if (!loaded && why != nullptr) *why = reason;
  return loaded ? &api : nullptr;
}

int IbvQueryPort(const IbverbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr) {
#if MORI_HAVE_VERBS_H
  // Same decision as verbs.h's inline ibv_query_port: the extended op reports the full struct.
  struct verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx != nullptr) return vctx->query_port(context, port, attr, sizeof(*attr));
  std::memset(attr, 0, sizeof(*attr));
  return api.queryPortExported(context, port, attr);
#else
  (void)api;
  (void)context;
  (void)port;
  (void)attr;
  return ENOSYS;
#endif
}

}  // namespace mori::application
