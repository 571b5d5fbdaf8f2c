# Finds every dependency plm builds on and says clearly what is missing.
# Debian bookworm's Trilinos 13.2 packages on the CPU; a CUDA build of the same source
# (doc/gpu-machines.md, scripts/build-deps-cuda.sh) on GPU machines, via CMAKE_PREFIX_PATH.

find_package(MPI REQUIRED COMPONENTS C CXX)

find_package(Kokkos REQUIRED)
find_package(KokkosKernels REQUIRED)
find_package(Teuchos REQUIRED)

# Trilinos' TriBITS-installed configs export library names and include dirs rather than
# complete imported targets; gather them into one interface target.
add_library(plm_trilinos INTERFACE)
target_include_directories(plm_trilinos SYSTEM INTERFACE
  ${Kokkos_INCLUDE_DIRS} ${KokkosKernels_INCLUDE_DIRS} ${Teuchos_INCLUDE_DIRS}
  ${Kokkos_TPL_INCLUDE_DIRS} ${KokkosKernels_TPL_INCLUDE_DIRS})
target_link_directories(plm_trilinos INTERFACE ${Kokkos_LIBRARY_DIRS} ${Teuchos_LIBRARY_DIRS})
target_link_libraries(plm_trilinos INTERFACE
  ${Teuchos_LIBRARIES} ${KokkosKernels_LIBRARIES} ${Kokkos_LIBRARIES}
  ${KokkosKernels_TPL_LIBRARIES} ${Kokkos_TPL_LIBRARIES} ${Teuchos_TPL_LIBRARIES})

# Kokkos' own compile options (with CUDA: -expt-extended-lambda -arch=sm_90 for nvcc_wrapper).
if(TARGET Kokkos::kokkos)
  get_target_property(_plm_kokkos_opts Kokkos::kokkos INTERFACE_COMPILE_OPTIONS)
  if(_plm_kokkos_opts)
    target_compile_options(plm_trilinos INTERFACE ${_plm_kokkos_opts})
  endif()
endif()

# Which Kokkos backends: read them from the installed KokkosCore_config.h.
find_file(PLM_KOKKOS_CONFIG_H KokkosCore_config.h PATHS ${Kokkos_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT PLM_KOKKOS_CONFIG_H)
  message(FATAL_ERROR "plm: found Kokkos at ${Kokkos_DIR} but not its KokkosCore_config.h in ${Kokkos_INCLUDE_DIRS}")
endif()
file(READ ${PLM_KOKKOS_CONFIG_H} _plm_kokkos_cfg)
set(PLM_HAVE_CUDA OFF)
if(_plm_kokkos_cfg MATCHES "#define KOKKOS_ENABLE_CUDA[ \n]")
  set(PLM_HAVE_CUDA ON)
endif()
message(STATUS "plm: Kokkos ${Kokkos_VERSION} at ${Kokkos_DIR}, CUDA backend: ${PLM_HAVE_CUDA}")

# A CUDA Kokkos is compiled through Kokkos' nvcc_wrapper, which the MPI wrapper calls only while
# OMPI_CXX names it.  That variable is read at every compile and link, not only at configure
# time, so remember the configure-time value and pass it to each compile and link.
if(PLM_HAVE_CUDA AND DEFINED ENV{OMPI_CXX})
  set(PLM_OMPI_CXX "$ENV{OMPI_CXX}" CACHE FILEPATH "OMPI_CXX for every compile and link (nvcc_wrapper)")
endif()
if(PLM_HAVE_CUDA AND PLM_OMPI_CXX)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env OMPI_CXX=${PLM_OMPI_CXX})
  set(CMAKE_CXX_LINKER_LAUNCHER ${CMAKE_COMMAND} -E env OMPI_CXX=${PLM_OMPI_CXX})
endif()

# HDF5 must be the parallel build: checkpoints and datasets are written collectively.
set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR
    "plm: the HDF5 found (${HDF5_C_INCLUDE_DIRS}) is the serial build. plm writes datasets and "
    "checkpoints collectively and needs parallel HDF5. On Debian install libhdf5-openmpi-dev; "
    "elsewhere point HDF5_ROOT at an MPI-enabled HDF5.")
