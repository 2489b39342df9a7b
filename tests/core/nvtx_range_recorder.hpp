// What the NVTX injection library nvtx_range_recorder has seen in this process. NVTX loads the
// library from NVTX_INJECTION64_PATH, as it loads a profiler's; profiler_range_test also links it,
// so both reach the same record.
#pragma once

#include <string>

namespace mori::test {

// How many times NVTX initialised the library (0: no NVTX call reached a tool).
int NvtxRecorderInits();
// One line per event, in order: "domain <name>", "push <domain> <name>", "pop <domain>"; the
// domain is "-" for NVTX's global (domain-less) calls.
std::string NvtxRecorderLog();
// Pushes and pops seen, over all threads.
int NvtxRecorderPushes();
int NvtxRecorderPops();
// Pops on a thread that had no open range (each one a broken pairing).
int NvtxRecorderUnpairedPops();
// Ranges still open on the calling thread.
int NvtxRecorderOpenRanges();

}  // namespace mori::test
