// remap_locs: token locations of each request -> locations in its dense view, through the per-request inverse
// (its hash table, probed from each key's home cell: page_inverse.cuh).
// Used per batch (current locs, [N]) and per layer (top-k locs, [N, K] with one request id per row).
#include <type_traits>

#include "cp_shared_kv.h"
#include "page_inverse.cuh"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

constexpr int kRemapThreads = 256;

/// kVec consecutive elements of one row, loaded or stored as one aligned access.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Lanes {
  T value[kVec];
};

/// Which page of which request one pool location looks up (req -1: none) and which error it counts (-1: none);
/// see cp_shared_kv.h.
struct Lookup {
  int64_t req;     // request row, or -1
  int64_t page;    // page id
  int64_t offset;  // token offset in the page
  int error;       // error kind, or -1
};

__device__ __forceinline__ Lookup
classify(int64_t loc, int64_t req, int64_t num_requests, int64_t capacity, int64_t page_size, int page_shift) {
  // Location -1 or a padding row (-1) is padding: -1, nothing counted. Any other negative location is a bad id.
  if (loc == -1 || req == -1) return {-1, 0, 0, -1};
  if (req < -1 || req >= num_requests) return {-1, 0, 0, kErrReqOutOfRange};
  if (loc < 0) return {-1, 0, 0, kErrPageOutOfRange};
  const int64_t page = page_shift >= 0 ? loc >> page_shift : loc / page_size;
  if (page >= capacity) return {-1, 0, 0, kErrPageOutOfRange};
  return {req, page, loc - page * page_size, -1};
}

/// The slot of (req, page) in the inverse's table: probed from the key's home cell to the key (its slot) or an
/// empty cell (-1). At most half the cells are held, so every probe sequence ends.
__device__ __forceinline__ int32_t find_slot(const int64_t* __restrict__ inverse_keys,
                                             const int32_t* __restrict__ inverse_slots,
                                             int64_t table_mask,
                                             int64_t capacity,
                                             int64_t req,
                                             int64_t page) {
  const int64_t key = req * capacity + page;
  for (int64_t cell = detail::home_cell(key, table_mask);; cell = (cell + 1) & table_mask) {
    const int64_t held = inverse_keys[cell];
    if (held == key) return inverse_slots[cell];
    if (held == detail::kEmptyKey) return -1;
  }
}

/// Each thread takes kUnroll groups of kVec consecutive elements of one row (K % kVec == 0), consecutive threads
/// consecutive groups; all loads of locs and request ids are issued before the inverse searches. The request id is
/// read per row (req_id[n], compact) and the row length K turns the flat index into (n, k).
/// \tparam kVec  elements per access: 16 bytes of locs when K, the row stride and the base allow it, else 1.
/// \tparam FlatT uint32_t when N * K fits, else uint64_t.
template <typename LocT, int kVec, int kUnroll, typename FlatT>
__global__ void __launch_bounds__(kRemapThreads)
    remap_locs_kernel(const LocT* locs,                     // [N, K], row stride locs_row_stride; may be dense_locs
                      int64_t locs_row_stride,              // elements between rows of locs
                      const int64_t* __restrict__ req_id,   // [N]
                      const int64_t* __restrict__ inverse_keys,    // [T]
                      const int32_t* __restrict__ inverse_slots,   // [T]
                      int64_t table_mask,                          // T - 1
                      FlatT total,                          // N * K
                      FlatT row_len,                        // K
                      int64_t num_requests,                   // R
                      int64_t capacity,                     // C
                      int64_t page_size,                    // tokens per page
                      int page_shift,                       // log2(page_size) when a power of two, else -1
                      int32_t* dense_locs,                  // [N, K] contiguous (locs itself: in place)
                      int32_t* __restrict__ errors) {       // [kNumErrorKinds]
  const FlatT groups = total / kVec;
  const FlatT groups_per_row = row_len / kVec;
  const FlatT first = static_cast<FlatT>(blockIdx.x) * static_cast<FlatT>(kRemapThreads * kUnroll) + threadIdx.x;
  Lanes<LocT, kVec> loc[kUnroll];
  int64_t req[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const FlatT group = first + static_cast<FlatT>(k) * kRemapThreads;
    req[k] = -1;
    if (group < groups) {
      const FlatT row = group / groups_per_row;
      const FlatT col = (group - row * groups_per_row) * kVec;
      loc[k] = *reinterpret_cast<const Lanes<LocT, kVec>*>(locs + static_cast<int64_t>(row) * locs_row_stride +
                                                           static_cast<int64_t>(col));
      req[k] = req_id[row];
    }
  }
  Lookup lookup[kUnroll][kVec];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      lookup[k][e] = classify(req[k] == -1 ? -1 : static_cast<int64_t>(loc[k].value[e]),
                              req[k],
                              num_requests,
                              capacity,
                              page_size,
                              page_shift);
    }
  }
  int32_t slot[kUnroll][kVec];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      slot[k][e] = lookup[k][e].req >= 0
                       ? find_slot(inverse_keys, inverse_slots, table_mask, capacity, lookup[k][e].req, lookup[k][e].page)
                       : -1;
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const FlatT group = first + static_cast<FlatT>(k) * kRemapThreads;
    if (group >= groups) continue;
    Lanes<int32_t, kVec> dense;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      // One branch per kind: count_error adds its coalesced group's size to one kind, so a group must never mix
      // kinds (a single call with a run-time kind would credit one kind with the other's count).
      if (lookup[k][e].error == kErrReqOutOfRange) {
        detail::count_error(errors, kErrReqOutOfRange);
      } else if (lookup[k][e].error == kErrPageOutOfRange) {
        detail::count_error(errors, kErrPageOutOfRange);
      }
      // Truncation to int32 as the reference's .to(torch.int32).
      dense.value[e] = slot[k][e] >= 0
                           ? static_cast<int32_t>(static_cast<int64_t>(slot[k][e]) * page_size + lookup[k][e].offset)
                           : -1;
    }
    *reinterpret_cast<Lanes<int32_t, kVec>*>(dense_locs + static_cast<int64_t>(group) * kVec) = dense;
  }
}

}  // namespace

