// CP shared-KV ops: host launchers (the contract reviewers read).
//
// Device code and launchers know nothing of torch: they take raw pointers, sizes, strides and a stream,
// enqueue work without ever synchronizing with the host (so they can be captured in a CUDA graph), and
// return the launch's cudaError_t. torch_bindings.cc checks tensors and calls them.
//
// Terms are those of docs/design/cp-shared-kv-contract.md: capacity C (page ids of the pool), request row
// r in [0, R), page index j, dense slot start[r] + j (the ragged layout: the launchers take every slot's page
// and request explicitly, never a stride), per-request inverse: a hash table of T cells (a power of two, at least
// twice the batch's entries: reference.inverse_table_size), key r * C + page (int64, -1 in an empty cell) with the
// dense slot (int32) of that entry, probed from the key's home cell one cell at a time (page_inverse.cuh).
// The torch reference (python/sglang_cpkv/ops/reference.py) is the truth each launcher reproduces exactly,
// bad ids included: -1 is skipped silently; any other id outside its range is dropped (nothing written, or -1
// written for remap) and counted with an atomic add in errors[kind] (python/sglang_cpkv/ops/errors.py).
//
// Each launcher is a template instantiated for the index types listed on it (int32_t and int64_t).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sglang_cpkv {

// Indices of the int32 error counter (same numbers as python/sglang_cpkv/ops/errors.py).
constexpr int kErrPageOutOfRange = 0;
constexpr int kErrReqOutOfRange = 1;
constexpr int kErrLocOutOfRange = 2;
constexpr int kErrCurrentLocMismatch = 3;  // a current token's out_cache_loc is not its dense slot's page location
constexpr int kNumErrorKinds = 4;

// The per-request inverse: the canonical table of reference.build_page_inverse (the cells that inserting the distinct
// keys entry_req[e] * C + entry_pages[e] in ascending order gives, whatever the order the threads insert in), each
// held cell with the slot of the lowest entry of its key (entry_slots nullptr: entry e at slot e), -1 elsewhere. An
// entry with page or request -1 (the layout's rounding) is skipped; a page id >= C or < -1, a negative slot, or a
// page its request already holds counts errors[kErrPageOutOfRange]; a request id >= R or < -1
// errors[kErrReqOutOfRange]. Several requests' entries may point at one slot (a shared history slot).
// E < 0x7f7f7f7f. PageIdT: int32_t, int64_t.
template <typename PageIdT>
cudaError_t build_page_inverse(const PageIdT* entry_pages,  // [E] page id of each entry
                               const int64_t* entry_req,    // [E] request row of each entry
                               const int32_t* entry_slots,  // [E] dense slot each entry points at, or nullptr
                               int64_t num_entries,         // E
                               int64_t num_requests,        // R
                               int64_t capacity,            // C
                               int64_t table_size,          // T: a power of two >= 2 * E
                               int64_t* keys,               // [T], written entirely
                               int32_t* slots,              // [T], written entirely
                               int32_t* errors,             // [kNumErrorKinds]
                               cudaStream_t stream);

// dense[n, k] = slot(req_id[n], locs[n, k] / page_size) * page_size + locs[n, k] % page_size, the slot found by
// probing the inverse from the key's home cell to the key or an empty cell, or -1
// when locs[n, k] == -1, req_id[n] == -1, the page is absent from request req_id[n]'s table, or the id is
// bad: req_id outside [-1, R) counts errors[kErrReqOutOfRange], a location < -1 or a page >= C counts
// errors[kErrPageOutOfRange]
// (one count per element, as the reference). Request ids are compact, one per row (never broadcast).
// LocT: int32_t, int64_t.
template <typename LocT>
cudaError_t remap_locs(const LocT* locs,         // [N, K], row n at locs + n * locs_row_stride, unit column stride
                       int64_t num_rows,         // N
                       int64_t row_len,          // K (1 for 1-D locs)
                       int64_t locs_row_stride,  // elements between rows of locs (>= K)
                       const int64_t* req_id,    // [N] request row of each row of locs, -1: padding row
                       const int64_t* inverse_keys,    // [T] r * C + page of a held cell, -1 of an empty one
                       const int32_t* inverse_slots,   // [T] the slot of each held cell
                       int64_t table_size,             // T, a power of two
                       int64_t num_requests,     // R
                       int64_t capacity,         // C
                       int64_t page_size,        // tokens per page (> 0)
                       int32_t* dense_locs,      // [N, K] contiguous, written entirely
                       int32_t* errors,          // [kNumErrorKinds]
                       cudaStream_t stream);

