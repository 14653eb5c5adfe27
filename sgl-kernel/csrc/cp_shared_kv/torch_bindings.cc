// Torch registration of the CP shared-KV ops (namespace sglang_cpkv, never upstream's sgl_kernel).
//
// Each op: check tensors (messages name the tensor, the expected and the actual value), derive sizes and
// strides from shapes, call the launcher of cp_shared_kv.h on the current stream, turn its cudaError_t into
// an exception. Nothing here synchronizes with the host. Python side: python/sglang_cpkv/ops/cuda.py, whose
// register_fake entries mirror the output shapes below.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cp_shared_kv.h"

namespace sglang_cpkv {
namespace torch_ops {
namespace {

// Check messages are concatenated here, without std::ostream, and handed to TORCH_CHECK as one C string.
// NOTE: on the GPU test machine (H200, torch 2.11+cu130, g++ 13; the Docker image's torch is 2.14.1) the built
// library carries its own copy of libstdc++
// (ldd lists none), and c10::str's `ss << int64_t` inside it segfaulted (cuda-gdb, 2026-11-30: frame
// c10::detail::_str<long> -> std::basic_ostream::_M_insert<long>) whenever a check with an integer in its
// message failed. std::to_string and std::string appends need no locale, and a single const char* argument
// makes c10::str return the pointer untouched.
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
inline void append(std::string& out, Int v) {
  out += std::to_string(v);
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

#define CPKV_CHECK(cond, ...) TORCH_CHECK(cond, ::sglang_cpkv::torch_ops::message(__VA_ARGS__).c_str())

// "[4, 2]": sizes and strides for messages.
std::string format_dims(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Tensor& anchor, const char* anchor_name) {
  CPKV_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  CPKV_CHECK(t.device() == anchor.device(),
              name,
              " must be on the device of ",
              anchor_name,
              " (",
              anchor.device(),
              "), got ",
              t.device());
}

void check_index_dtype(const at::Tensor& t, const char* name) {
  CPKV_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
              name,
              " must be int32 or int64, got ",
              t.scalar_type());
}

void check_error_counter(const at::Tensor& errors, const at::Tensor& anchor, const char* anchor_name) {
  check_cuda_tensor(errors, "errors", anchor, anchor_name);
  CPKV_CHECK(errors.scalar_type() == at::kInt, "errors must be int32, got ", errors.scalar_type());
  CPKV_CHECK(errors.dim() == 1 && errors.size(0) == kNumErrorKinds && errors.is_contiguous(),
              "errors must be a contiguous [",
              kNumErrorKinds,
              "] counter, got shape ",
              format_dims(errors.sizes()),
              " strides ",
              format_dims(errors.strides()));
}

void check_index_vector(const at::Tensor& t, const char* name, int64_t expected_len, const char* len_source) {
  check_index_dtype(t, name);
  CPKV_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", format_dims(t.sizes()));
  CPKV_CHECK(t.size(0) == expected_len,
              name,
              " must have one entry per ",
              len_source,
              " (",
              expected_len,
              "), got ",
              t.size(0));
  CPKV_CHECK(t.is_contiguous(), name, " must be contiguous, got stride ", format_dims(t.strides()));
}

// Bytes of one row of a [rows, ...] tensor whose trailing dims are contiguous (a row is one run of bytes).
int64_t contiguous_row_bytes(const at::Tensor& t, const char* name) {
  CPKV_CHECK(t.dim() >= 2, name, " must be [rows, ...] with at least 2 dims, got shape ", format_dims(t.sizes()));
  int64_t expected_stride = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    CPKV_CHECK(t.size(d) == 1 || t.stride(d) == expected_stride,
                name,
                " must be contiguous after dim 0, got shape ",
                format_dims(t.sizes()),
                " strides ",
                format_dims(t.strides()));
    expected_stride *= t.size(d);
  }
  return expected_stride * static_cast<int64_t>(t.element_size());
}

void check_same_rows(const at::Tensor& src, const char* src_name, const at::Tensor& dst, const char* dst_name) {
  CPKV_CHECK(src.scalar_type() == dst.scalar_type(),
              src_name,
              " and ",
              dst_name,
              " must have one dtype, got ",
              src.scalar_type(),
              " and ",
              dst.scalar_type());
  CPKV_CHECK(src.sizes().slice(1) == dst.sizes().slice(1),
              src_name,
              " and ",
              dst_name,
              " must have one row shape, got ",
              format_dims(src.sizes()),
              " and ",
              format_dims(dst.sizes()));
}

// copy_pages' and scatter_rows' src and dst: CUDA tensors on one device with one dtype and row shape, rows
// contiguous and not empty. Returns the bytes of one row (a page, for copy_pages).
int64_t check_row_operands(const at::Tensor& src, const at::Tensor& dst, const char* rows) {
  check_cuda_tensor(src, "src", src, "src");
  check_cuda_tensor(dst, "dst", src, "src");
  check_same_rows(src, "src", dst, "dst");
  const int64_t row_bytes = contiguous_row_bytes(src, "src");
  contiguous_row_bytes(dst, "dst");
  CPKV_CHECK(row_bytes > 0, "src ", rows, " must not be empty, got shape ", format_dims(src.sizes()));
  return row_bytes;
}

// The page pairs of a page copy: one destination page per source page, one index dtype, on the anchor's device.
void check_page_pairs(const at::Tensor& src_page,
                      const at::Tensor& dst_page,
                      const at::Tensor& anchor,
                      const char* anchor_name) {
  check_cuda_tensor(src_page, "src_page", anchor, anchor_name);
  check_cuda_tensor(dst_page, "dst_page", anchor, anchor_name);
  check_index_vector(src_page, "src_page", src_page.numel(), "src_page entry");
  check_index_vector(dst_page, "dst_page", src_page.numel(), "src_page entry");
  CPKV_CHECK(src_page.scalar_type() == dst_page.scalar_type(),
              "src_page and dst_page must have one dtype, got ",
              src_page.scalar_type(),
              " and ",
              dst_page.scalar_type());
}

void check_launch(cudaError_t status, const char* op) {
  CPKV_CHECK(status == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(status));
}

// Calls fn(IndexT{}) with the index type of `index` (int32_t or int64_t; callers check the dtype first), so
// each op names its launcher once instead of once per index dtype.
template <typename Fn>
cudaError_t dispatch_index_type(const at::Tensor& index, Fn&& fn) {
  return index.scalar_type() == at::kInt ? fn(int32_t{}) : fn(int64_t{});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> build_page_inverse(const at::Tensor& entry_pages,
                                                                  const at::Tensor& entry_req,
                                                                  int64_t num_requests,
                                                                  int64_t capacity,
                                                                  at::Tensor& errors,
                                                                  const std::optional<at::Tensor>& entry_slots) {
  check_cuda_tensor(entry_pages, "entry_pages", entry_pages, "entry_pages");
  check_index_vector(entry_pages, "entry_pages", entry_pages.numel(), "page-table entry");
  check_cuda_tensor(entry_req, "entry_req", entry_pages, "entry_pages");
  CPKV_CHECK(entry_req.scalar_type() == at::kLong, "entry_req must be int64, got ", entry_req.scalar_type());
  check_index_vector(entry_req, "entry_req", entry_pages.numel(), "entry_pages entry");
  if (entry_slots.has_value()) {
    check_cuda_tensor(*entry_slots, "entry_slots", entry_pages, "entry_pages");
    CPKV_CHECK(
        entry_slots->scalar_type() == at::kInt, "entry_slots must be int32, got ", entry_slots->scalar_type());
    check_index_vector(*entry_slots, "entry_slots", entry_pages.numel(), "entry_pages entry");
  } else {
    CPKV_CHECK(entry_pages.numel() <= std::numeric_limits<int32_t>::max(),
               entry_pages.numel(),
               " entries do not fit int32 slots");
  }
  CPKV_CHECK(capacity >= 1, "capacity must be >= 1, got ", capacity);
  CPKV_CHECK(num_requests >= 0, "num_requests must be >= 0, got ", num_requests);
  check_error_counter(errors, entry_pages, "entry_pages");
  const c10::cuda::CUDAGuard device_guard(entry_pages.device());
  const int64_t num_entries = entry_pages.numel();
  const int32_t* slots_in = entry_slots.has_value() ? entry_slots->data_ptr<int32_t>() : nullptr;
  // reference.inverse_table_size: the power of two at or above 2 E, at least 2.
  int64_t table_size = 2;
  while (table_size < 2 * num_entries) table_size *= 2;
  at::Tensor keys = at::empty({table_size}, entry_pages.options().dtype(at::kLong));
  at::Tensor slots = at::empty({table_size}, entry_pages.options().dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(dispatch_index_type(entry_pages,
                                   [&](auto page_id) {
                                     using PageIdT = decltype(page_id);
                                     return sglang_cpkv::build_page_inverse<PageIdT>(entry_pages.data_ptr<PageIdT>(),
                                                                                     entry_req.data_ptr<int64_t>(),
                                                                                     slots_in,
                                                                                     num_entries,
                                                                                     num_requests,
                                                                                     capacity,
                                                                                     table_size,
                                                                                     keys.data_ptr<int64_t>(),
                                                                                     slots.data_ptr<int32_t>(),
                                                                                     errors.data_ptr<int32_t>(),
                                                                                     stream);
                                   }),
               "build_page_inverse");
  return {keys, slots};
}

at::Tensor remap_locs(const at::Tensor& locs,
                      const at::Tensor& req_id,
                      const at::Tensor& inverse_keys,
                      const at::Tensor& inverse_slots,
                      int64_t num_requests,
                      int64_t capacity,
                      int64_t page_size,
                      at::Tensor& errors,
                      const std::optional<at::Tensor>& out) {
  check_cuda_tensor(locs, "locs", locs, "locs");
  check_index_dtype(locs, "locs");
  CPKV_CHECK(locs.dim() == 1 || locs.dim() == 2, "locs must be [N] or [N, K], got shape ", format_dims(locs.sizes()));
  const int64_t num_rows = locs.size(0);
  const int64_t row_len = locs.dim() == 2 ? locs.size(1) : 1;
  CPKV_CHECK(row_len <= 1 || locs.stride(1) == 1,
              "locs must have unit column stride, got strides ",
              format_dims(locs.strides()));
  check_cuda_tensor(req_id, "req_id", locs, "locs");
  CPKV_CHECK(req_id.scalar_type() == at::kLong, "req_id must be int64, got ", req_id.scalar_type());
  CPKV_CHECK(req_id.dim() == 1 && req_id.size(0) == num_rows,
              "req_id must have one id per row of locs: locs ",
              format_dims(locs.sizes()),
              ", req_id ",
              format_dims(req_id.sizes()));
  CPKV_CHECK(req_id.is_contiguous(), "req_id must be contiguous, got stride ", format_dims(req_id.strides()));
  const std::tuple<const at::Tensor*, const char*, at::ScalarType> parts[] = {
      {&inverse_keys, "inverse_keys", at::kLong}, {&inverse_slots, "inverse_slots", at::kInt}};
  for (const auto& [part, name, dtype] : parts) {
    check_cuda_tensor(*part, name, locs, "locs");
    CPKV_CHECK(part->scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ", part->scalar_type());
    CPKV_CHECK(part->dim() == 1 && part->is_contiguous(),
                name,
                " must be a contiguous 1-D tensor, got shape ",
                format_dims(part->sizes()));
  }
  const int64_t table_size = inverse_keys.numel();
  CPKV_CHECK(table_size >= 2 && (table_size & (table_size - 1)) == 0,
              "inverse_keys must hold a power-of-two table of at least 2 cells, got ",
              table_size);
  CPKV_CHECK(inverse_slots.numel() == table_size,
              "inverse_slots must hold one slot per cell of inverse_keys (",
              table_size,
              "), got ",
              inverse_slots.numel());
  CPKV_CHECK(num_requests >= 0, "num_requests must be >= 0, got ", num_requests);
  CPKV_CHECK(capacity > 0, "capacity must be > 0, got ", capacity);
  CPKV_CHECK(page_size > 0, "page_size must be > 0, got ", page_size);
  check_error_counter(errors, locs, "locs");
  const c10::cuda::CUDAGuard device_guard(locs.device());
  // out may be locs itself (in place): each thread loads its locations before it stores their results.
  if (out.has_value()) {
    check_cuda_tensor(*out, "out", locs, "locs");
    CPKV_CHECK(out->scalar_type() == at::kInt && out->sizes() == locs.sizes() && out->is_contiguous(),
               "out must be a contiguous int32 tensor of the shape of locs ", format_dims(locs.sizes()), ", got ",
               out->scalar_type(), format_dims(out->sizes()));
  }
  at::Tensor dense_locs = out.has_value() ? *out : at::empty(locs.sizes(), locs.options().dtype(at::kInt));
  const int64_t locs_row_stride = locs.stride(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t status = dispatch_index_type(locs, [&](auto loc) {
    using LocT = decltype(loc);
    return sglang_cpkv::remap_locs<LocT>(locs.data_ptr<LocT>(),
                                         num_rows,
                                         row_len,
                                         locs_row_stride,
                                         req_id.data_ptr<int64_t>(),
                                         inverse_keys.data_ptr<int64_t>(),
                                         inverse_slots.data_ptr<int32_t>(),
                                         table_size,
                                         num_requests,
                                         capacity,
                                         page_size,
                                         dense_locs.data_ptr<int32_t>(),
                                         errors.data_ptr<int32_t>(),
                                         stream);
  });
  check_launch(status, "remap_locs");
  return dense_locs;
}

void copy_pages(const at::Tensor& src,
                const at::Tensor& src_page,
                at::Tensor& dst,
                const at::Tensor& dst_page,
                at::Tensor& errors) {
  const int64_t page_bytes = check_row_operands(src, dst, "pages");
  check_page_pairs(src_page, dst_page, src, "src");
  check_error_counter(errors, src, "src");
  const c10::cuda::CUDAGuard device_guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t element = static_cast<int64_t>(src.element_size());
  const cudaError_t status = dispatch_index_type(src_page, [&](auto page_id) {
    using PageIdT = decltype(page_id);
    return sglang_cpkv::copy_pages<PageIdT>(src.data_ptr(),
                                            src.size(0),
                                            src.stride(0) * element,
                                            src_page.data_ptr<PageIdT>(),
                                            dst.data_ptr(),
                                            dst.size(0),
                                            dst.stride(0) * element,
                                            dst_page.data_ptr<PageIdT>(),
                                            src_page.numel(),
                                            page_bytes,
                                            errors.data_ptr<int32_t>(),
                                            stream);
  });
  check_launch(status, "copy_pages");
}

void scatter_rows(const at::Tensor& src, const at::Tensor& dst_loc, at::Tensor& dst, at::Tensor& errors) {
  const int64_t row_bytes = check_row_operands(src, dst, "rows");
  check_cuda_tensor(dst_loc, "dst_loc", src, "src");
  check_index_vector(dst_loc, "dst_loc", src.size(0), "src row");
  check_error_counter(errors, src, "src");
  const c10::cuda::CUDAGuard device_guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t element = static_cast<int64_t>(src.element_size());
  const cudaError_t status = dispatch_index_type(dst_loc, [&](auto loc) {
    using LocT = decltype(loc);
    return sglang_cpkv::scatter_rows<LocT>(src.data_ptr(),
                                           src.size(0),
                                           src.stride(0) * element,
                                           dst_loc.data_ptr<LocT>(),
                                           dst.data_ptr(),
                                           dst.size(0),
                                           dst.stride(0) * element,
                                           row_bytes,
                                           errors.data_ptr<int32_t>(),
                                           stream);
  });
  check_launch(status, "scatter_rows");
}

template <typename PageIdT, typename LocT>
cudaError_t call_materialize_and_fill(const at::Tensor& pool,
                                      const at::Tensor& src_page,
                                      at::Tensor& dense,
                                      const at::Tensor& dst_page,
                                      const at::Tensor& current,
                                      const at::Tensor& dst_loc,
                                      at::Tensor& errors,
                                      int64_t page_bytes,
                                      int64_t row_bytes,
                                      cudaStream_t stream) {
  const int64_t element = static_cast<int64_t>(pool.element_size());
  return sglang_cpkv::materialize_and_fill<PageIdT, LocT>(pool.data_ptr(),
                                                          pool.size(0),
                                                          pool.stride(0) * element,
                                                          src_page.data_ptr<PageIdT>(),
                                                          dst_page.data_ptr<PageIdT>(),
                                                          src_page.numel(),
                                                          current.data_ptr(),
                                                          current.size(0),
                                                          current.stride(0) * element,
                                                          dst_loc.data_ptr<LocT>(),
                                                          dense.data_ptr(),
                                                          dense.size(0),
                                                          page_bytes,
                                                          row_bytes,
                                                          errors.data_ptr<int32_t>(),
                                                          stream);
}

void materialize_and_fill(const at::Tensor& pool,
                          const at::Tensor& src_page,
                          at::Tensor& dense,
                          const at::Tensor& dst_page,
                          const at::Tensor& current,
                          const at::Tensor& dst_loc,
                          at::Tensor& errors) {
  check_cuda_tensor(pool, "pool", pool, "pool");
  check_cuda_tensor(dense, "dense", pool, "pool");
  check_cuda_tensor(current, "current", pool, "pool");
  check_same_rows(pool, "pool", dense, "dense");
  CPKV_CHECK(current.scalar_type() == pool.scalar_type(),
              "current and pool must have one dtype, got ",
              current.scalar_type(),
              " and ",
              pool.scalar_type());
  const int64_t page_bytes = contiguous_row_bytes(pool, "pool");
  CPKV_CHECK(dense.is_contiguous(),
              "dense must be contiguous (its row view is dense.view(-1, D)), got strides ",
              format_dims(dense.strides()));
  const int64_t row_bytes = contiguous_row_bytes(current, "current");
  CPKV_CHECK(row_bytes > 0 && page_bytes % row_bytes == 0,
              "a page of pool (",
              page_bytes,
              " bytes) must be a whole number of current rows (",
              row_bytes,
              " bytes)");
  check_page_pairs(src_page, dst_page, pool, "pool");
  check_cuda_tensor(dst_loc, "dst_loc", pool, "pool");
  check_index_vector(dst_loc, "dst_loc", current.size(0), "current row");
  check_error_counter(errors, pool, "pool");
  const c10::cuda::CUDAGuard device_guard(pool.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t status = dispatch_index_type(src_page, [&](auto page_id) {
    return dispatch_index_type(dst_loc, [&](auto loc) {
      return call_materialize_and_fill<decltype(page_id), decltype(loc)>(
          pool, src_page, dense, dst_page, current, dst_loc, errors, page_bytes, row_bytes, stream);
    });
  });
  check_launch(status, "materialize_and_fill");
}
at::Tensor current_dense_locs(const at::Tensor& token_ends,
                              const at::Tensor& dense_offsets,
                              const at::Tensor& out_cache_loc,
                              const at::Tensor& slot_pages,
                              int64_t page_size,
                              at::Tensor& errors) {
  check_cuda_tensor(out_cache_loc, "out_cache_loc", out_cache_loc, "out_cache_loc");
  check_index_vector(out_cache_loc, "out_cache_loc", out_cache_loc.numel(), "current token");
  const int64_t num_requests = token_ends.numel();
  CPKV_CHECK(num_requests >= 1, "token_ends must hold one value per request (R >= 1), got none");
  const std::pair<const at::Tensor*, const char*> per_request[] = {{&token_ends, "token_ends"},
                                                                   {&dense_offsets, "dense_offsets"}};
  for (const auto& [part, name] : per_request) {
    check_cuda_tensor(*part, name, out_cache_loc, "out_cache_loc");
    CPKV_CHECK(part->scalar_type() == at::kLong, name, " must be int64, got ", part->scalar_type());
    check_index_vector(*part, name, num_requests, "request of token_ends");
  }
  check_cuda_tensor(slot_pages, "slot_pages", out_cache_loc, "out_cache_loc");
  CPKV_CHECK(slot_pages.scalar_type() == at::kInt, "slot_pages must be int32, got ", slot_pages.scalar_type());
  check_index_vector(slot_pages, "slot_pages", slot_pages.numel(), "dense slot");
  CPKV_CHECK(page_size > 0, "page_size must be > 0, got ", page_size);
  check_error_counter(errors, out_cache_loc, "out_cache_loc");
  const c10::cuda::CUDAGuard device_guard(out_cache_loc.device());
  at::Tensor dense_locs = at::empty({out_cache_loc.numel()}, out_cache_loc.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(dispatch_index_type(out_cache_loc,
                                   [&](auto loc) {
                                     using LocT = decltype(loc);
                                     return sglang_cpkv::current_dense_locs<LocT>(token_ends.data_ptr<int64_t>(),
                                                                                  dense_offsets.data_ptr<int64_t>(),
                                                                                  num_requests,
                                                                                  out_cache_loc.data_ptr<LocT>(),
                                                                                  out_cache_loc.numel(),
                                                                                  slot_pages.data_ptr<int32_t>(),
                                                                                  slot_pages.numel(),
                                                                                  page_size,
                                                                                  dense_locs.data_ptr<int64_t>(),
                                                                                  errors.data_ptr<int32_t>(),
                                                                                  stream);
                                   }),
               "current_dense_locs");
  return dense_locs;
}


}  // namespace torch_ops
}  // namespace sglang_cpkv

TORCH_LIBRARY(sglang_cpkv, m) {
  // Per batch: the page, request and dense slot (default: its index) of every page-table entry -> per-request
  // inverse (keys int64 [T]: r * C + page or -1, slots int32 [T]; T the power of two at or above 2 E, at least 2);
  // counts bad and repeated page ids, negative slots and bad request ids.
  m.def(
      "build_page_inverse(Tensor entry_pages, Tensor entry_req, int num_requests, int capacity, Tensor(a!) errors, "
      "Tensor? entry_slots=None) -> (Tensor, Tensor)");
  // Per batch / per layer: pool locations [N] or [N, K] of request req_id[n] -> dense locations (int32).
  m.def(
      "remap_locs(Tensor locs, Tensor req_id, Tensor inverse_keys, Tensor inverse_slots, int num_requests, "
      "int capacity, int page_size, Tensor(a!) errors, Tensor(b!)? out=None) -> Tensor");
  // Per batch: each current token's dense location (int64) from per-request token ends and offsets; counts the
  // tokens whose out_cache_loc is not their dense slot's page location.
  m.def(
      "current_dense_locs(Tensor token_ends, Tensor dense_offsets, Tensor out_cache_loc, Tensor slot_pages, "
      "int page_size, Tensor(a!) errors) -> Tensor");
  // Per layer: dst[dst_page[i]] = src[src_page[i]], whole pages, in place.
  m.def("copy_pages(Tensor src, Tensor src_page, Tensor(a!) dst, Tensor dst_page, Tensor(b!) errors) -> ()");
  // Per layer: dst[dst_loc[i]] = src[i], rows, in place.
  m.def("scatter_rows(Tensor src, Tensor dst_loc, Tensor(a!) dst, Tensor(b!) errors) -> ()");
  // Per layer: copy_pages(pool -> dense) then scatter_rows(current -> dense rows), current rows winning.
  m.def(
      "materialize_and_fill(Tensor pool, Tensor src_page, Tensor(a!) dense, Tensor dst_page, Tensor current, "
      "Tensor dst_loc, Tensor(b!) errors) -> ()");
}

TORCH_LIBRARY_IMPL(sglang_cpkv, CUDA, m) {
  m.impl("build_page_inverse", &sglang_cpkv::torch_ops::build_page_inverse);
  m.impl("remap_locs", &sglang_cpkv::torch_ops::remap_locs);
  m.impl("current_dense_locs", &sglang_cpkv::torch_ops::current_dense_locs);
  m.impl("copy_pages", &sglang_cpkv::torch_ops::copy_pages);
  m.impl("scatter_rows", &sglang_cpkv::torch_ops::scatter_rows);
  m.impl("materialize_and_fill", &sglang_cpkv::torch_ops::materialize_and_fill);
}
