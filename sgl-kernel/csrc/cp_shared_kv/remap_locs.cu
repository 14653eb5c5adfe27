// remap_locs: token locations of each request -> locations in its dense view, through the per-request inverse.
// Used per batch (current locs, [N]) and per layer (top-k locs, [N, K] with one request id per row).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kRemapThreads = 256;
// Elements per thread: all loads of locs and request ids are issued before the inverse lookups.
constexpr int kRemapUnroll = 4;
constexpr int64_t kRemapElemsPerBlock = kRemapThreads * kRemapUnroll;

/// One thread per kRemapUnroll elements of the flat [N, K] index (consecutive threads, consecutive columns).
/// The request id is read per row (req_id[n], compact) and the row stride K turns the flat index into (n, k).
/// \tparam FlatT uint32_t when N * K fits, else uint64_t.
template <typename LocT, typename FlatT>
__global__ void __launch_bounds__(kRemapThreads)
    remap_locs_kernel(const LocT* __restrict__ locs,        // [N, K], row stride locs_row_stride
                      int64_t locs_row_stride,              // elements between rows of locs
                      const int64_t* __restrict__ req_id,   // [N]
                      const int32_t* __restrict__ inverse,  // [R * C]
                      FlatT total,                          // N * K
                      FlatT row_len,                        // K
                      int64_t batch_rows,                   // R
                      int64_t capacity,                     // C
                      int64_t page_size,                    // tokens per page
                      int page_shift,                       // log2(page_size) when a power of two, else -1
                      int32_t* __restrict__ dense_locs,     // [N, K] contiguous
                      int32_t* __restrict__ errors) {       // [kNumErrorKinds]
  const FlatT first = static_cast<FlatT>(blockIdx.x) * static_cast<FlatT>(kRemapElemsPerBlock) + threadIdx.x;
  int64_t loc[kRemapUnroll];
  int64_t req[kRemapUnroll];
#pragma unroll
  for (int k = 0; k < kRemapUnroll; ++k) {
    const FlatT flat = first + static_cast<FlatT>(k) * kRemapThreads;
    loc[k] = -1;
    req[k] = -1;
    if (flat < total) {
      const FlatT row = flat / row_len;
      const FlatT col = flat - row * row_len;
      loc[k] = static_cast<int64_t>(locs[static_cast<int64_t>(row) * locs_row_stride + static_cast<int64_t>(col)]);
      req[k] = req_id[row];
    }
  }
#pragma unroll
  for (int k = 0; k < kRemapUnroll; ++k) {
    const FlatT flat = first + static_cast<FlatT>(k) * kRemapThreads;
    if (flat >= total) continue;
    int32_t dense = -1;
    // A negative location or a padding row (-1) is padding: -1, nothing counted.
    if (loc[k] >= 0 && req[k] != -1) {
      if (req[k] < -1 || req[k] >= batch_rows) {
        detail::count_error(errors, kErrReqOutOfRange);
      } else {
        const int64_t page = page_shift >= 0 ? loc[k] >> page_shift : loc[k] / page_size;
        const int64_t offset = loc[k] - page * page_size;
        if (page >= capacity) {
          detail::count_error(errors, kErrPageOutOfRange);
        } else {
          const int32_t slot = inverse[req[k] * capacity + page];
          // Truncation to int32 as the reference's .to(torch.int32).
          if (slot >= 0) dense = static_cast<int32_t>(static_cast<int64_t>(slot) * page_size + offset);
        }
      }
    }
    dense_locs[flat] = dense;
  }
}

}  // namespace

template <typename LocT>
cudaError_t remap_locs(const LocT* locs,
                       int64_t num_rows,
                       int64_t row_len,
                       int64_t locs_row_stride,
                       const int64_t* req_id,
                       const int32_t* inverse,
                       int64_t batch_rows,
                       int64_t capacity,
                       int64_t page_size,
                       int32_t* dense_locs,
                       int32_t* errors,
                       cudaStream_t stream) {
  const int64_t total = num_rows * row_len;
  if (total == 0) return cudaSuccess;
  int page_shift = -1;
  if ((page_size & (page_size - 1)) == 0) {
    page_shift = 0;
    while ((int64_t{1} << page_shift) < page_size) ++page_shift;
  }
  const dim3 grid(static_cast<unsigned>((total + kRemapElemsPerBlock - 1) / kRemapElemsPerBlock));
  // The last block's flat indices reach past total by less than one block.
  if (total + kRemapElemsPerBlock <= static_cast<int64_t>(UINT32_MAX)) {
    remap_locs_kernel<LocT, uint32_t><<<grid, kRemapThreads, 0, stream>>>(locs,
                                                                          locs_row_stride,
                                                                          req_id,
                                                                          inverse,
                                                                          static_cast<uint32_t>(total),
                                                                          static_cast<uint32_t>(row_len),
                                                                          batch_rows,
                                                                          capacity,
                                                                          page_size,
                                                                          page_shift,
                                                                          dense_locs,
                                                                          errors);
  } else {
    remap_locs_kernel<LocT, uint64_t><<<grid, kRemapThreads, 0, stream>>>(locs,
                                                                          locs_row_stride,
                                                                          req_id,
                                                                          inverse,
                                                                          static_cast<uint64_t>(total),
                                                                          static_cast<uint64_t>(row_len),
                                                                          batch_rows,
                                                                          capacity,
                                                                          page_size,
                                                                          page_shift,
                                                                          dense_locs,
                                                                          errors);
  }
  return cudaGetLastError();
}

template cudaError_t remap_locs<int32_t>(const int32_t*,
                                         int64_t,
                                         int64_t,
                                         int64_t,
                                         const int64_t*,
                                         const int32_t*,
                                         int64_t,
                                         int64_t,
                                         int64_t,
                                         int32_t*,
                                         int32_t*,
                                         cudaStream_t);
template cudaError_t remap_locs<int64_t>(const int64_t*,
                                         int64_t,
                                         int64_t,
                                         int64_t,
                                         const int64_t*,
                                         const int32_t*,
                                         int64_t,
                                         int64_t,
                                         int64_t,
                                         int32_t*,
                                         int32_t*,
                                         cudaStream_t);

}  // namespace sglang_cpkv
