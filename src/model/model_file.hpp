// The plm model file: one HDF5 file holding an ESM-2 model (doc/interop.md).
//
//   attributes on `/`: format = "plm-esm2", format_version, architecture = "EsmForMaskedLM",
//     num_layers, hidden, heads, ffn, vocab, max_positions, layer_norm_eps, token_dropout,
//     plus any extra attributes the writer passes (plm_version, source, step, ...)
//   /model/<Hugging Face parameter name>   fp32, the tensor's full Hugging Face shape
//     (e.g. /model/esm.encoder.layer.0.attention.self.query.weight is (H, H), out x in)
//
// Checkpoints (src/ckpt) are this same file with more groups (/optimizer/..., /state), so the
// pieces are exposed separately: config attributes, and a "tensor group" writer/reader that any
// group of named, model-shaped tensors can use (parameters, Adam moments).
//
// Design choices: writing is collective over a communicator and each rank writes a contiguous
// row range of every tensor (dimension 0), so a replicated model is written once in parallel
// and a sharded one later writes its own rows with the same call.  Reading checks names and
// shapes against the model's tensor table before any data is read, and rejects a file whose
// /model has tensors the model does not know (a config mismatch would otherwise load silently).
#pragma once

#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "model/esm2.hpp"

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace plm::model {

inline constexpr const char* model_format = "plm-esm2";
inline constexpr std::int64_t model_format_version = 1;

/// Extra attributes written on `/` next to the config (provenance, training step, ...).
struct ModelAttributes {
  std::map<std::string, std::string> strings;
  std::map<std::string, std::int64_t> integers;
  std::map<std::string, double> numbers;
};

/// \brief Writes format, format_version, architecture and every Esm2Config field (except the
/// run-time `recompute`) as attributes of `location`.
void writeConfigAttributes(hid_t location, const model::Esm2Config& config);
void writeExtraAttributes(hid_t location, const ModelAttributes& extra);
/// \brief Reads the config attributes back; a clear plm::Error if `format` is not plm's or the
/// version is newer than this build understands. `path` is only used in messages.
model::Esm2Config readConfigAttributes(hid_t location, const std::string& path);

/// \brief The rows of dimension 0 that `rank` of `world` owns: [first, second).
std::pair<std::int64_t, std::int64_t> rowRange(std::int64_t rows, int rank, int world);

/// \brief Collective over `comm`: creates `group`/<name> (fp32, full shape) for every tensor
/// and writes this rank's row range (rowRange) of each from `values`, the full flat buffer laid
/// out as `tensors` says (values[t.offset .. t.offset + t.size)).  `independent`: the data
/// transfers are independent MPI-IO writes (dataset creation stays collective); each rank's
/// rows are one contiguous range, so this skips collective two-phase I/O's synchronisation.
void writeTensorGroup(hid_t file, MPI_Comm comm, const std::string& group,
                      const std::vector<model::TensorInfo>& tensors, const float* values,
                      bool independent = false);
/// \brief writeTensorGroup of `rows` (model::heldRows): every rank passes the same tensors, in
/// the same order (dataset creation is collective), and writes its rows of each from `values`.
void writeTensorRows(hid_t file, const std::string& group,
                     const std::vector<model::TensorRows>& rows, const float* values,
                     bool independent = false);
/// \brief Collective over `comm`: every rank reads every tensor of `group` whole into the flat
/// buffer `values`. Throws plm::Error if a tensor is missing, has another shape, or the group
/// holds a tensor not in `tensors`. `path` is only used in messages.
void readTensorGroup(hid_t file, MPI_Comm comm, const std::string& group,
                     const std::vector<model::TensorInfo>& tensors, float* values,
                     const std::string& path);

/// \brief Collective over `comm`: creates `path` and writes config attributes, `extra` and
/// /model from the flat fp32 buffer `values` (host memory, laid out as `tensors`).
void writeModelFile(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                    const std::vector<model::TensorInfo>& tensors, const float* values,
                    const ModelAttributes& extra = {});
/// \brief The same with each rank's rows given (model::heldRows: ranks holding part of the
/// experts write the whole model together).
void writeModelFile(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                    const std::vector<model::TensorRows>& rows, const float* values,
                    const ModelAttributes& extra = {});

/// \brief Reads the model config of a plm model file or checkpoint (any rank alone, no
/// collective); a clear plm::Error if the file is missing or not a plm model file.
model::Esm2Config readModelConfig(const std::string& path);

/// \brief Collective over `comm`: reads /model of `path` into the flat fp32 buffer `values`,
/// after checking that the file's config has the same shape as `config` (layers, hidden,
/// heads, ffn, vocab; heads does not show in any tensor shape).
void readModelValues(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                     const std::vector<model::TensorInfo>& tensors, float* values);

/// \brief Collective: writes `model`'s parameters (any scalar T, stored as fp32) to `path`.
template <class Model> void writeModelFile(const std::string& path, MPI_Comm comm, Model& model,
                                           const ModelAttributes& extra = {}) {
  auto device = model.parameters();
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), device);
  std::vector<float> values(host.extent(0));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(host(i));
  writeModelFile(
      path, comm, model.config(),
      model::heldRows(model.tensors(), model.expertPlacement(), model.config().moe.experts,
                      dist::commRank(comm), dist::commSize(comm)),
      values.data(), extra);
}

/// \brief Collective: loads /model of `path` into `model`'s parameters (checked by name and
/// shape against model.tensors()).
template <class Model> void readModelInto(const std::string& path, MPI_Comm comm, Model& model) {
  auto device = model.parameters();
  std::vector<float> values(device.extent(0));
  readModelValues(path, comm, model.config(), model.tensors(), values.data());
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), device);
  for (std::size_t i = 0; i < values.size(); ++i) host(i) = values[i];
  Kokkos::deep_copy(device, host);
}

}  // namespace plm::model
