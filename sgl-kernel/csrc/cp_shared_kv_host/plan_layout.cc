// The CP shared-KV plan's host layout, compiled: the dense layout of a batch and the staging buffer its device work
// reads, in two calls of plain C (loaded with ctypes; no torch, no Python headers).
//
// The contract is python/sglang_cpkv/runtime/plan.py's numpy layout (module docstring there: the history region,
// own slots, shared history slots, the pool and view copies, the current tokens' offsets); this file computes the
// same arrays in a few linear passes over the entries instead of some forty numpy calls (about half of the mode's
// per-batch host cost at 64 requests). The numpy functions stay the reference: the tests compare every staged byte.
//
// cpkv_plan_layout: the layout into this thread's scratch; returns the sizes the caller needs to size the staging.
// cpkv_plan_pack:   the staging buffer (int64 part, then int32 part) and the host copy of the entries' slots.
// The two calls run back to back on one thread (the plan builds a batch on the scheduler's thread).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Sizes of the last layout (cpkv_plan_layout's `sizes` output, in this order).
enum Size : int64_t {
  kEntries = 0,  // E
  kRegion,       // H: history-region slots
  kOwn,          // O: own slots
  kPoolCopies,   // pool pages copied into the view by this rank
  kViewCopies,   // view-to-view copies (under CP)
  kBadRequest,   // first request with a bad or repeated page id (host validation), else -1
  kLayoutId,     // this layout's number on its thread: its staging must name it
  kNumSizes,
};

// Entry flags.
constexpr uint8_t kFlagWrites = 1;      // takes current tokens
constexpr uint8_t kFlagHistory = 2;     // holds history rows
constexpr uint8_t kFlagShared = 4;      // history only: its page's region slot

// A page id's generation stamps: one cache line serves the region pass's two reads of a page.
struct PageMarks {
  uint32_t written;    // == the call's stamp: some entry writes current tokens into the page
  uint32_t in_region;  // == the call's stamp: the page is in the history region
};

struct Scratch {
  // Per page id (capacity + 1: the last is the bad-id bucket): generation stamps, so nothing is cleared per call.
  std::vector<PageMarks> marks;
  std::vector<uint32_t> seen;
  std::vector<int32_t> region_slot;  // read at region pages only
  uint32_t generation = 0;
  // The last layout. Per-entry arrays only grow (a shrink and regrow would zero them again on every call): their
  // lengths are the sizes below.
  std::vector<int64_t> pages, entry_slots, region, block_counts;
  std::vector<uint8_t> flags;
  std::vector<int32_t> entry_req, own_entries, own_history;  // own_*: entry numbers, in entry order
  std::vector<int64_t> token_ends, dense_offsets;
  std::vector<int64_t> pages_needed;
  int64_t num_requests = 0, width = 0, cp_size = 1, cp_rank = 0, num_own_history = 0;
  int64_t sizes[kNumSizes] = {};
  bool pages_known = false;
};

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

thread_local Scratch scratch;

// Stamps for this call: `count` consecutive values no mark holds yet (the marks restart from zero on wrap-around).
uint32_t next_stamps(Scratch& s, uint32_t count) {
  if (s.generation > UINT32_MAX - count - 1) {
    std::fill(s.marks.begin(), s.marks.end(), PageMarks{0, 0});
    std::fill(s.seen.begin(), s.seen.end(), 0);
    s.generation = 0;
  }
  const uint32_t first = s.generation + 1;
  s.generation += count;
  return first;
}

