// MPI bootstrap test; run under mpiexec (CTest does, with 3 ranks). Only rank 0 prints gtest
// output; the exit code is the same on every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "mori/application/bootstrap/mpi_bootstrap.hpp"
#include "mori/core/errors.hpp"

namespace mori::application {
namespace {

uint8_t Pattern(int src, int dst, size_t j) {
  return static_cast<uint8_t>(src * 131 + dst * 17 + j * 7 + 3);
}

TEST(MpiBootstrapTest, CollectivesMatchMpiWorld) {
  int worldRank = 0, worldSize = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &worldRank);
  MPI_Comm_size(MPI_COMM_WORLD, &worldSize);
  MpiBootstrapNetwork net(MPI_COMM_WORLD);
  ASSERT_EQ(net.Rank(), worldRank);
  ASSERT_EQ(net.WorldSize(), worldSize);
  const int n = worldSize, me = worldRank;

  for (size_t bytes : {size_t(0), size_t(1), size_t(1000)}) {
    std::vector<uint8_t> send(bytes), recv(bytes * n);
    for (size_t j = 0; j < bytes; j++) send[j] = Pattern(me, -1, j);
    net.Allgather(send.data(), recv.data(), bytes);
    for (int r = 0; r < n; r++)
      for (size_t j = 0; j < bytes; j++) ASSERT_EQ(recv[r * bytes + j], Pattern(r, -1, j));

    std::vector<uint8_t> a2aSend(bytes * n), a2aRecv(bytes * n);
    for (int p = 0; p < n; p++)
      for (size_t j = 0; j < bytes; j++) a2aSend[p * bytes + j] = Pattern(me, p, j);
    net.AllToAll(a2aSend.data(), a2aRecv.data(), bytes);
    for (int r = 0; r < n; r++)
      for (size_t j = 0; j < bytes; j++) ASSERT_EQ(a2aRecv[r * bytes + j], Pattern(r, me, j));
    net.Barrier();
  }
  net.Finalize();
  net.Finalize();
  EXPECT_THROW(net.Barrier(), core::InvalidUsageError);
  // The caller's communicator is untouched by the network's duplicate being freed.
  EXPECT_EQ(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
}

TEST(MpiBootstrapTest, RejectsNullComm) {
  EXPECT_THROW(MpiBootstrapNetwork net(MPI_COMM_NULL), core::InvalidUsageError);
}

}  // namespace
}  // namespace mori::application

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0, anyFailed = 0;
  MPI_Allreduce(&failed, &anyFailed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return anyFailed;
}
