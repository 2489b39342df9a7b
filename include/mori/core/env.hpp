// The one table of environment settings. Every MORI_* variable the library reads is declared here
// (name, type, default, help), read once, printed by `mori-info` and documented in docs/env.md
// (tests/core/env_doc_test checks that the doc lists exactly these names).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mori::core {

// X(field, NAME, Type, default-as-text, help)
// Types: Bool (1/0/true/false/yes/no/on/off), Int (decimal), Size (bytes; K/M/G/T suffixes,
// optional B or iB, powers of 1024), String.
// An X-macro table, one row per entry, laid out by hand:
// clang-format off
#define MORI_ENV_TABLE(X)                                                                          \
  X(logLevel, MORI_LOG_LEVEL, String, "WARN",                                                     \
    "Log threshold: NONE, ERROR, WARN, INFO, DEBUG, TRACE.")                                      \
  X(logSubsys, MORI_LOG_SUBSYS, String, "ALL",                                                    \
    "Comma list of subsystems to log (INIT,BOOTSTRAP,SHMEM,MEM,TOPO,RDMA,OPS,ENV or ALL); a "     \
    "leading ^ logs all but these.")                                                              \
  X(logFile, MORI_LOG_FILE, String, "",                                                           \
    "Write logs to this file instead of stderr; %h expands to the host name, %p to the pid.")     \
  X(bootstrapTimeoutSec, MORI_BOOTSTRAP_TIMEOUT, Int, "120",                                      \
    "Seconds any bootstrap wait (connect, allgather, all-to-all, barrier) may take before it "    \
    "fails naming the ranks that never arrived.")                                                 \
  X(socketIfname, MORI_SOCKET_IFNAME, String, "",                                                 \
    "Network interface whose IPv4 address the socket bootstrap's unique id carries; default: "    \
    "the first non-loopback interface, else loopback.")                                           \
  X(nodeId, MORI_NODE_ID, String, "",                                                             \
    "Override this process's node identity (default: kernel boot_id, then host name).")           \
  X(heapSize, MORI_SHMEM_HEAP_SIZE, Size, "4G",                                                   \
    "Bytes of the symmetric heap allocated on every PE at init (e.g. 512M, 4G).")                  \
  X(deviceTimeoutMs, MORI_DEVICE_TIMEOUT_MS, Int, "60000",                                        \
    "Milliseconds a device-side wait may spin before it records an attributed timeout and the "   \
    "kernel bails out.")                                                                          \
  X(hostTimeoutMs, MORI_HOST_TIMEOUT_MS, Int, "120000",                                           \
    "Milliseconds a host-side wait on device work (e.g. stream synchronisation in the shmem "     \
    "host API) may take before it raises a timeout.")                                             \
  X(disableP2P, MORI_DISABLE_P2P, Bool, "0",                                                      \
    "Do not use load/store P2P between GPUs of one node (peers then need RDMA).")                 \
  X(gpuPerNode, MORI_GPU_PER_NODE, Int, "0",                                                      \
    "Treat every group of this many consecutive ranks as one node (0 = detect). 1 makes every "   \
    "GPU its own node, for testing the RDMA path on one host.")                                   \
  X(rdmaDevices, MORI_RDMA_DEVICES, String, "",                                                   \
    "RDMA devices to use: unset = every device with an active port; mlx5_0,mlx5_1 = only "        \
    "these, in this order; ^mlx5_2,mlx5_3 = all but these. Names are trimmed and exact.")         \
  X(numQpPerPe, MORI_NUM_QP_PER_PE, Int, "1",                                                     \
    "RC queue pairs (each with its own CQ) per remote PE reached through RDMA.")                  \
  X(rdmaGidIndex, MORI_RDMA_GID_INDEX, Int, "-1",                                                 \
    "GID table index used for RoCE addressing; -1 = choose automatically (RoCE v2, "              \
    "IPv4-mapped preferred).")                                                                  \
  X(rdmaEmulate, MORI_RDMA_EMULATE, Bool, "0",                                                    \
    "Execute RDMA work requests with the software queue emulator, one NIC process per PE "       \
    "(test/bring-up mode; every PE on one host).")                                                \
  X(rdmaEmulateChaos, MORI_RDMA_EMULATE_CHAOS, Int, "0",                                          \
    "Emulator chaos mode seed (0 = off): random delays, late completions and queue pairs served " \
    "out of order with each other; order within one QP is kept.")                                 \
  X(rdmaEmulateTrace, MORI_RDMA_EMULATE_TRACE, Int, "0",                                          \
    "Entries of the emulator's trace ring of executed work requests (0 = no trace); the newest "  \
    "are kept, see mori.shmem.rdma_stats().")                                                     \
  X(rdmaDoorbell, MORI_RDMA_DOORBELL, String, "auto",                                             \
    "How GPU threads ring the NIC doorbell (verbs transport): auto = the UAR page mapped for the " \
    "GPU when the driver allows it, else a CPU proxy thread; uar = mapped UAR or fail; cpu = "     \
    "always the CPU proxy thread.")                                                           \
  X(epCombineStaged, MORI_EP_COMBINE_STAGED, String, "auto",                                      \
    "Large-batch EP combine streams the peers' rows into shared memory with bulk copies "         \
    "(NVIDIA sm_90+): auto = where measured faster (at most 2 PEs in the op); 1 = always; "       \
    "0 = register loads only.")                                                                  \
  X(epDispatchLocalBlocks, MORI_EP_DISPATCH_LOCAL_BLOCKS, Int, "0",                              \
    "IntraNode and InterNode dispatch with at least 3 blocks per PE of the op: blocks copying "   \
    "the rows a PE keeps (at most the blocks less 3 per peer); the rest stream to the peers. "    \
    "0 = blocks / (2 x PEs - 1), at least 1. Read when an op is created.")                        \
  X(epCombinePrecopy, MORI_EP_COMBINE_PRECOPY, Bool, "1",                                         \
    "IntraNode pull combine of an external input (more than one PE): a kernel of its own copies " \
    "the input into the registered buffer, beside the combine kernel on the SMs it leaves free "  \
    "(before it, on every SM, without programmatic launches), instead of the combine's own "      \
    "blocks; 0 = the combine's blocks copy (on its SMs only).")                                   \
  X(epCombinePush, MORI_EP_COMBINE_PUSH, Bool, "1",                                               \
    "AsyncLL EP ops, and others with at most 256 tokens per rank, combine by pushing each row "   \
    "to its token's PE and summing locally; 0 = every PE pulls its tokens' rows (one extra round " \
    "trip).")                                                                                     \
  X(epPdl, MORI_EP_PDL, Bool, "1",                                                                \
    "EP kernels are programmatic dependent launches (NVIDIA sm_90+): each may be launched while "  \
    "the kernel ahead of it on the stream completes, and waits for it on the GPU; 0 = plain "      \
    "launches.")                                                                                   \
  X(nvtx, MORI_NVTX, Bool, "0",                                                                    \
    "Name mori's host calls (shmem init/finalize, EP op creation/release, dispatch, combine and "  \
    "their halves) as profiler ranges: NVTX domain mori on CUDA, roctx on HIP. Read once, at "     \
    "the first such call.")
