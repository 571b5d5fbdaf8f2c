// One verdict for every rank: runs a step that may throw on some ranks only (rank 0's file
// system calls, a read one rank finds damaged) and turns the outcome into the same exception on
// all of them, carrying the message of the lowest failing rank.  Without it a rank that failed
// alone would leave the others waiting in the next collective.
#pragma once

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"
#include "dist/process_groups.hpp"

#include <mpi.h>

#include <exception>
#include <string>

namespace plm::ckpt::detail {

template <class F> void agree(MPI_Comm comm, F&& step) {
  int kind = 0;  // 0 ok, 1 corrupt checkpoint, 2 any other error
  std::string message;
  try {
    step();
  } catch (const CorruptCheckpoint& e) {
    kind = 1;
    message = e.what();
  } catch (const std::exception& e) {
    kind = 2;
    message = e.what();
  }
  int worst = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&kind, &worst, 1, MPI_INT, MPI_MAX, comm));
  if (worst == 0) return;
  const int rank = dist::commRank(comm), size = dist::commSize(comm);
  int mine = kind == worst ? rank : size, speaker = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&mine, &speaker, 1, MPI_INT, MPI_MIN, comm));
  long long length = static_cast<long long>(message.size());
  PLM_CHECK_MPI(MPI_Bcast(&length, 1, MPI_LONG_LONG, speaker, comm));
  message.resize(static_cast<std::size_t>(length));
  if (length > 0) PLM_CHECK_MPI(MPI_Bcast(message.data(), int(length), MPI_CHAR, speaker, comm));
  if (speaker != 0) message += " (rank " + std::to_string(speaker) + ")";
  if (worst == 1) throw CorruptCheckpoint(message, true);
  throw collectiveError(message);
}

}  // namespace plm::ckpt::detail
