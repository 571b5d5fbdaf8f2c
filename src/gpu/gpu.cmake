# Every module's CUDA sources (src/gpu/*.cu and dist's NCCL backend), included from
# src/CMakeLists.txt after plm_module(gpu).
# With a CUDA Kokkos the .cu files join their module (plm_gpu, plm_dist) and compile like every
# other source, through mpicxx -> nvcc_wrapper (same flags, same nvcc).  Without one, PLM_CHECK_CUDA_SOURCES compiles
# them with nvcc into an object library that nothing links, so CI notices GPU code that no
# longer compiles.  The .cu files include no Kokkos header, which is what makes that possible.
file(GLOB_RECURSE plm_cuda_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*/*.cu)
list(FILTER plm_cuda_sources EXCLUDE REGEX "_sm90a\\.cu$")
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

# cuDNN's fused attention is compiled in only where cuDNN and its frontend headers were found
# (cmake/PlmDependencies.cmake); otherwise cudnn_attention.cu reports itself unavailable.
set(plm_cudnn_source ${CMAKE_CURRENT_SOURCE_DIR}/gpu/cudnn_attention.cu)
if(PLM_HAVE_CUDNN AND (PLM_HAVE_CUDA OR PLM_CHECK_CUDA_SOURCES))
  set_property(SOURCE ${plm_cudnn_source} APPEND PROPERTY COMPILE_DEFINITIONS PLM_HAVE_CUDNN=1)
  set(plm_cudnn_target plm_cuda_check)
  if(PLM_HAVE_CUDA)
    set(plm_cudnn_target plm_gpu)
  endif()
  target_include_directories(${plm_cudnn_target} SYSTEM PRIVATE
    ${PLM_CUDNN_FRONTEND_INCLUDE_DIR} ${PLM_CUDNN_INCLUDE_DIR})
  if(PLM_HAVE_CUDA)
    # The frontend's headers also hold run-time compiled (NVRTC) engines for other GPUs.
    target_link_libraries(plm_gpu PUBLIC ${PLM_CUDNN_LIBRARY} CUDA::nvrtc)
  endif()
endif()

# CUTLASS's SM90 grouped GEMM (gpu/moe_grouped_sm90a.cu) and stream-K weight-gradient GEMM
# (gpu/gemm_streamk_sm90a.cu) need the sm_90a architecture, which only their own translation
# units get: they are compiled as CUDA by nvcc directly (Kokkos' nvcc_wrapper passes one -arch to
# every file), into an object library that plm_gpu takes in.  Without the CUTLASS headers
# gpu/moe_grouped.cu and gpu/gemm.cu answer "not built": the loop and cuBLASLt run.
if(PLM_HAVE_CUTLASS AND (PLM_HAVE_CUDA OR PLM_CHECK_CUDA_SOURCES))
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  add_library(plm_gpu_grouped OBJECT ${CMAKE_CURRENT_SOURCE_DIR}/gpu/moe_grouped_sm90a.cu
    ${CMAKE_CURRENT_SOURCE_DIR}/gpu/gemm_streamk_sm90a.cu)
  set_target_properties(plm_gpu_grouped PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON POSITION_INDEPENDENT_CODE ON)
  target_compile_options(plm_gpu_grouped PRIVATE --generate-code=arch=compute_90a,code=sm_90a
    --expt-relaxed-constexpr -DNDEBUG -O3)
  target_include_directories(plm_gpu_grouped PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/generated)
  target_include_directories(plm_gpu_grouped SYSTEM PRIVATE ${PLM_CUTLASS_INCLUDE_DIR})
  if(PLM_HAVE_CUDA)
    target_sources(plm_gpu PRIVATE $<TARGET_OBJECTS:plm_gpu_grouped>)
    target_compile_definitions(plm_gpu PRIVATE PLM_HAVE_CUTLASS=1)
  else()
    target_compile_definitions(plm_cuda_check PRIVATE PLM_HAVE_CUTLASS=1)
  endif()
endif()
