// Listing an HDF5 group (io/hdf5.hpp's helpers, kept in a header of its own so that the
// many files including hdf5.hpp do not depend on it).
#pragma once

#include <hdf5.h>

#include <string>
#include <vector>

namespace plm::io::h5 {

/// \brief The names of a group's members, in name order.
std::vector<std::string> groupMembers(hid_t group);

}  // namespace plm::io::h5
