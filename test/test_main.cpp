// gtest main shared by every test: starts MPI and Kokkos (through plm's own Runtime) and lets
// only rank 0 print gtest's report, so MPI tests read like serial ones.
#include "dist/runtime.hpp"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  plm::dist::Runtime runtime(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (plm::dist::worldRank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS();
  // A test fails if it failed on any rank.
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}
