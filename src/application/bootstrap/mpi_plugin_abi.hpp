// The C interface between libmori and the MPI bootstrap plugin (libmori_mpi_bootstrap.so). The
// plugin is the only code that calls MPI; libmori loads it with dlopen on the first MPI bootstrap
// and reaches MPI through the table below, so neither libmori nor the Python module links MPI.
// Both sides are built from one source tree: a plugin whose abiVersion differs is refused.
//
// Communicators cross the interface by address: `comm` points at an MPI_Comm of the plugin's MPI
// (commBytes bytes; null means MPI_COMM_WORLD), and a duplicated communicator is an opaque handle
// owned by the plugin. Every function except commIsNull returns MPI_SUCCESS (0, the same value in
// every MPI) or the MPI error code of the failing call; errorString turns a code into text.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

// Raise on any incompatible change of the table below.
#define MORI_MPI_PLUGIN_ABI_VERSION 1u
// The one symbol the plugin exports: returns its table (static storage, never null).
#define MORI_MPI_PLUGIN_ENTRY "mori_mpi_bootstrap_plugin"

struct MoriMpiPlugin {
  uint32_t abiVersion;  // MORI_MPI_PLUGIN_ABI_VERSION of the plugin's build
  uint32_t commBytes;   // sizeof(MPI_Comm) of the plugin's MPI
  // MPI_Initialized and MPI_Finalized (both may be called at any time).
  int (*state)(int* initialized, int* finalized);
  // MPI_Get_library_version into text[0 .. capacity) (NUL-terminated, truncated).
  int (*libraryVersion)(char* text, size_t capacity);
  // MPI_Error_string of `code` into text[0 .. capacity) (NUL-terminated, truncated).
  int (*errorString)(int code, char* text, size_t capacity);
  // 1 when *comm is MPI_COMM_NULL, else 0 (no MPI call).
  int (*commIsNull)(const void* comm);
  // MPI_Comm_dup of *comm (MPI_COMM_WORLD when comm is null) into a new handle, set to
  // *handle only on success.
  int (*commDup)(const void* comm, void** handle);
  // MPI_Comm_set_errhandler(MPI_ERRORS_RETURN) on the handle's communicator.
  int (*commSetErrorsReturn)(void* handle);
  int (*commRank)(void* handle, int* rank);
  int (*commSize)(void* handle, int* size);
  // MPI_Allgather / MPI_Alltoall of `count` MPI_BYTEs per rank.
  int (*allgather)(void* handle, const void* send, void* recv, int count);
  int (*alltoall)(void* handle, const void* send, void* recv, int count);
  int (*barrier)(void* handle);
  // Frees the handle, and its communicator with MPI_Comm_free unless MPI is already finalised.
  int (*commFree)(void* handle);
};

typedef const MoriMpiPlugin* (*MoriMpiPluginEntry)(void);

}  // extern "C"