// The entries' page ids (outside [0, C): C, the bad-id bucket, never shared), requests and flags, and the pages
// written this call marked, request by request. Request r's entries from page index prefix / page_size on take
// current tokens (none without current tokens); those below ceil(prefix / page_size) hold history rows. With
// `validate`, returns the first request with an id outside [0, C) or repeated (seen[id] == stamp + r marks "seen in
// request r").
template <typename T>
int64_t read_entries(const T* table, Scratch& s, const int64_t* starts, const int64_t* prefix, const int64_t* extend,
                     int64_t page_size, int64_t capacity, bool validate, uint32_t stamp) {
  int64_t bad_request = -1;
  int64_t* pages = s.pages.data();
  uint8_t* flags = s.flags.data();
  int32_t* entry_req = s.entry_req.data();
  uint32_t* seen = s.seen.data();
  PageMarks* marks = s.marks.data();
  const int64_t width = s.width, num_requests = s.num_requests;
  const int64_t* pages_needed = s.pages_needed.data();
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t n = pages_needed[r], start = starts[r];
    int64_t* out = pages + start;
    if (table == nullptr) {
      std::fill(out, out + n, capacity);
    } else if (validate && bad_request < 0) {
      const T* row = table + r * width;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t id = static_cast<int64_t>(row[j]);
        const bool inside = id >= 0 && id < capacity;
        out[j] = inside ? id : capacity;
        if (!inside || seen[id] == stamp + r) {
          bad_request = r;
        } else {
          seen[id] = stamp + static_cast<uint32_t>(r);
        }
      }
    } else {
      const T* row = table + r * width;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t id = static_cast<int64_t>(row[j]);
        out[j] = id >= 0 && id < capacity ? id : capacity;
      }
    }
    // Flags by ranges of page index: [0, hp) history, [fw, n) writes (fw <= hp whenever the request extends).
    const int64_t fw = extend[r] > 0 ? prefix[r] / page_size : n;
    const int64_t hp = std::min<int64_t>((prefix[r] + page_size - 1) / page_size, n);
    uint8_t* f = flags + start;
    std::fill(f, f + std::min(fw, hp), kFlagHistory);
    if (fw < hp) std::fill(f + fw, f + hp, kFlagWrites | kFlagHistory);
    if (hp < fw) std::fill(f + hp, f + fw, 0);
    std::fill(f + std::max(fw, hp), f + n, kFlagWrites);
    std::fill(entry_req + start, entry_req + start + n, static_cast<int32_t>(r));
    for (int64_t j = fw; j < n; ++j) marks[out[j]].written = stamp;
  }
  return bad_request;
}

}  // namespace