// Token t of N belongs to request r = the number of requests with token_ends[r] <= t (token_ends nondecreasing,
// token_ends[R - 1] == N); dense_locs[t] = dense_offsets[r] + t (-1 for a token past token_ends[R - 1]). A token whose
// out_cache_loc[t] is not slot_pages[d / page_size] * page_size + d % page_size, or whose d is outside
// [0, S * page_size) or on a slot holding no page (-1), counts errors[kErrCurrentLocMismatch] (its d is written all
// the same). LocT: int32_t, int64_t.
template <typename LocT>
cudaError_t current_dense_locs(const int64_t* token_ends,     // [R] cumsum of the current tokens per request
                               const int64_t* dense_offsets,  // [R] dense location of request r's token t, minus t
                               int64_t num_requests,          // R >= 1
                               const LocT* out_cache_loc,     // [N] pool locations of the current tokens
                               int64_t num_tokens,            // N
                               const int32_t* slot_pages,     // [S] page id of each dense slot, -1: none
                               int64_t num_slots,             // S
                               int64_t page_size,             // tokens per page (> 0)
                               int64_t* dense_locs,           // [N], written entirely
                               int32_t* errors,               // [kNumErrorKinds]
                               cudaStream_t stream);

// dst[dst_page[i]] = src[src_page[i]] (page_bytes bytes each) for every i where both ids are >= 0. An id >= its
// tensor's page count or < -1 counts errors[kErrPageOutOfRange] once per pair and the pair is skipped.
// Copies 16 bytes per access when every size, stride and base pointer allows it, else the widest that does.
// PageIdT: int32_t, int64_t (src_page and dst_page share it).
template <typename PageIdT>
cudaError_t copy_pages(const void* src,          // [src_pages, page_bytes] bytes, page p at src + p * src_stride
                       int64_t src_pages,        // pages of src
                       int64_t src_page_stride,  // bytes between pages of src (>= page_bytes)
                       const PageIdT* src_page,  // [S]
                       void* dst,                // [dst_pages, page_bytes] bytes
                       int64_t dst_pages,        // pages of dst
                       int64_t dst_page_stride,  // bytes between pages of dst (>= page_bytes)
                       const PageIdT* dst_page,  // [S]
                       int64_t num_pairs,        // S
                       int64_t page_bytes,       // bytes of one page
                       int32_t* errors,          // [kNumErrorKinds]
                       cudaStream_t stream);

// dst[dst_loc[i]] = src[i] (row_bytes bytes each) for every dst_loc[i] >= 0; a row >= dst_rows or < -1 counts
// errors[kErrLocOutOfRange] and is skipped. Duplicate destinations: one of the rows wins (unspecified).
// LocT: int32_t, int64_t.
template <typename LocT>
cudaError_t scatter_rows(const void* src,         // [N, row_bytes] bytes, row i at src + i * src_row_stride
                         int64_t num_rows,        // N
                         int64_t src_row_stride,  // bytes between rows of src (>= row_bytes)
                         const LocT* dst_loc,     // [N]
                         void* dst,               // [dst_rows, row_bytes] bytes
                         int64_t dst_rows,        // M
                         int64_t dst_row_stride,  // bytes between rows of dst (>= row_bytes)
                         int64_t row_bytes,       // bytes of one row
                         int32_t* errors,         // [kNumErrorKinds]
                         cudaStream_t stream);

// The per-layer dense view in one call: copy_pages(pool -> dense) of the history pages, then
// scatter_rows(current -> dense rows) of the current rows, so that a current row wins over the history
// page it lands in (the partial last page of a request under CURRENT_REUSE). The dense buffer is contiguous:
// its page p is rows [p * rows_per_page, (p + 1) * rows_per_page) of its row view, with
// rows_per_page = page_bytes / row_bytes. The scatter kernel is launched as a programmatic dependent of the
// copy (Hopper and later): it loads its rows while the copy drains and waits for the copy's completion and
// memory flush (griddepcontrol.wait) before its first store; older GPUs get two ordinary launches.
// PageIdT, LocT: int32_t, int64_t each.
template <typename PageIdT, typename LocT>
cudaError_t materialize_and_fill(const void* pool,            // [pool_pages, page_bytes] bytes
                                 int64_t pool_pages,          // pages of pool
                                 int64_t pool_page_stride,    // bytes between pages of pool
                                 const PageIdT* src_page,     // [S] pool pages to copy
                                 const PageIdT* dst_page,     // [S] dense pages they go to
                                 int64_t num_pairs,           // S
                                 const void* current,         // [N, row_bytes] bytes, current KV rows
                                 int64_t num_rows,            // N
                                 int64_t current_row_stride,  // bytes between rows of current
                                 const LocT* dst_loc,         // [N] dense rows of the current rows
                                 void* dense,                 // [dense_pages, page_bytes] bytes, contiguous
                                 int64_t dense_pages,         // pages of dense
                                 int64_t page_bytes,          // bytes of one page (a multiple of row_bytes)
                                 int64_t row_bytes,           // bytes of one row
                                 int32_t* errors,             // [kNumErrorKinds]
                                 cudaStream_t stream);

}  // namespace sglang_cpkv
