// The `mori._C` extension module. Links libmori only (no libtorch), so one build serves any torch.
#include "pybind_common.hpp"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mori native bindings (use the `mori` package rather than this module directly)";
  mori::pybind::RegisterErrors(m);
  mori::pybind::RegisterInfo(m);
  mori::pybind::RegisterShmem(m);
  mori::pybind::RegisterOpsBindings(m);
  mori::pybind::RegisterEpTestBindings(m);
}
