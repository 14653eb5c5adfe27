// build_page_inverse: per batch, every (request, page) entry's dense slot -> per-request inverse, a hash table sized
// by the entries (page_inverse.cuh), filled by compare-and-swap from each entry's home cell.
#include "cp_shared_kv.h"
#include "page_inverse.cuh"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;

/// One thread per entry e: padding (page or request -1) is skipped, a bad id counted; a valid entry swaps its key
/// r * C + page into the first empty cell from its home cell on and writes its slot there, or finds its key already
/// held (the page twice in one request: counted, the other entry's slot kept).
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    page_inverse_insert_kernel(const PageIdT* __restrict__ entry_pages,  // [E]
                               const int64_t* __restrict__ entry_req,    // [E]
                               const int32_t* __restrict__ entry_slots,  // [E], nullptr: entry e at slot e
                               int64_t num_entries,                      // E
                               int64_t num_requests,                     // R
                               int64_t capacity,                         // C
                               int64_t table_mask,                       // T - 1
                               int64_t* __restrict__ keys,               // [T], all kEmptyKey on entry
                               int32_t* __restrict__ slots,              // [T]
                               int32_t* __restrict__ errors) {           // [kNumErrorKinds]
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (e >= num_entries) return;
  const int64_t page = static_cast<int64_t>(entry_pages[e]);
  const int64_t req = entry_req[e];
  const int64_t slot = entry_slots != nullptr ? entry_slots[e] : e;
  if (page == -1 || req == -1) return;  // an entry of the layout's rounding
  if (page >= capacity || page < -1 || slot < 0) {
    detail::count_error(errors, kErrPageOutOfRange);
    return;
  }
  if (req >= num_requests || req < -1) {
    detail::count_error(errors, kErrReqOutOfRange);
    return;
  }
  const int64_t key = req * capacity + page;
  auto* cells = reinterpret_cast<unsigned long long*>(keys);
  for (int64_t cell = detail::home_cell(key, table_mask);; cell = (cell + 1) & table_mask) {
    const auto held = static_cast<int64_t>(atomicCAS(cells + cell,
                                                     static_cast<unsigned long long>(detail::kEmptyKey),
                                                     static_cast<unsigned long long>(key)));
    if (held == detail::kEmptyKey) {
      slots[cell] = static_cast<int32_t>(slot);
      return;
    }
    if (held == key) {
      detail::count_error(errors, kErrPageOutOfRange);
      return;
    }
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
                               int64_t table_size,
                               int64_t* keys,
                               int32_t* slots,
                               int32_t* errors,
                               cudaStream_t stream) {
  // Every cell empty: the fill is a byte memset because kEmptyKey is all ones.
  static_assert(detail::kEmptyKey == -1, "the table's fill is a memset of 0xff bytes");
  cudaError_t status = cudaMemsetAsync(keys, 0xff, static_cast<size_t>(table_size) * sizeof(int64_t), stream);
  if (status != cudaSuccess || num_entries == 0) return status;
  const auto blocks = static_cast<unsigned>((num_entries + kInverseThreads - 1) / kInverseThreads);
  page_inverse_insert_kernel<PageIdT><<<blocks, kInverseThreads, 0, stream>>>(
      entry_pages, entry_req, entry_slots, num_entries, num_requests, capacity, table_size - 1, keys, slots, errors);
  return cudaGetLastError();
}

template cudaError_t build_page_inverse<int32_t>(const int32_t*,
                                                 const int64_t*,
                                                 const int32_t*,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t*,
                                                 int32_t*,
                                                 int32_t*,
                                                 cudaStream_t);
template cudaError_t build_page_inverse<int64_t>(const int64_t*,
                                                 const int64_t*,
                                                 const int32_t*,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t,
                                                 int64_t*,
                                                 int32_t*,
                                                 int32_t*,
                                                 cudaStream_t);

}  // namespace sglang_cpkv