extern "C" {

// The layout of one batch (numpy reference: plan._NumpyLayout). `table`: the host page table, row-major
// [R, width] of `table_itemsize` (4 or 8) bytes, or null when the page ids are not on the host (a device table and
// no history: every entry its own slot). `pages_needed`: n_r per request. `validate`: check the table's ids
// (in [0, C), distinct within a request). Writes `sizes` [kNumSizes], `entry_starts` [R] and `block_counts`
// [cp_size] (each rank's history-region pages). Returns 0, or -1 for an unsupported table itemsize.
int64_t cpkv_plan_layout(const void* table,
                         int64_t table_itemsize,
                         int64_t width,
                         int64_t num_requests,
                         const int64_t* prefix,
                         const int64_t* extend,
                         const int64_t* pages_needed,
                         int64_t page_size,
                         int64_t cp_size,
                         int64_t cp_rank,
                         int64_t capacity,
                         int64_t validate,
                         int64_t* sizes,
                         int64_t* entry_starts,
                         int64_t* block_counts) {
  if (table != nullptr && table_itemsize != 4 && table_itemsize != 8) return -1;
  Scratch& s = scratch;
  s.num_requests = num_requests;
  s.width = width;
  s.cp_size = cp_size;
  s.cp_rank = cp_rank;
  s.pages_known = table != nullptr;
  s.pages_needed.assign(pages_needed, pages_needed + num_requests);

  int64_t entries = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    entry_starts[r] = entries;
    entries += pages_needed[r];
  }
  const size_t num_marks = static_cast<size_t>(capacity) + 1;
  if (s.marks.size() < num_marks) {
    s.marks.resize(num_marks, PageMarks{0, 0});
    s.seen.resize(num_marks, 0);
    s.region_slot.resize(num_marks, 0);
  }
  // This call's stamps: `gen` marks written and in_region pages, gen + r the pages seen in request r.
  const uint32_t gen = next_stamps(s, static_cast<uint32_t>(num_requests) + 1);

  at_least(s.pages, entries);
  uint8_t* flags = at_least(s.flags, entries);
  at_least(s.entry_req, entries);
  int64_t bad_request = -1;
  if (table == nullptr || table_itemsize == 4) {
    bad_request = read_entries(static_cast<const int32_t*>(table), s, entry_starts, prefix, extend, page_size,
                               capacity, validate, gen);
  } else {
    bad_request = read_entries(static_cast<const int64_t*>(table), s, entry_starts, prefix, extend, page_size,
                               capacity, validate, gen);
  }
  const int64_t* pages = s.pages.data();
  PageMarks* marks = s.marks.data();

  // The region: at cp 1 the shared entries' pages, under CP every page read as history; ordered by (owner, page id)
  // (a scan of the marks in page-id order, then a stable partition by owner).
  int64_t marked = 0, own = 0, own_history = 0;
  int32_t* own_entries = at_least(s.own_entries, entries);
  int32_t* own_history_entries = at_least(s.own_history, entries);
  const uint8_t region_flag = cp_size == 1 ? kFlagShared : kFlagHistory;
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t page = pages[e];
    const bool fetchable = page < capacity;
    uint8_t f = flags[e];
    const bool shared = !(f & kFlagWrites) && fetchable && marks[page].written != gen;
    const bool holds_history = !shared && (f & kFlagHistory) && fetchable;
    f |= (shared ? kFlagShared : 0);
    flags[e] = f;
    own_entries[own] = static_cast<int32_t>(e);  // branch-free appends: the slot is overwritten unless kept
    own += !shared;
    own_history_entries[own_history] = static_cast<int32_t>(e);
    own_history += holds_history;
    if ((f & region_flag) && fetchable && marks[page].in_region != gen) {
      marks[page].in_region = gen;
      ++marked;
    }
  }
  s.num_own_history = own_history;
  int64_t* region = at_least(s.region, marked);
  s.block_counts.assign(cp_size, 0);
  int64_t found = 0;
  for (int64_t page = 0; found < marked; ++page) {
    if (marks[page].in_region == gen) region[found++] = page;
  }
  if (cp_size > 1) {  // a stable partition by owner
    const std::vector<int64_t> by_page(region, region + marked);
    for (int64_t page : by_page) ++s.block_counts[page % cp_size];
    std::vector<int64_t> next(cp_size, 0);
    for (int64_t k = 1; k < cp_size; ++k) next[k] = next[k - 1] + s.block_counts[k - 1];
    for (int64_t page : by_page) region[next[page % cp_size]++] = page;
  }
  int32_t* region_slot = s.region_slot.data();
  for (int64_t i = 0; i < marked; ++i) region_slot[region[i]] = static_cast<int32_t>(i);

  // Slots: a shared entry its page's region slot, every other entry an own slot after the region, in entry order.
  int64_t* entry_slots = at_least(s.entry_slots, entries);
  int64_t next_own = marked;
  for (int64_t e = 0; e < entries; ++e) {
    const bool shared = flags[e] & kFlagShared;
    entry_slots[e] = shared ? region_slot[pages[e]] : next_own;
    next_own += !shared;
  }

  // The current tokens: request r's token t (batch order) is at dense location t + dense_offsets[r].
  s.token_ends.resize(num_requests);
  s.dense_offsets.assign(num_requests, 0);
  int64_t end = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    end += extend[r];
    s.token_ends[r] = end;
    if (extend[r] > 0) {
      const int64_t first = entry_slots[entry_starts[r] + prefix[r] / page_size] * page_size + prefix[r] % page_size;
      s.dense_offsets[r] = first - (end - extend[r]);
    }
  }

  s.sizes[kEntries] = entries;
  s.sizes[kRegion] = marked;
  s.sizes[kOwn] = own;
  s.sizes[kPoolCopies] = cp_size == 1 ? marked + own_history : s.block_counts[cp_rank];
  s.sizes[kViewCopies] = cp_size == 1 ? 0 : own_history;
  s.sizes[kBadRequest] = bad_request;
  s.sizes[kLayoutId] = gen;
  std::memcpy(sizes, s.sizes, sizeof(s.sizes));
  std::memcpy(block_counts, s.block_counts.data(), sizeof(int64_t) * cp_size);
  return 0;
}

