// The MPI bootstrap plugin, libmori_mpi_bootstrap.so: MPI's C API behind the table of
// mpi_plugin_abi.hpp. It links MPI and nothing of mori's; it throws nothing and keeps no state
// besides the communicators it hands out. Only MORI_MPI_PLUGIN_ENTRY is exported.
#include <mpi.h>

#include <cstring>
#include <new>

#include "mpi_plugin_abi.hpp"

namespace {

void CopyText(const char* src, size_t srcLen, char* text, size_t capacity) {
  if (text == nullptr || capacity == 0) return;
  size_t n = srcLen < capacity - 1 ? srcLen : capacity - 1;
  std::memcpy(text, src, n);
  text[n] = '\0';
}

MPI_Comm& Comm(void* handle) { return *static_cast<MPI_Comm*>(handle); }

int State(int* initialized, int* finalized) {
  int rc = MPI_Initialized(initialized);
  if (rc != MPI_SUCCESS) return rc;
  return MPI_Finalized(finalized);
}

int LibraryVersion(char* text, size_t capacity) {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  int rc = MPI_Get_library_version(buf, &len);
  if (rc != MPI_SUCCESS) len = 0;
  CopyText(buf, static_cast<size_t>(len), text, capacity);
  return rc;
}

int ErrorString(int code, char* text, size_t capacity) {
  char buf[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  int rc = MPI_Error_string(code, buf, &len);
  if (rc != MPI_SUCCESS) len = 0;
  CopyText(buf, static_cast<size_t>(len), text, capacity);
  return rc;
}

int CommIsNull(const void* comm) {
  return comm != nullptr && *static_cast<const MPI_Comm*>(comm) == MPI_COMM_NULL ? 1 : 0;
}

int CommDup(const void* comm, void** handle) {
  MPI_Comm from = comm != nullptr ? *static_cast<const MPI_Comm*>(comm) : MPI_COMM_WORLD;
  MPI_Comm* dup = new (std::nothrow) MPI_Comm(MPI_COMM_NULL);
  if (dup == nullptr) return MPI_ERR_NO_MEM;
  int rc = MPI_Comm_dup(from, dup);
  if (rc != MPI_SUCCESS) {
    delete dup;
    return rc;
  }
  *handle = dup;
  return MPI_SUCCESS;
}

int CommSetErrorsReturn(void* handle) {
  return MPI_Comm_set_errhandler(Comm(handle), MPI_ERRORS_RETURN);
}

int CommRank(void* handle, int* rank) { return MPI_Comm_rank(Comm(handle), rank); }

int CommSize(void* handle, int* size) { return MPI_Comm_size(Comm(handle), size); }

int Allgather(void* handle, const void* send, void* recv, int count) {
  return MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, Comm(handle));
}

int Alltoall(void* handle, const void* send, void* recv, int count) {
  return MPI_Alltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, Comm(handle));
}

int Barrier(void* handle) { return MPI_Barrier(Comm(handle)); }

int CommFree(void* handle) {
  MPI_Comm* comm = static_cast<MPI_Comm*>(handle);
  int finalized = 0, rc = MPI_Finalized(&finalized);
  if (rc == MPI_SUCCESS && !finalized) rc = MPI_Comm_free(comm);
  delete comm;
  return rc;
}

const MoriMpiPlugin kPlugin = {
    MORI_MPI_PLUGIN_ABI_VERSION,
    static_cast<uint32_t>(sizeof(MPI_Comm)),
    State,
    LibraryVersion,
    ErrorString,
    CommIsNull,
    CommDup,
    CommSetErrorsReturn,
    CommRank,
    CommSize,
    Allgather,
    Alltoall,
    Barrier,
    CommFree,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const MoriMpiPlugin* mori_mpi_bootstrap_plugin(
    void) {
  return &kPlugin;
}