template <typename LocT>
cudaError_t remap_locs(const LocT* locs,
                       int64_t num_rows,
                       int64_t row_len,
                       int64_t locs_row_stride,
                       const int64_t* req_id,
                       const int64_t* inverse_keys,
                       const int32_t* inverse_slots,
                       int64_t table_size,
                       int64_t num_requests,
                       int64_t capacity,
                       int64_t page_size,
                       int32_t* dense_locs,
                       int32_t* errors,
                       cudaStream_t stream) {
  if (num_rows * row_len == 0) return cudaSuccess;
  const int64_t table_mask = table_size - 1;
  int page_shift = -1;
  if ((page_size & (page_size - 1)) == 0) {
    page_shift = 0;
    while ((int64_t{1} << page_shift) < page_size) ++page_shift;
  }
  // 16-byte loads of locs (4 int32 or 2 int64 per access) when every row starts on a 16-byte boundary.
  constexpr int kVec = 16 / sizeof(LocT);
  const bool vectorized = row_len % kVec == 0 && locs_row_stride % kVec == 0 &&
                          reinterpret_cast<uintptr_t>(locs) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(dense_locs) % (sizeof(int32_t) * kVec) == 0;
  const auto launch = [&](auto vec, auto unroll) {
    constexpr int kLaunchVec = decltype(vec)::value;
    constexpr int kUnroll = decltype(unroll)::value;
    constexpr int64_t kElemsPerBlock = int64_t{kRemapThreads} * kUnroll * kLaunchVec;
    const int64_t total = num_rows * row_len;
    const dim3 grid(static_cast<unsigned>((total + kElemsPerBlock - 1) / kElemsPerBlock));
    const auto launch_flat = [&](auto flat_index) {
      using FlatT = decltype(flat_index);
      remap_locs_kernel<LocT, kLaunchVec, kUnroll, FlatT><<<grid, kRemapThreads, 0, stream>>>(locs,
                                                                                               locs_row_stride,
                                                                                               req_id,
                                                                                               inverse_keys,
                                                                                               inverse_slots,
                                                                                               table_mask,
                                                                                               static_cast<FlatT>(total),
                                                                                               static_cast<FlatT>(row_len),
                                                                                               num_requests,
                                                                                               capacity,
                                                                                               page_size,
                                                                                               page_shift,
                                                                                               dense_locs,
                                                                                               errors);
    };
    // The last block's flat indices reach past total by less than one block.
    if (total + kElemsPerBlock <= static_cast<int64_t>(UINT32_MAX)) {
      launch_flat(uint32_t{});
    } else {
      launch_flat(uint64_t{});
    }
    return cudaGetLastError();
  };
  if (vectorized) return launch(std::integral_constant<int, kVec>{}, std::integral_constant<int, 2>{});
  return launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{});
}

#define SGLANG_CPKV_INSTANTIATE_REMAP_LOCS(T)                                                                                                                     \
  template cudaError_t remap_locs<T>(                                                                                                                             \
      const T*, int64_t, int64_t, int64_t, const int64_t*, const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int32_t*, int32_t*, cudaStream_t);
SGLANG_CPKV_INSTANTIATE_REMAP_LOCS(int32_t)
SGLANG_CPKV_INSTANTIATE_REMAP_LOCS(int64_t)
#undef SGLANG_CPKV_INSTANTIATE_REMAP_LOCS

}  // namespace sglang_cpkv
