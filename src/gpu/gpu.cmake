# Every module's CUDA sources (src/gpu/*.cu and dist's NCCL backend), included from
# src/CMakeLists.txt after plm_module(gpu).
# With a CUDA Kokkos the .cu files join their module (plm_gpu, plm_dist) and compile like every
# other source, through mpicxx -> nvcc_wrapper (same flags, same nvcc).  Without one, PLM_CHECK_CUDA_SOURCES compiles
# them with nvcc into an object library that nothing links, so CI notices GPU code that no
# longer compiles.  The .cu files include no Kokkos header, which is what makes that possible.
file(GLOB_RECURSE plm_cuda_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*/*.cu)
if(PLM_HAVE_CUDA)
  set_source_files_properties(${plm_cuda_sources} PROPERTIES LANGUAGE CXX)
elseif(PLM_CHECK_CUDA_SOURCES AND plm_cuda_sources)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  add_library(plm_cuda_check OBJECT ${plm_cuda_sources})
  target_include_directories(plm_cuda_check PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/generated)
  # dist's NCCL backend is bootstrapped over MPI.
  target_include_directories(plm_cuda_check SYSTEM PRIVATE ${MPI_CXX_INCLUDE_DIRS})
  set_target_properties(plm_cuda_check PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_compile_options(plm_cuda_check PRIVATE --expt-relaxed-constexpr -Xcompiler=-Wall)
endif()