// The staging of the last layout (numpy reference: plan._NumpyLayout.fill):
//   int64 [num_slots]  slot_req (the region's slots -1, each own slot's request, the rounding -1)
//         [E]          entry_req
//         [R]          token_ends, then [R] dense_offsets
//         [E]          the entries' cells r * width + j (only when the page ids are not on the host)
//   int32 [num_errors] zeros (the error counter)
//         [E]          entry_slots
//         [P]          pool copy pages (this rank's pool pages), then [P] their slots
//         [V]          view copy sources, then [V] destinations (under CP)
//         [E]          the entries' page ids, then [num_slots] slot_pages (only when the page ids are on the host)
// and the entries' slots as int64 into `entry_slots_host` [E]. `layout_id`: the layout's kLayoutId. Returns the bytes
// written, -1 when `num_slots` is below the layout's slots, -2 when another layout was made on this thread since.
int64_t cpkv_plan_pack(int64_t layout_id, int64_t num_slots, int64_t num_errors, void* buffer, int64_t* entry_slots_host) {
  const Scratch& s = scratch;
  const int64_t entries = s.sizes[kEntries], region = s.sizes[kRegion], own = s.sizes[kOwn];
  const int64_t requests = s.num_requests, cp_size = s.cp_size;
  if (layout_id != s.sizes[kLayoutId]) return -2;
  if (num_slots < region + own) return -1;
  const int64_t* pages = s.pages.data();
  const int64_t* entry_slots = s.entry_slots.data();

  const int32_t* entry_req = s.entry_req.data();
  const int64_t pad = num_slots - region - own;

  int64_t* p = static_cast<int64_t*>(buffer);
  std::fill(p, p + region, -1);
  p += region;
  const int32_t* own_entries = s.own_entries.data();
  const int32_t* own_history = s.own_history.data();
  const int64_t* region_pages = s.region.data();
  for (int64_t i = 0; i < own; ++i) *p++ = entry_req[own_entries[i]];
  std::fill(p, p + pad, -1);
  p += pad;
  for (int64_t e = 0; e < entries; ++e) *p++ = entry_req[e];
  std::memcpy(p, s.token_ends.data(), sizeof(int64_t) * requests);
  p += requests;
  std::memcpy(p, s.dense_offsets.data(), sizeof(int64_t) * requests);
  p += requests;
  if (!s.pages_known) {
    for (int64_t r = 0; r < requests; ++r) {
      for (int64_t j = 0; j < s.pages_needed[r]; ++j) *p++ = r * s.width + j;
    }
  }

  int32_t* q = reinterpret_cast<int32_t*>(p);
  std::fill(q, q + num_errors, 0);
  q += num_errors;
  for (int64_t e = 0; e < entries; ++e) *q++ = static_cast<int32_t>(entry_slots[e]);
  if (cp_size == 1) {  // the region's pages, then the own entries' history pages, straight from the pool
    for (int64_t i = 0; i < region; ++i) *q++ = static_cast<int32_t>(region_pages[i]);
    for (int64_t i = 0; i < s.num_own_history; ++i) *q++ = static_cast<int32_t>(pages[own_history[i]]);
    for (int64_t i = 0; i < region; ++i) *q++ = static_cast<int32_t>(i);
    for (int64_t i = 0; i < s.num_own_history; ++i) *q++ = static_cast<int32_t>(entry_slots[own_history[i]]);
  } else {  // this rank's block of the region, at its owner pool pages; then the region into own slots
    int64_t start = 0;
    for (int64_t k = 0; k < s.cp_rank; ++k) start += s.block_counts[k];
    const int64_t count = s.block_counts[s.cp_rank];
    for (int64_t i = start; i < start + count; ++i) *q++ = static_cast<int32_t>(region_pages[i] / cp_size);
    for (int64_t i = start; i < start + count; ++i) *q++ = static_cast<int32_t>(i);
    for (int64_t i = 0; i < s.num_own_history; ++i) *q++ = s.region_slot[pages[own_history[i]]];
    for (int64_t i = 0; i < s.num_own_history; ++i) *q++ = static_cast<int32_t>(entry_slots[own_history[i]]);
  }
  if (s.pages_known) {
    for (int64_t e = 0; e < entries; ++e) *q++ = static_cast<int32_t>(pages[e]);
    for (int64_t i = 0; i < region; ++i) *q++ = static_cast<int32_t>(region_pages[i]);
    for (int64_t i = 0; i < own; ++i) *q++ = static_cast<int32_t>(pages[own_entries[i]]);
    std::fill(q, q + pad, -1);
    q += pad;
  }
  std::memcpy(entry_slots_host, entry_slots, sizeof(int64_t) * entries);
  return reinterpret_cast<char*>(q) - static_cast<char*>(buffer);
}

}  // extern "C"