endif()

find_package(ZLIB REQUIRED)

if(PLM_HAVE_CUDA OR PLM_CHECK_CUDA_SOURCES)
  find_package(CUDAToolkit REQUIRED)
  find_library(PLM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  find_path(PLM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  if(NOT PLM_NCCL_LIBRARY OR NOT PLM_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "plm: CUDA is enabled but NCCL was not found; set PLM_NCCL_LIBRARY and PLM_NCCL_INCLUDE_DIR")
  endif()
  # cuDNN's fused attention (src/gpu/cudnn_attention.cu): the cuDNN 9 library of the CUDA
  # installation or the system, and the header-only cuDNN frontend from PyPI's
  # nvidia-cudnn-frontend wheel (scripts/get-cudnn-frontend.sh puts it in /opt/plm-deps).
  # Optional: without them the own flash attention is the only attention on the GPU.
  option(PLM_WITH_CUDNN "Use cuDNN's fused attention where cuDNN and its frontend are found" ON)
  find_library(PLM_CUDNN_LIBRARY NAMES cudnn libcudnn.so.9
    HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  find_path(PLM_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  find_path(PLM_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
    HINTS $ENV{PLM_CUDNN_FRONTEND} /opt/plm-deps/cudnn-frontend/include)
  set(PLM_HAVE_CUDNN OFF)
  if(PLM_WITH_CUDNN AND PLM_CUDNN_LIBRARY AND PLM_CUDNN_INCLUDE_DIR AND PLM_CUDNN_FRONTEND_INCLUDE_DIR)
    set(PLM_HAVE_CUDNN ON)
  endif()
  message(STATUS "plm: cuDNN attention: ${PLM_HAVE_CUDNN} (library ${PLM_CUDNN_LIBRARY}, "
    "frontend ${PLM_CUDNN_FRONTEND_INCLUDE_DIR}; scripts/get-cudnn-frontend.sh installs the frontend)")
  # CUTLASS's SM90 grouped GEMM for the MoE experts (src/gpu/moe_grouped_sm90a.cu): header-only,
  # from PyPI's nvidia-cutlass wheel (scripts/get-cutlass.sh puts it in /opt/plm-deps/cutlass).
  # Optional: without it the experts' GEMMs run as a loop of cuBLASLt calls.
  option(PLM_WITH_CUTLASS "Build the CUTLASS grouped expert GEMM where its headers are found" ON)
  find_path(PLM_CUTLASS_INCLUDE_DIR cutlass/gemm/group_array_problem_shape.hpp
    HINTS $ENV{PLM_CUTLASS}/include /opt/plm-deps/cutlass/include)
  set(PLM_HAVE_CUTLASS OFF)
  if(PLM_WITH_CUTLASS AND PLM_CUTLASS_INCLUDE_DIR)
    set(PLM_HAVE_CUTLASS ON)
  endif()
  message(STATUS "plm: CUTLASS grouped expert GEMM: ${PLM_HAVE_CUTLASS} (headers "
    "${PLM_CUTLASS_INCLUDE_DIR}; scripts/get-cutlass.sh installs them, else the loop of cuBLASLt "
    "calls is the only expert path)")
  # NVTX ranges (core/trace.hpp) for Nsight Systems: nvtx3 is header-only in the CUDA toolkit.
  find_path(PLM_NVTX_INCLUDE_DIR nvtx3/nvToolsExt.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  set(PLM_HAVE_NVTX OFF)
  if(PLM_HAVE_CUDA AND PLM_NVTX_INCLUDE_DIR)  # the CPU build never includes it
    set(PLM_HAVE_NVTX ON)
  endif()
  message(STATUS "plm: NVTX ranges: ${PLM_HAVE_NVTX} (${PLM_NVTX_INCLUDE_DIR})")
endif()

if(PLM_ENABLE_TESTS)
  find_package(GTest REQUIRED)
endif()

# Git revision, for `plm --version` and checkpoints.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}
  OUTPUT_VARIABLE PLM_GIT_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT PLM_GIT_REVISION)
  set(PLM_GIT_REVISION "unknown")
endif()
