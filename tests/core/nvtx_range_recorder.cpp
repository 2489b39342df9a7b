// An NVTX v3 injection library, the way a profiler plugs into NVTX: NVTX calls
// InitializeInjectionNvtx2 at its first use in a process when NVTX_INJECTION64_PATH names this
// library, and the library replaces the entries of NVTX's callback tables it wants to see. This
// one records domain creation, range pushes and pops (the domain API and the global one). With
// MORI_NVTX_RECORDER_OUT=PREFIX each event is also appended, as it happens, to PREFIX.<pid>, so a
// program run with the library as its tool (the C++ example on a GPU, say) shows its ranges, also
// from processes that end with _exit (forked PEs).
#define NVTX_NO_IMPL
#include "nvtx_range_recorder.hpp"

#include <nvtx3/nvToolsExt.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

// NVTX leaves the domain handle's type to the tool.
struct nvtxDomainRegistration_st {
  std::string name;
};

namespace {

std::mutex gMutex;
std::string gLog;
int gInits = 0;
int gPushes = 0;
int gPops = 0;
int gUnpairedPops = 0;
thread_local int tOpen = 0;

// Adds one event line to the log (gMutex held) and, with MORI_NVTX_RECORDER_OUT=PREFIX, appends
// it to PREFIX.<pid> at once.
void Record(const std::string& line) {
  gLog += line;
  const char* prefix = std::getenv("MORI_NVTX_RECORDER_OUT");
  if (prefix == nullptr || *prefix == '\0') return;
  const std::string path = std::string(prefix) + "." + std::to_string(getpid());
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::fputs(line.c_str(), f);
    std::fclose(f);
  }
}

const char* DomainName(nvtxDomainHandle_t domain) {
  return domain != nullptr ? domain->name.c_str() : "-";
}

const char* Message(const nvtxEventAttributes_t* attr) {
  if (attr == nullptr) return "(no attributes)";
  return attr->messageType == NVTX_MESSAGE_TYPE_ASCII ? attr->message.ascii : "(not ASCII)";
}

int Push(nvtxDomainHandle_t domain, const char* name) {
  std::lock_guard<std::mutex> lock(gMutex);
  Record(std::string("push ") + DomainName(domain) + " " + name + "\n");
  gPushes++;
  return tOpen++;
}

int Pop(nvtxDomainHandle_t domain) {
  std::lock_guard<std::mutex> lock(gMutex);
  Record(std::string("pop ") + DomainName(domain) + "\n");
  gPops++;
  if (tOpen == 0) {
    gUnpairedPops++;
    return -1;
  }
  return --tOpen;
}

nvtxDomainHandle_t NVTX_API DomainCreateA(const char* name) {
  std::lock_guard<std::mutex> lock(gMutex);
  Record(std::string("domain ") + name + "\n");
  return new nvtxDomainRegistration_st{name};  // handles live as long as the process
}
int NVTX_API DomainRangePushEx(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* attr) {
  return Push(domain, Message(attr));
}
int NVTX_API DomainRangePop(nvtxDomainHandle_t domain) { return Pop(domain); }
int NVTX_API RangePushA(const char* name) { return Push(nullptr, name); }
int NVTX_API RangePushEx(const nvtxEventAttributes_t* attr) { return Push(nullptr, Message(attr)); }
int NVTX_API RangePop() { return Pop(nullptr); }

// Puts `fn` into entry `id` of a callback table of `size` entries; false when it has no such entry.
template <typename Fn>
bool Assign(NvtxFunctionTable table, unsigned int size, unsigned int id, Fn fn) {
  if (table == nullptr || id >= size || table[id] == nullptr) return false;
  *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
  return true;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int NVTX_API
InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable) {
  const auto* callbacks =
      static_cast<const NvtxExportTableCallbacks*>(getExportTable(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr || callbacks->struct_size < sizeof(NvtxExportTableCallbacks)) return 0;
  NvtxFunctionTable core = nullptr, core2 = nullptr;
  unsigned int coreSize = 0, core2Size = 0;
  if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &coreSize) ||
      !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &core2Size))
    return 0;
  const bool ok = Assign(core2, core2Size, NVTX_CBID_CORE2_DomainCreateA, &DomainCreateA) &&
                  Assign(core2, core2Size, NVTX_CBID_CORE2_DomainRangePushEx, &DomainRangePushEx) &&
                  Assign(core2, core2Size, NVTX_CBID_CORE2_DomainRangePop, &DomainRangePop) &&
                  Assign(core, coreSize, NVTX_CBID_CORE_RangePushA, &RangePushA) &&
                  Assign(core, coreSize, NVTX_CBID_CORE_RangePushEx, &RangePushEx) &&
                  Assign(core, coreSize, NVTX_CBID_CORE_RangePop, &RangePop);
  if (!ok) return 0;
  std::lock_guard<std::mutex> lock(gMutex);
  gInits++;
  return 1;
}

namespace mori::test {

int NvtxRecorderInits() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gInits;
}
std::string NvtxRecorderLog() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gLog;
}
int NvtxRecorderPushes() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gPushes;
}
int NvtxRecorderPops() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gPops;
}
int NvtxRecorderUnpairedPops() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gUnpairedPops;
}
int NvtxRecorderOpenRanges() { return tOpen; }

}  // namespace mori::test
