#include "mori/application/bootstrap/mpi_bootstrap.hpp"

#include <climits>
#include <cstdint>

#include "mori/core/errors.hpp"

namespace mori::application {
namespace {

void CheckMpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) text[0] = '\0';
  MORI_THROW(RemoteError, "MPI bootstrap: %s failed: %s (code %d)", what, text, rc);
}

int ByteCount(size_t bytes, const char* what) {
  MORI_ENSURE(bytes <= static_cast<size_t>(INT_MAX), InvalidUsageError,
              "MPI bootstrap: %s of %zu bytes per rank exceeds INT_MAX", what, bytes);
  return static_cast<int>(bytes);
}

}  // namespace

MpiBootstrapNetwork::MpiBootstrapNetwork(MPI_Comm userComm) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  MORI_ENSURE(initialized && !finalized, InvalidUsageError,
              "MPI bootstrap: MPI is not initialised (call MPI_Init first)");
  MORI_ENSURE(userComm != MPI_COMM_NULL, InvalidUsageError, "MPI bootstrap: MPI_COMM_NULL");
  CheckMpi(MPI_Comm_dup(userComm, &comm), "MPI_Comm_dup");
  try {
    CheckMpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    CheckMpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    CheckMpi(MPI_Comm_size(comm, &worldSize), "MPI_Comm_size");
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
}

MpiBootstrapNetwork::~MpiBootstrapNetwork() { Finalize(); }

void MpiBootstrapNetwork::Allgather(const void* send, void* recv, size_t bytesPerRank) {
  MORI_ENSURE(comm != MPI_COMM_NULL, InvalidUsageError, "MPI bootstrap: Allgather after Finalize");
  int count = ByteCount(bytesPerRank, "Allgather");
  if (count == 0) return;
  MORI_ENSURE(send != nullptr && recv != nullptr, InvalidUsageError,
              "MPI bootstrap: Allgather with a null buffer");
  CheckMpi(MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm), "MPI_Allgather");
}

void MpiBootstrapNetwork::AllToAll(const void* send, void* recv, size_t bytesPerPeer) {
  MORI_ENSURE(comm != MPI_COMM_NULL, InvalidUsageError, "MPI bootstrap: AllToAll after Finalize");
  int count = ByteCount(bytesPerPeer, "AllToAll");
  if (count == 0) return;
  MORI_ENSURE(send != nullptr && recv != nullptr, InvalidUsageError,
              "MPI bootstrap: AllToAll with a null buffer");
  CheckMpi(MPI_Alltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm), "MPI_Alltoall");
}

void MpiBootstrapNetwork::Barrier() {
  MORI_ENSURE(comm != MPI_COMM_NULL, InvalidUsageError, "MPI bootstrap: Barrier after Finalize");
  CheckMpi(MPI_Barrier(comm), "MPI_Barrier");
}

void MpiBootstrapNetwork::Finalize() {
  if (comm == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm);
  comm = MPI_COMM_NULL;
}

}  // namespace mori::application
