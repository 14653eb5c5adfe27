// build_page_inverse: per batch, page table -> per-request inverse (int32 [R * C]).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;
// Inverse entries one block owns: 2048 x 4 B = 8 KiB of -1 per block, so a batch of 8 requests over a
// 40K-page pool spreads over 160 blocks (more than one per SM); each block rescans its request's page table
// row (P ids, from L2) to find the pages of its range.
constexpr int64_t kInverseChunk = 2048;

/// One block per (chunk of C, request): fill inverse[r * C + lo, r * C + hi) with -1, then, after a block
/// barrier, write r * P + j at every page id of row r in [lo, hi). The block that owns an entry is the only one
/// that writes it, so fill and scatter need no second launch. Blocks of chunk 0 count bad page ids.
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    build_page_inverse_kernel(const PageIdT* __restrict__ page_table,  // [R, P]
                              int64_t pages_per_request,               // P
                              int64_t row_stride,                      // elements between rows of page_table
                              int64_t capacity,                        // C
                              int32_t* __restrict__ inverse,           // [R * C]
                              int32_t* __restrict__ errors) {          // [kNumErrorKinds]
  const int64_t r = blockIdx.y;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kInverseChunk;
  const int64_t hi = min(lo + kInverseChunk, capacity);
  int32_t* request_inverse = inverse + r * capacity;
  for (int64_t p = lo + threadIdx.x; p < hi; p += kInverseThreads) request_inverse[p] = -1;
  __syncthreads();
  const PageIdT* row = page_table + r * row_stride;
  for (int64_t j = threadIdx.x; j < pages_per_request; j += kInverseThreads) {
    const int64_t page = static_cast<int64_t>(row[j]);
    if (page >= lo && page < hi) {
      request_inverse[page] = static_cast<int32_t>(r * pages_per_request + j);
    } else if (blockIdx.x == 0 && (page >= capacity || page < -1)) {
      detail::count_error(errors, kErrPageOutOfRange);
    }
  }
}

}  // namespace

template <typename PageIdT>
cudaError_t build_page_inverse(const PageIdT* page_table,
                               int64_t rows,
                               int64_t pages_per_request,
                               int64_t page_table_row_stride,
                               int64_t capacity,
                               int32_t* inverse,
                               int32_t* errors,
                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  // At least one chunk per request so that bad ids are counted even when C == 0.
  const int64_t chunks = capacity > 0 ? (capacity + kInverseChunk - 1) / kInverseChunk : 1;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
  build_page_inverse_kernel<PageIdT><<<grid, kInverseThreads, 0, stream>>>(
      page_table, pages_per_request, page_table_row_stride, capacity, inverse, errors);
  return cudaGetLastError();
}

template cudaError_t build_page_inverse<int32_t>(
    const int32_t*, int64_t, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);
template cudaError_t build_page_inverse<int64_t>(
    const int64_t*, int64_t, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);

}  // namespace sglang_cpkv
