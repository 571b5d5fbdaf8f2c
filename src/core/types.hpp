// Precision roles and the Kokkos spaces plm runs on.
//
// Every tensor in plm has a role, and each role names its scalar type here, once.  On the CPU
// every role is fp32; the GPU build narrows parameters-for-compute and activations to bf16
// while master weights, optimizer moments and accumulators stay fp32 (doc/anchors.md §3).
// Model code is templated on the scalar so the same source also runs in double for the
// finite-difference gradient checks.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace plm {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using MemSpace = ExecSpace::memory_space;
using HostSpace = Kokkos::HostSpace;
using HostExec = Kokkos::DefaultHostExecutionSpace;

// Element ranges over buffers.  Kokkos' default RangePolicy index is the execution space's
// size_type, `unsigned int` on CUDA: RangePolicy<ExecSpace>(space, lo, hi) wraps lo and hi at
// 2^32 without a word, and a 15B model's buffer holds 1.5e10 elements (issue 28).  Every range
// over buffer elements or buffer offsets uses this 64-bit policy; its lambdas take std::int64_t
// (plain RangePolicy stays only for short ranges such as sequences with int lambdas).
using FlatPolicy = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;

// Precision roles (CPU build: all fp32).
using param_t = float;   // parameters as the model computes with them
using act_t = float;     // activations
using grad_t = float;    // parameter and activation gradients
using master_t = float;  // master weights and optimizer moments
using accum_t = double;  // long reductions: loss sums, norms

using token_t = std::uint8_t;   // ESM-2 token ids (vocabulary of 33)
using index_t = std::int64_t;   // offsets into token streams
using seqlen_t = std::int32_t;  // cu_seqlens entries (flash-attention convention)

template <class T> using View1 = Kokkos::View<T*, Kokkos::LayoutRight, MemSpace>;
template <class T> using View2 = Kokkos::View<T**, Kokkos::LayoutRight, MemSpace>;
template <class T> using View3 = Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>;
template <class T> using HostView1 = Kokkos::View<T*, Kokkos::LayoutRight, HostSpace>;
template <class T> using HostView2 = Kokkos::View<T**, Kokkos::LayoutRight, HostSpace>;

}  // namespace plm
