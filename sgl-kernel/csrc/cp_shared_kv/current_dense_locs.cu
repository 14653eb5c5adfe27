// current_dense_locs: each current token's dense location from per-request values (the batch plan stages no
// per-token array), and the count of tokens whose out_cache_loc is not the location the dense layout gives them.
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kCurrentLocsThreads = 256;

template <typename LocT>
__global__ void __launch_bounds__(kCurrentLocsThreads)
    current_dense_locs_kernel(const int64_t* __restrict__ token_ends,     // [R], nondecreasing
                              const int64_t* __restrict__ dense_offsets,  // [R]
                              int64_t num_requests,                       // R
                              const LocT* __restrict__ out_cache_loc,     // [N]
                              int64_t num_tokens,                         // N
                              const int32_t* __restrict__ slot_pages,     // [S]
                              int64_t num_slots,                          // S
                              int64_t page_size,
                              int64_t* __restrict__ dense_locs,  // [N]
                              int32_t* __restrict__ errors) {    // [kNumErrorKinds]
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kCurrentLocsThreads + threadIdx.x;
  if (t >= num_tokens) return;
  // The token's request: the number of requests whose tokens end at or before it (upper bound in token_ends).
  int64_t lo = 0, hi = num_requests;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (token_ends[mid] <= t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int64_t dense = lo < num_requests ? dense_offsets[lo] + t : -1;
  dense_locs[t] = dense;
  const int64_t slot = dense >= 0 ? dense / page_size : -1;
  const int64_t page = slot >= 0 && slot < num_slots ? static_cast<int64_t>(slot_pages[slot]) : -1;
  const bool agrees = page >= 0 && page * page_size + (dense - slot * page_size) == static_cast<int64_t>(out_cache_loc[t]);
  if (!agrees) detail::count_error(errors, kErrCurrentLocMismatch);
}

}  // namespace

template <typename LocT>
cudaError_t current_dense_locs(const int64_t* token_ends,
                               const int64_t* dense_offsets,
                               int64_t num_requests,
                               const LocT* out_cache_loc,
                               int64_t num_tokens,
                               const int32_t* slot_pages,
                               int64_t num_slots,
                               int64_t page_size,
                               int64_t* dense_locs,
                               int32_t* errors,
                               cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((num_tokens + kCurrentLocsThreads - 1) / kCurrentLocsThreads));
  current_dense_locs_kernel<LocT><<<grid, kCurrentLocsThreads, 0, stream>>>(
      token_ends, dense_offsets, num_requests, out_cache_loc, num_tokens, slot_pages, num_slots, page_size, dense_locs,
      errors);
  return cudaGetLastError();
}

#define SGLANG_CPKV_INSTANTIATE_CURRENT_DENSE_LOCS(T)                                                                  \
  template cudaError_t current_dense_locs<T>(                                                                          \
      const int64_t*, const int64_t*, int64_t, const T*, int64_t, const int32_t*, int64_t, int64_t, int64_t*, int32_t*, \
      cudaStream_t);
SGLANG_CPKV_INSTANTIATE_CURRENT_DENSE_LOCS(int32_t)
SGLANG_CPKV_INSTANTIATE_CURRENT_DENSE_LOCS(int64_t)
#undef SGLANG_CPKV_INSTANTIATE_CURRENT_DENSE_LOCS

}  // namespace sglang_cpkv
