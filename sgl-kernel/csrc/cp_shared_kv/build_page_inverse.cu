// build_page_inverse: per batch, every (request, page) entry's dense slot -> per-request inverse, sized by the
// entries: each request's page ids ascending with their slots (the sort between the two kernels is torch's).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;

/// One thread per entry e: its sort key, entry_req[e] * C + entry_pages[e], or end_key = R * C (sorting after every
/// entry) for padding and bad ids, which are counted.
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    page_inverse_keys_kernel(const PageIdT* __restrict__ entry_pages,  // [E]
                             const int64_t* __restrict__ entry_req,    // [E]
                             const int32_t* __restrict__ entry_slots,  // [E], nullptr: entry e at slot e
                             int64_t num_entries,                      // E
                             int64_t num_requests,                     // R
                             int64_t capacity,                         // C
                             int64_t* __restrict__ keys,               // [E]
                             int32_t* __restrict__ errors) {           // [kNumErrorKinds]
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (e >= num_entries) return;
  const int64_t page = static_cast<int64_t>(entry_pages[e]);
  const int64_t req = entry_req[e];
  const int64_t slot = entry_slots != nullptr ? entry_slots[e] : e;
  int64_t key = num_requests * capacity;
  if (page == -1 || req == -1) {
    // an entry of the layout's rounding
  } else if (page >= capacity || page < -1 || slot < 0) {
    detail::count_error(errors, kErrPageOutOfRange);
  } else if (req >= num_requests || req < -1) {
    detail::count_error(errors, kErrReqOutOfRange);
  } else {
    key = req * capacity + page;
  }
  keys[e] = key;
}

/// One thread per sorted position i: its page id and its entry's slot (-1 past the entries), and a count when its key
/// repeats its predecessor's (a page its request holds twice; the lookup finds one of them).
__global__ void __launch_bounds__(kInverseThreads)
    page_inverse_runs_kernel(const int64_t* __restrict__ sorted_keys,  // [E], ascending
                             const int64_t* __restrict__ order,        // [E], entry of each sorted position
                             const int32_t* __restrict__ entry_slots,  // [E], nullptr: entry e at slot e
                             int64_t num_entries,                      // E
                             int64_t end_key,                          // R * C
                             int64_t capacity,                         // C
                             int32_t* __restrict__ pages,              // [E]
                             int32_t* __restrict__ slots,              // [E]
                             int32_t* __restrict__ errors) {           // [kNumErrorKinds]
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (i >= num_entries) return;
  const int64_t key = sorted_keys[i];
  if (key >= end_key) {
    pages[i] = -1;
    slots[i] = -1;
    return;
  }
  const int64_t entry = order[i];
  pages[i] = static_cast<int32_t>(key % capacity);
  slots[i] = entry_slots != nullptr ? entry_slots[entry] : static_cast<int32_t>(entry);
  if (i > 0 && sorted_keys[i - 1] == key) detail::count_error(errors, kErrPageOutOfRange);
}

unsigned entry_blocks(int64_t num_entries) {
  return static_cast<unsigned>((num_entries + kInverseThreads - 1) / kInverseThreads);
}

}  // namespace

template <typename PageIdT>
cudaError_t page_inverse_keys(const PageIdT* entry_pages,
                              const int64_t* entry_req,
                              const int32_t* entry_slots,
                              int64_t num_entries,
                              int64_t num_requests,
                              int64_t capacity,
                              int64_t* keys,
                              int32_t* errors,
                              cudaStream_t stream) {
  if (num_entries == 0) return cudaSuccess;
  page_inverse_keys_kernel<PageIdT><<<entry_blocks(num_entries), kInverseThreads, 0, stream>>>(
      entry_pages, entry_req, entry_slots, num_entries, num_requests, capacity, keys, errors);
  return cudaGetLastError();
}

cudaError_t page_inverse_runs(const int64_t* sorted_keys,
                              const int64_t* order,
                              const int32_t* entry_slots,
                              int64_t num_entries,
                              int64_t end_key,
                              int64_t capacity,
                              int32_t* pages,
                              int32_t* slots,
                              int32_t* errors,
                              cudaStream_t stream) {
  if (num_entries == 0) return cudaSuccess;
  page_inverse_runs_kernel<<<entry_blocks(num_entries), kInverseThreads, 0, stream>>>(
      sorted_keys, order, entry_slots, num_entries, end_key, capacity, pages, slots, errors);
  return cudaGetLastError();
}

template cudaError_t page_inverse_keys<int32_t>(
    const int32_t*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t*, int32_t*, cudaStream_t);
template cudaError_t page_inverse_keys<int64_t>(
    const int64_t*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t*, int32_t*, cudaStream_t);

}  // namespace sglang_cpkv
