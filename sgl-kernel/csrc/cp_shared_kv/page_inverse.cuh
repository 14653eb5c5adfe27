// The per-request inverse's hash table, shared by its build (build_page_inverse.cu) and its lookups
// (remap_locs.cu): the same cells as python/sglang_cpkv/ops/reference.py (EMPTY_KEY, HASH_MULTIPLIER, hash_cells).
#pragma once

#include <cstdint>

namespace sglang_cpkv {
namespace detail {

// The key of a cell no entry holds; a held cell's key is r * C + page >= 0.
constexpr int64_t kEmptyKey = -1;
// Under 2^31, so (low 32 bits) x multiplier + high bits stays inside int64 (no overflow, as the reference).
constexpr int64_t kHashMultiplier = 0x5BD1E995;

/// The home cell of key in a table of table_mask + 1 cells (a power of two).
/// (The low 32 bits times the multiplier is one 32 x 32 -> 64-bit multiply.)
__device__ __forceinline__ int64_t home_cell(int64_t key, int64_t table_mask) {
  const uint64_t low_product = static_cast<uint64_t>(static_cast<uint32_t>(key)) * static_cast<uint32_t>(kHashMultiplier);
  const int64_t mixed = static_cast<int64_t>(low_product) + (key >> 32);
  return (mixed ^ (mixed >> 32)) & table_mask;
}

}  // namespace detail
}  // namespace sglang_cpkv
