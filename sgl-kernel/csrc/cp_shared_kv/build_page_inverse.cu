// build_page_inverse: per batch, every (request, page) entry's dense slot -> per-request inverse (int32 [R * C]).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;

/// One thread per entry e: claim inverse[entry_req[e] * C + entry_pages[e]] for entry_slots[e] with a
/// compare-and-swap from -1 (the launcher has filled the inverse with -1 first, on the same stream). An entry that
/// finds its key taken holds a page its request holds twice: it is counted, and the first claim stands.
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    build_page_inverse_kernel(const PageIdT* __restrict__ entry_pages,  // [E]
                              const int64_t* __restrict__ entry_req,    // [E]
                              const int32_t* __restrict__ entry_slots,  // [E], nullptr: entry e at slot e
                              int64_t num_entries,                      // E
                              int64_t num_requests,                     // R
                              int64_t capacity,                         // C
                              int32_t* __restrict__ inverse,            // [R * C], all -1
                              int32_t* __restrict__ errors) {           // [kNumErrorKinds]
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (e >= num_entries) return;
  const int64_t page = static_cast<int64_t>(entry_pages[e]);
  const int64_t req = entry_req[e];
  const int32_t slot = entry_slots != nullptr ? entry_slots[e] : static_cast<int32_t>(e);
  if (page == -1 || req == -1) return;  // an entry of the layout's rounding
  if (page >= capacity || page < -1 || slot < 0) {
    detail::count_error(errors, kErrPageOutOfRange);
    return;
  }
  if (req >= num_requests || req < -1) {
    detail::count_error(errors, kErrReqOutOfRange);
    return;
  }
  if (atomicCAS(inverse + req * capacity + page, -1, slot) != -1) {
    detail::count_error(errors, kErrPageOutOfRange);
  }
}

}  // namespace

template <typename PageIdT>
cudaError_t build_page_inverse(const PageIdT* entry_pages,
                               const int64_t* entry_req,
                               const int32_t* entry_slots,
                               int64_t num_entries,
                               int64_t num_requests,
                               int64_t capacity,
                               int32_t* inverse,
                               int32_t* errors,
                               cudaStream_t stream) {
  const int64_t entries = num_requests * capacity;
  if (entries == 0) return cudaSuccess;
  // 0xFF bytes are int32 -1: every key absent until an entry claims it.
  cudaError_t status = cudaMemsetAsync(inverse, 0xFF, static_cast<size_t>(entries) * sizeof(int32_t), stream);
  if (status != cudaSuccess || num_entries == 0) return status;
  const unsigned blocks = static_cast<unsigned>((num_entries + kInverseThreads - 1) / kInverseThreads);
  build_page_inverse_kernel<PageIdT><<<blocks, kInverseThreads, 0, stream>>>(
      entry_pages, entry_req, entry_slots, num_entries, num_requests, capacity, inverse, errors);
  return cudaGetLastError();
}

template cudaError_t build_page_inverse<int32_t>(
    const int32_t*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);
template cudaError_t build_page_inverse<int64_t>(
    const int64_t*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);

}  // namespace sglang_cpkv
