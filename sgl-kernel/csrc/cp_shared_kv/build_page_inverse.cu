// build_page_inverse: per batch, every (request, page) entry's dense slot -> per-request inverse, a hash table sized
// by the entries (page_inverse.cuh): the canonical ordered table of reference.build_page_inverse, in three launches
// (insert the keys, claim each key's lowest entry, turn owners into slots) after two memsets.
#include "cp_shared_kv.h"
#include "page_inverse.cuh"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kInverseThreads = 256;
// The lowest-entry fill of the slots before the claims: a memset of 0x7f bytes, above every entry index.
constexpr int32_t kNoOwner = 0x7f7f7f7f;

/// Entry e's key r * C + page, or -1 for padding (page or request -1) and for a bad id, which is counted when
/// count_bad (once per build: by the insert kernel).
template <typename PageIdT, bool kCountBad>
__device__ __forceinline__ int64_t entry_key(const PageIdT* __restrict__ entry_pages,
                                             const int64_t* __restrict__ entry_req,
                                             const int32_t* __restrict__ entry_slots,
                                             int64_t e,
                                             int64_t num_requests,
                                             int64_t capacity,
                                             int32_t* __restrict__ errors) {
  const int64_t page = static_cast<int64_t>(entry_pages[e]);
  const int64_t req = entry_req[e];
  const int64_t slot = entry_slots != nullptr ? entry_slots[e] : e;
  if (page == -1 || req == -1) return -1;  // an entry of the layout's rounding
  if (page >= capacity || page < -1 || slot < 0) {
    if constexpr (kCountBad) detail::count_error(errors, kErrPageOutOfRange);
    return -1;
  }
  if (req >= num_requests || req < -1) {
    if constexpr (kCountBad) detail::count_error(errors, kErrReqOutOfRange);
    return -1;
  }
  return req * capacity + page;
}

/// One thread per entry: its key goes into the first empty cell from its home cell on, displacing any larger key
/// it meets, which goes on probing from the next cell (an ordered hash table: the cells end the same whatever the
/// order of the swaps). A key found already held is a page its request holds twice: counted.
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
                               int32_t* __restrict__ errors) {           // [kNumErrorKinds]
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (e >= num_entries) return;
  int64_t key = entry_key<PageIdT, true>(entry_pages, entry_req, entry_slots, e, num_requests, capacity, errors);
  if (key < 0) return;
  auto* cells = reinterpret_cast<unsigned long long*>(keys);
  int64_t cell = detail::home_cell(key, table_mask);
  int64_t expect = detail::kEmptyKey;  // what this thread believes the cell holds
  while (true) {
    const auto held = static_cast<int64_t>(atomicCAS(
        cells + cell, static_cast<unsigned long long>(expect), static_cast<unsigned long long>(key)));
    if (held == expect) {
      if (expect == detail::kEmptyKey) return;
      key = held;  // displaced a larger key: it probes on
      cell = (cell + 1) & table_mask;
      expect = detail::kEmptyKey;
    } else if (held == key) {
      detail::count_error(errors, kErrPageOutOfRange);
      return;
    } else if (held > key) {
      expect = held;  // try to displace it
    } else {
      cell = held == detail::kEmptyKey ? cell : (cell + 1) & table_mask;
      expect = detail::kEmptyKey;
    }
  }
}

/// The cell holding key (every key is inserted), probed from its home cell.
__device__ __forceinline__ int64_t cell_of(const int64_t* __restrict__ keys, int64_t key, int64_t table_mask) {
  int64_t cell = detail::home_cell(key, table_mask);
  while (keys[cell] != key) cell = (cell + 1) & table_mask;
  return cell;
}

/// One thread per entry: its key's cell takes the lowest entry holding that key.
template <typename PageIdT>
__global__ void __launch_bounds__(kInverseThreads)
    page_inverse_claim_kernel(const PageIdT* __restrict__ entry_pages,
                              const int64_t* __restrict__ entry_req,
                              const int32_t* __restrict__ entry_slots,
                              int64_t num_entries,
                              int64_t num_requests,
                              int64_t capacity,
                              int64_t table_mask,
                              const int64_t* __restrict__ keys,  // [T], every key inserted
                              int32_t* __restrict__ owners) {    // [T], kNoOwner on entry
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (e >= num_entries) return;
  const int64_t key =
      entry_key<PageIdT, false>(entry_pages, entry_req, entry_slots, e, num_requests, capacity, nullptr);
  if (key >= 0) atomicMin(owners + cell_of(keys, key, table_mask), static_cast<int32_t>(e));
}

/// One thread per cell: a held cell's lowest entry -> that entry's slot; an empty cell -> -1.
__global__ void __launch_bounds__(kInverseThreads)
    page_inverse_slots_kernel(const int64_t* __restrict__ keys,         // [T]
                              const int32_t* __restrict__ entry_slots,  // [E], nullptr: entry e at slot e
                              int64_t table_size,                       // T
                              int32_t* __restrict__ slots) {            // [T], owners on entry
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kInverseThreads + threadIdx.x;
  if (cell >= table_size) return;
  if (keys[cell] == detail::kEmptyKey) {
    slots[cell] = -1;
    return;
  }
  const int32_t owner = slots[cell];
  slots[cell] = entry_slots != nullptr ? entry_slots[owner] : owner;
}

unsigned blocks_of(int64_t threads) {
  return static_cast<unsigned>((threads + kInverseThreads - 1) / kInverseThreads);
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
  // Every cell empty and no owner yet: byte memsets, because kEmptyKey is all ones and kNoOwner four 0x7f bytes.
  static_assert(detail::kEmptyKey == -1, "the key fill is a memset of 0xff bytes");
  static_assert(kNoOwner == 0x7f7f7f7f, "the owner fill is a memset of 0x7f bytes");
  if (num_entries >= kNoOwner) return cudaErrorInvalidValue;
  cudaError_t status = cudaMemsetAsync(keys, 0xff, static_cast<size_t>(table_size) * sizeof(int64_t), stream);
  if (status == cudaSuccess)
    status = cudaMemsetAsync(slots, 0x7f, static_cast<size_t>(table_size) * sizeof(int32_t), stream);
  if (status != cudaSuccess) return status;
  if (num_entries > 0) {
    page_inverse_insert_kernel<PageIdT><<<blocks_of(num_entries), kInverseThreads, 0, stream>>>(
        entry_pages, entry_req, entry_slots, num_entries, num_requests, capacity, table_size - 1, keys, errors);
    page_inverse_claim_kernel<PageIdT><<<blocks_of(num_entries), kInverseThreads, 0, stream>>>(
        entry_pages, entry_req, entry_slots, num_entries, num_requests, capacity, table_size - 1, keys, slots);
  }
  page_inverse_slots_kernel<<<blocks_of(table_size), kInverseThreads, 0, stream>>>(
      keys, entry_slots, table_size, slots);
  return cudaGetLastError();
}

#define SGLANG_CPKV_INSTANTIATE_BUILD_PAGE_INVERSE(T)                                                                            \
  template cudaError_t build_page_inverse<T>(                                                                                    \
      const T*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t*, int32_t*, int32_t*, cudaStream_t);
SGLANG_CPKV_INSTANTIATE_BUILD_PAGE_INVERSE(int32_t)
SGLANG_CPKV_INSTANTIATE_BUILD_PAGE_INVERSE(int64_t)
#undef SGLANG_CPKV_INSTANTIATE_BUILD_PAGE_INVERSE

}  // namespace sglang_cpkv
