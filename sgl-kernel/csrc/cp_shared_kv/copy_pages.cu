// copy_pages: whole pages from one paged tensor to another (materialize history pool pages into dense slots;
// pack/unpack owned pages around the CP all-gather).
#include "cp_shared_kv.h"
#include "row_copy.cuh"

namespace sglang_cpkv {

template <typename PageIdT>
cudaError_t copy_pages(const void* src,
                       int64_t src_pages,
                       int64_t src_page_stride,
                       const PageIdT* src_page,
                       void* dst,
                       int64_t dst_pages,
                       int64_t dst_page_stride,
                       const PageIdT* dst_page,
                       int64_t num_pairs,
                       int64_t page_bytes,
                       int32_t* errors,
                       cudaStream_t stream) {
  const detail::RowCopy<PageIdT, PageIdT> pages{
      src, src_pages, src_page_stride, src_page, dst, dst_pages, dst_page_stride, dst_page, num_pairs, page_bytes,
      errors, kErrPageOutOfRange};
  return detail::launch_copy_rows</*kGatherSrc=*/true>(pages, /*programmatic_dependent=*/false, stream);
}

#define SGLANG_CPKV_INSTANTIATE_COPY_PAGES(T)                                                                                \
  template cudaError_t copy_pages<T>(                                                                                        \
      const void*, int64_t, int64_t, const T*, void*, int64_t, int64_t, const T*, int64_t, int64_t, int32_t*, cudaStream_t);
SGLANG_CPKV_INSTANTIATE_COPY_PAGES(int32_t)
SGLANG_CPKV_INSTANTIATE_COPY_PAGES(int64_t)
#undef SGLANG_CPKV_INSTANTIATE_COPY_PAGES

}  // namespace sglang_cpkv
