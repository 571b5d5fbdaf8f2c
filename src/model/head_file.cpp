#include "model/head_file.hpp"

#include "core/error.hpp"
#include "io/hdf5.hpp"
#include "io/hdf5_group.hpp"
#include "model/model_file.hpp"

namespace plm::model {

namespace h5 = io::h5;

bool hasHead(const std::string& path, MPI_Comm comm) {
  h5::Hid file = h5::openFile(path, comm);
  return h5::exists(file, "head");
}

HeadData readHead(const std::string& path, MPI_Comm comm) {
  h5::Hid file = h5::openFile(path, comm);
  if (!h5::exists(file, "head"))
    throw Error("`" + path +
                "` holds no task head (/head group); give the head.h5 that plm train wrote for "
                "a task, or a model file converted from a classification folder");
  HeadData head;
  head.task_kind = h5::readStringAttribute(file, "task_kind");
  head.pooling = h5::readStringAttribute(file, "pooling");
  head.num_labels = h5::readIntAttribute(file, "num_labels");
  h5::Hid group(PLM_CHECK_H5(H5Gopen2(file, "head", H5P_DEFAULT)));
  for (const auto& name : h5::groupMembers(group)) {
    h5::Hid dataset = h5::openDataset(group, name);
    auto shape = h5::datasetShape(dataset);
    std::int64_t numel = 1;
    for (auto d : shape) numel *= d;
    std::vector<float> data(static_cast<std::size_t>(numel));
    h5::readRows<float>(dataset, 0, shape.empty() ? 1 : shape[0], data.data());
    head.names.push_back(name);
    head.shapes.push_back(std::move(shape));
    head.values.push_back(std::move(data));
  }
  return head;
}

void writeHead(hid_t file, MPI_Comm comm, const HeadData& head) {
  h5::writeAttribute(file, "task_kind", head.task_kind);
  h5::writeAttribute(file, "num_labels", head.num_labels);
  h5::writeAttribute(file, "pooling", head.pooling);
  std::vector<model::TensorInfo> table;
  std::vector<float> flat;
  for (std::size_t i = 0; i < head.names.size(); ++i) {
    model::TensorInfo info;
    info.name = head.names[i];
    info.shape = head.shapes[i];
    info.offset = std::int64_t(flat.size());
    info.size = std::int64_t(head.values[i].size());
    flat.insert(flat.end(), head.values[i].begin(), head.values[i].end());
    table.push_back(info);
  }
  writeTensorGroup(file, comm, "head", table, flat.data());
}

}  // namespace plm::model