// clang-format on

enum class EnvType { kBool, kInt, kSize, kString };

struct EnvValues {
#define MORI_ENV_FIELD_Bool bool
#define MORI_ENV_FIELD_Int int64_t
#define MORI_ENV_FIELD_Size uint64_t
#define MORI_ENV_FIELD_String std::string
#define MORI_ENV_DECLARE_FIELD(field, name, type, def, help) MORI_ENV_FIELD_##type field{};
  MORI_ENV_TABLE(MORI_ENV_DECLARE_FIELD)
#undef MORI_ENV_DECLARE_FIELD
};

struct EnvEntry {
  const char* name;
  EnvType type;
  const char* defaultText;
  const char* help;
  std::string valueText;  // the value in effect, normalised
  bool fromEnvironment;   // false: the default
};

// The settings in effect: a copy of the current snapshot (taken at first use, replaced by
// ReloadEnv). Bad values raise InvalidUsageError naming the variable. Safe to call from any
// thread while another reloads: a caller sees the old or the new snapshot, never a mix, and
// `const auto& v = Env().field;` stays valid (the copy lives as long as the reference).
EnvValues Env();
// The current snapshot itself, shared and immutable (no copy; kept alive while held).
std::shared_ptr<const EnvValues> EnvSnapshot();
// Every entry with its value and source, in table order (for mori-info and docs).
std::vector<EnvEntry> EnvEntries();
// Re-read the environment and publish a new snapshot (tests; shmem init calls it so a new init
// sees the current settings). On a bad value it raises and the previous snapshot stays.
void ReloadEnv();

// Parsers, exposed for tests. All raise InvalidUsageError with `name` in the message.
bool ParseEnvBool(const char* name, const std::string& text);
int64_t ParseEnvInt(const char* name, const std::string& text);
// A boolean that may also be left to the library: empty or "auto" (any case) -> nullopt, else
// ParseEnvBool's spellings.
std::optional<bool> ParseEnvAutoBool(const char* name, const std::string& text);
uint64_t ParseEnvSize(const char* name, const std::string& text);

}  // namespace mori::core
