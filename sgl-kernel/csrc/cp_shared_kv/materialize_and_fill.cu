// materialize_and_fill: the per-layer dense view in one call, copy_pages of the history pages then
// scatter_rows of the current rows into the same dense buffer (current rows win over a partial history page).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

namespace {

// Programmatic dependent launch needs sm_90+; the attribute is not set on older devices (plain stream order).
bool supports_programmatic_dependent_launch() {
  int device = 0;
  int major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

}  // namespace

template <typename PageIdT, typename LocT>
cudaError_t materialize_and_fill(const void* pool,
                                 int64_t pool_pages,
                                 int64_t pool_page_stride,
                                 const PageIdT* src_page,
                                 const PageIdT* dst_page,
                                 int64_t num_pairs,
                                 const void* current,
                                 int64_t num_rows,
                                 int64_t current_row_stride,
                                 const LocT* dst_loc,
                                 void* dense,
                                 int64_t dense_pages,
                                 int64_t page_bytes,
                                 int64_t row_bytes,
                                 int32_t* errors,
                                 cudaStream_t stream) {
  // Without a copy launch in this call the fill must not be a programmatic dependent: it would then start
  // early on whatever kernel preceded it (the producer of `current`, for instance) and read its rows unordered.
  const bool copy_launched = num_pairs > 0 && page_bytes > 0;
  const bool programmatic = copy_launched && supports_programmatic_dependent_launch();
  const detail::RowCopy<PageIdT, PageIdT> history{
      pool, pool_pages, pool_page_stride, src_page, dense, dense_pages, page_bytes, dst_page, num_pairs, page_bytes,
      errors, kErrPageOutOfRange};
  const int64_t dense_rows = dense_pages * (page_bytes / row_bytes);
  const detail::RowCopy<LocT, LocT> fill{
      current, num_rows, current_row_stride, nullptr, dense, dense_rows, row_bytes, dst_loc, num_rows, row_bytes,
      errors, kErrLocOutOfRange};
  cudaError_t status = detail::launch_copy_rows</*kGatherSrc=*/true, /*kLaunchDependents=*/true>(
      history, /*programmatic_dependent=*/false, stream);
  if (status != cudaSuccess) return status;
  // NOTE: the fill must not store before the copy has finished (a current row overwrites the tail of the
  // partial history page); its kernel waits on griddepcontrol.wait before storing, and without the
  // programmatic attribute it simply starts after the copy.
  return detail::launch_copy_rows</*kGatherSrc=*/false, /*kLaunchDependents=*/false, /*kWaitPrior=*/true>(
      fill, programmatic, stream);
}

#define SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL(PAGE_ID_T, LOC_T)          \
  template cudaError_t materialize_and_fill<PAGE_ID_T, LOC_T>(const void*,      \
                                                              int64_t,          \
                                                              int64_t,          \
                                                              const PAGE_ID_T*, \
                                                              const PAGE_ID_T*, \
                                                              int64_t,          \
                                                              const void*,      \
                                                              int64_t,          \
                                                              int64_t,          \
                                                              const LOC_T*,     \
                                                              void*,            \
                                                              int64_t,          \
                                                              int64_t,          \
                                                              int64_t,          \
                                                              int32_t*,         \
                                                              cudaStream_t);
SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL(int32_t, int32_t)
SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL(int32_t, int64_t)
SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL(int64_t, int32_t)
SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL(int64_t, int64_t)
#undef SGLANG_CPKV_INSTANTIATE_MATERIALIZE_AND_FILL

}  // namespace sglang_cpkv
