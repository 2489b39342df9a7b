// Shared by the files of the `mori._C` module. The binding is torch-free: pointers and streams
// cross as Python ints, tensors are built on the Python side (mori.shmem.tensor_from_ptr).
#pragma once

#include <pybind11/pybind11.h>

namespace mori::pybind {

namespace py = pybind11;

// Python exception classes mirroring mori::core::Error and a translator for them.
void RegisterErrors(py::module_& m);
// env_entries, version, backend, device_info, rdma_devices, _dlpack_bytes.
void RegisterInfo(py::module_& m);
// shmem_* host API and _init_with_callbacks.
void RegisterShmem(py::module_& m);
// mori._C.ops: dispatch/combine config and handle (ops_bindings.cpp).
void RegisterOpsBindings(py::module_& m);
// mori._C._testing: the EP kernels' host-callable arithmetic, for the tests (ep_test_bindings.cpp).
void RegisterEpTestBindings(py::module_& m);

}  // namespace mori::pybind
