// scatter_rows: rows to destination rows (fill current KV into each request's dense slots, CURRENT_REUSE
// included; persist owned rows to the pool).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

template <typename LocT>
cudaError_t scatter_rows(const void* src,
                         int64_t num_rows,
                         int64_t src_row_stride,
                         const LocT* dst_loc,
                         void* dst,
                         int64_t dst_rows,
                         int64_t dst_row_stride,
                         int64_t row_bytes,
                         int32_t* errors,
                         cudaStream_t stream) {
  // src rows are taken in order: no src index (its type is irrelevant; LocT keeps the instantiation single).
  const detail::RowCopy<LocT, LocT> rows{
      src, num_rows, src_row_stride, nullptr, dst, dst_rows, dst_row_stride, dst_loc, num_rows, row_bytes, errors,
      kErrLocOutOfRange};
  return detail::launch_copy_rows</*kGatherSrc=*/false>(rows, /*programmatic_dependent=*/false, stream);
}

#define SGLANG_CPKV_INSTANTIATE_SCATTER_ROWS(T)                                                           \
  template cudaError_t scatter_rows<T>(                                                                   \
      const void*, int64_t, int64_t, const T*, void*, int64_t, int64_t, int64_t, int32_t*, cudaStream_t);
SGLANG_CPKV_INSTANTIATE_SCATTER_ROWS(int32_t)
SGLANG_CPKV_INSTANTIATE_SCATTER_ROWS(int64_t)
#undef SGLANG_CPKV_INSTANTIATE_SCATTER_ROWS

}  // namespace sglang_cpkv
