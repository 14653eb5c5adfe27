// build_page_inverse: per batch, the page of every dense slot -> per-request inverse (int32 [R * C]).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;

/// One thread per dense slot s: claim inverse[slot_req[s] * C + slot_pages[s]] with a compare-and-swap from -1
/// (the launcher has filled the inverse with -1 first, on the same stream). A slot that finds its entry taken holds
/// a page its request holds twice: it is counted, and the first claim stands.
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    build_page_inverse_kernel(const PageIdT* __restrict__ slot_pages,  // [S]
                              const int64_t* __restrict__ slot_req,    // [S]
                              int64_t num_slots,                       // S
                              int64_t num_requests,                    // R
                              int64_t capacity,                        // C
                              int32_t* __restrict__ inverse,           // [R * C], all -1
                              int32_t* __restrict__ errors) {          // [kNumErrorKinds]
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (s >= num_slots) return;
  const int64_t page = static_cast<int64_t>(slot_pages[s]);
  const int64_t req = slot_req[s];
  if (page == -1 || req == -1) return;  // a slot of the layout's rounding
  if (page >= capacity || page < -1) {
    detail::count_error(errors, kErrPageOutOfRange);
    return;
  }
  if (req >= num_requests || req < -1) {
    detail::count_error(errors, kErrReqOutOfRange);
    return;
  }
  if (atomicCAS(inverse + req * capacity + page, -1, static_cast<int32_t>(s)) != -1) {
    detail::count_error(errors, kErrPageOutOfRange);
  }
}

}  // namespace

template <typename PageIdT>
cudaError_t build_page_inverse(const PageIdT* slot_pages,
                               const int64_t* slot_req,
                               int64_t num_slots,
                               int64_t num_requests,
                               int64_t capacity,
                               int32_t* inverse,
                               int32_t* errors,
                               cudaStream_t stream) {
  const int64_t entries = num_requests * capacity;
  if (entries == 0) return cudaSuccess;
  // 0xFF bytes are int32 -1: every entry absent until a slot claims it.
  cudaError_t status = cudaMemsetAsync(inverse, 0xFF, static_cast<size_t>(entries) * sizeof(int32_t), stream);
  if (status != cudaSuccess || num_slots == 0) return status;
  const unsigned blocks = static_cast<unsigned>((num_slots + kInverseThreads - 1) / kInverseThreads);
  build_page_inverse_kernel<PageIdT><<<blocks, kInverseThreads, 0, stream>>>(
      slot_pages, slot_req, num_slots, num_requests, capacity, inverse, errors);
  return cudaGetLastError();
}

template cudaError_t build_page_inverse<int32_t>(
    const int32_t*, const int64_t*, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);
template cudaError_t build_page_inverse<int64_t>(
    const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);

}  // namespace sglang_cpkv
