// Bootstrap over an MPI communicator, for programs that use MPI themselves (this header includes
// <mpi.h>). libmori links no MPI: the MPI calls are made by the plugin libmori_mpi_bootstrap.so,
// loaded on first use (mpi_plugin.hpp), which must be built with the same MPI as the caller.
// Without the plugin the constructor raises InvalidUsageError; with a plugin that does not load
// (its MPI library is missing, ...) SystemError.
#pragma once

#include <mpi.h>

#include "mori/application/bootstrap/mpi_plugin.hpp"

namespace mori::application {

class MpiBootstrapNetwork : public MpiPluginBootstrapNetwork {
 public:
  // Duplicates `comm` (collective over it); MPI must be initialised. MPI errors on the duplicate
  // are returned, not fatal, and raised as RemoteError.
  explicit MpiBootstrapNetwork(MPI_Comm comm) : MpiPluginBootstrapNetwork(&comm, sizeof(comm)) {}
};

}  // namespace mori::application
