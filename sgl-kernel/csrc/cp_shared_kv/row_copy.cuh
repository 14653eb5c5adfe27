// Device helpers shared by the CP shared-KV kernels: the indexed row copy behind copy_pages, scatter_rows and
// materialize_and_fill, the error count, and the programmatic-dependent-launch hooks. No torch here.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace sglang_cpkv {
namespace detail {

// Threads per block and vectors per thread of the row copy: 256 x 4 x 16 B = 16 KiB per block, all loads of a
// thread issued before its first store (enough bytes in flight to cover HBM latency at full occupancy).
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;
constexpr int64_t kCopyVecsPerBlock = kCopyThreads * kCopyUnroll;

/// \brief Adds one per calling thread to errors[kind] with one atomic per coalesced group of a warp.
/// Every thread of the group must pass the same kind (call it from a branch taken for that kind only).
__device__ __forceinline__ void count_error(int32_t* errors, int kind) {
  namespace cg = cooperative_groups;
  cg::coalesced_group active = cg::coalesced_threads();
  if (active.thread_rank() == 0) atomicAdd(errors + kind, static_cast<int32_t>(active.size()));
}

/// \brief Lets the grid launched after this one as a programmatic dependent start now (sm_90+; else no-op).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// \brief Waits until the grids this one depends on have completed and their writes are visible (sm_90+;
/// returns at once when launched without a programmatic dependency).
__device__ __forceinline__ void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// \brief dst row dst_idx[i] = src row (kGatherSrc ? src_idx[i] : i), for i in [0, num_rows).
///
/// Rows are num_vecs_per_row vectors of VecT; the flat vector index runs over (i, column) so that consecutive
/// threads touch consecutive bytes of a row. A pair with a negative id is skipped; an id >= its row count or
/// < -1 is counted once in errors[err_kind] (by the thread holding column 0) and skipped.
/// \tparam VecT        uint4 / uint2 / uint32_t / uint16_t / uint8_t: the widest access sizes and strides allow.
/// \tparam SrcIdxT     index type of src_idx (unused without kGatherSrc).
/// \tparam DstIdxT     index type of dst_idx.
/// \tparam FlatT       uint32_t when num_rows * num_vecs_per_row fits, else uint64_t.
/// \tparam kGatherSrc  src rows through src_idx (copy_pages) or in order (scatter_rows).
/// \tparam kLaunchDependents  let a programmatic dependent grid start at once (first kernel of a fused pair).
/// \tparam kWaitPrior  wait for the prior grid before the first store (second kernel of a fused pair).
template <typename VecT,
          typename SrcIdxT,
          typename DstIdxT,
          typename FlatT,
          bool kGatherSrc,
          bool kLaunchDependents,
          bool kWaitPrior>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(const char* __restrict__ src,         // [src_rows, row bytes], row at src + r * src_stride
                     int64_t src_rows,                     // rows of src
                     int64_t src_stride,                   // bytes between rows of src
                     const SrcIdxT* __restrict__ src_idx,  // [num_rows] (kGatherSrc only)
                     char* __restrict__ dst,               // [dst_rows, row bytes]
                     int64_t dst_rows,                     // rows of dst
                     int64_t dst_stride,                   // bytes between rows of dst
                     const DstIdxT* __restrict__ dst_idx,  // [num_rows]
                     FlatT num_rows,                       // rows to copy
                     FlatT num_vecs_per_row,               // row bytes / sizeof(VecT)
                     int32_t* __restrict__ errors,         // [kNumErrorKinds]
                     int err_kind) {                       // counter index of a bad id
  if constexpr (kLaunchDependents) allow_dependent_launch();
  const FlatT total = num_rows * num_vecs_per_row;
  const FlatT first = static_cast<FlatT>(blockIdx.x) * static_cast<FlatT>(kCopyVecsPerBlock) + threadIdx.x;
  VecT vec[kCopyUnroll];
  char* target[kCopyUnroll];
#pragma unroll
  for (int k = 0; k < kCopyUnroll; ++k) {
    const FlatT flat = first + static_cast<FlatT>(k) * kCopyThreads;
    target[k] = nullptr;
    if (flat >= total) continue;
    const FlatT row = flat / num_vecs_per_row;
    const FlatT col = flat - row * num_vecs_per_row;
    const int64_t s = kGatherSrc ? static_cast<int64_t>(src_idx[row]) : static_cast<int64_t>(row);
    const int64_t d = static_cast<int64_t>(dst_idx[row]);
    const bool bad = s >= src_rows || s < -1 || d >= dst_rows || d < -1;
    if (bad) {
      if (col == 0) count_error(errors, err_kind);
      continue;
    }
    if (s < 0 || d < 0) continue;
    vec[k] = *reinterpret_cast<const VecT*>(src + s * src_stride + static_cast<int64_t>(col) * sizeof(VecT));
    target[k] = dst + d * dst_stride + static_cast<int64_t>(col) * sizeof(VecT);
  }
  if constexpr (kWaitPrior) wait_prior_grids();
#pragma unroll
  for (int k = 0; k < kCopyUnroll; ++k) {
    if (target[k] != nullptr) *reinterpret_cast<VecT*>(target[k]) = vec[k];
  }
}

/// \brief Widest access (16, 8, 4, 2 or 1 bytes) that divides every size, stride and address given.
inline int widest_access(std::initializer_list<uint64_t> values) {
  int width = 16;
  for (uint64_t v : values) {
    while (v % width != 0) width >>= 1;
  }
  return width;
}

/// \brief One indexed row copy's operands: dst row dst_idx[i] = src row (src_idx[i], or i in order), i in [0, num_rows).
template <typename SrcIdxT, typename DstIdxT>
struct RowCopy {
  const void* src;         // [src_rows, row_bytes] bytes, row r at src + r * src_stride
  int64_t src_rows;        // rows of src
  int64_t src_stride;      // bytes between rows of src (>= row_bytes)
  const SrcIdxT* src_idx;  // [num_rows] rows of src (read with kGatherSrc only)
  void* dst;               // [dst_rows, row_bytes] bytes
  int64_t dst_rows;        // rows of dst
  int64_t dst_stride;      // bytes between rows of dst (>= row_bytes)
  const DstIdxT* dst_idx;  // [num_rows] rows of dst
  int64_t num_rows;        // rows to copy
  int64_t row_bytes;       // bytes of one row
  int32_t* errors;         // [kNumErrorKinds]
  int err_kind;            // counter index of a bad id
};

/// \brief The indexed row copy at the widest access the sizes, strides and addresses allow, with the smallest flat
/// index type that fits.
template <bool kGatherSrc, bool kLaunchDependents = false, bool kWaitPrior = false, typename SrcIdxT, typename DstIdxT>
cudaError_t launch_copy_rows(const RowCopy<SrcIdxT, DstIdxT>& copy, bool programmatic_dependent, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kCopyThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic_dependent ? 1 : 0;
  const auto launch_vec = [&](auto vec) {
    using VecT = decltype(vec);
    const int64_t vecs_per_row = copy.row_bytes / static_cast<int64_t>(sizeof(VecT));
    const int64_t total = copy.num_rows * vecs_per_row;
    if (total == 0) return cudaSuccess;
    config.gridDim = dim3(static_cast<unsigned>((total + kCopyVecsPerBlock - 1) / kCopyVecsPerBlock));
    const auto launch = [&](auto flat_index) {
      using FlatT = decltype(flat_index);
      return cudaLaunchKernelEx(&config,
                                copy_rows_kernel<VecT, SrcIdxT, DstIdxT, FlatT, kGatherSrc, kLaunchDependents, kWaitPrior>,
                                static_cast<const char*>(copy.src),
                                copy.src_rows,
                                copy.src_stride,
                                copy.src_idx,
                                static_cast<char*>(copy.dst),
                                copy.dst_rows,
                                copy.dst_stride,
                                copy.dst_idx,
                                static_cast<FlatT>(copy.num_rows),
                                static_cast<FlatT>(vecs_per_row),
                                copy.errors,
                                copy.err_kind);
    };
    // The last block's flat indices reach past total by less than one block.
    if (total + kCopyVecsPerBlock <= static_cast<int64_t>(UINT32_MAX)) return launch(uint32_t{});
    return launch(uint64_t{});
  };
  switch (widest_access({static_cast<uint64_t>(copy.row_bytes),
                         static_cast<uint64_t>(copy.src_stride),
                         static_cast<uint64_t>(copy.dst_stride),
                         reinterpret_cast<uint64_t>(copy.src),
                         reinterpret_cast<uint64_t>(copy.dst)})) {
    case 16:
      return launch_vec(uint4{});
    case 8:
      return launch_vec(uint2{});
    case 4:
      return launch_vec(uint32_t{});
    case 2:
      return launch_vec(uint16_t{});
    default:
      return launch_vec(uint8_t{});
  }
}

}  // namespace detail
}  // namespace sglang_cpkv
