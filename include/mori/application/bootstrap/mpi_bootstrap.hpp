// Bootstrap over an MPI communicator. Available only when the library was built with MPI
// (MORI_WITH_MPI=1, set on the mori targets when CMake found MPI); include it only then.
#pragma once

#if !defined(MORI_WITH_MPI) || !MORI_WITH_MPI
#error "mpi_bootstrap.hpp needs a mori built with MPI (MORI_WITH_MPI=1)"
#endif

#include <mpi.h>

#include <cstddef>

#include "mori/application/bootstrap/bootstrap.hpp"

namespace mori::application {

class MpiBootstrapNetwork : public BootstrapNetwork {
 public:
  // Duplicates `comm` (collective over it); MPI must be initialised. MPI errors on the duplicate
  // are returned, not fatal, and raised as RemoteError.
  explicit MpiBootstrapNetwork(MPI_Comm comm);
  ~MpiBootstrapNetwork() override;
  MpiBootstrapNetwork(const MpiBootstrapNetwork&) = delete;
  MpiBootstrapNetwork& operator=(const MpiBootstrapNetwork&) = delete;

  int Rank() const override { return rank; }
  int WorldSize() const override { return worldSize; }
  void Allgather(const void* send, void* recv, size_t bytesPerRank) override;
  void AllToAll(const void* send, void* recv, size_t bytesPerPeer) override;
  void Barrier() override;
  // Frees the duplicate communicator (unless MPI is already finalised). Idempotent.
  void Finalize() override;

 private:
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int worldSize = 1;
};

}  // namespace mori::application
