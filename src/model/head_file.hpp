// A task head as plm stores it (doc/finetune.md): `task_kind`, `num_labels` and `pooling` as
// attributes of the file's root and the tensors under /head/<Hugging Face name> (fp32).  Written
// by `plm train` with task.kind set (<run_dir>/head.h5) and by `plm convert --from-hf` of an
// EsmForSequenceClassification / EsmForTokenClassification folder (inside the model file);
// read by `plm convert --to-hf`, `plm eval --head` and task.init_head.
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace plm::model {

struct HeadData {
  std::string task_kind;  // sequence_regression, sequence_classification, token_classification
  std::string pooling = "cls";
  std::int64_t num_labels = 0;
  std::vector<std::string> names;                 // Hugging Face names, e.g. classifier.weight
  std::vector<std::vector<std::int64_t>> shapes;  // per tensor
  std::vector<std::vector<float>> values;         // per tensor, row-major
};

/// \brief Collective over `comm`: true when `path` (an HDF5 file) holds a /head group.
bool hasHead(const std::string& path, MPI_Comm comm);
/// \brief Collective over `comm`: every rank reads the whole head of `path`.  Throws plm::Error
/// naming the file when it holds no /head group or lacks an attribute.
HeadData readHead(const std::string& path, MPI_Comm comm);
/// \brief Collective over `comm`: the attributes on `file`'s root and /head/<name> per tensor.
void writeHead(hid_t file, MPI_Comm comm, const HeadData& head);

}  // namespace plm::model
