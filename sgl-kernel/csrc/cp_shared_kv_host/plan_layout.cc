// The CP shared-KV plan's host layout, compiled: the dense layout of a batch and the staging buffer its device work
// reads, in two calls of plain C (loaded with ctypes; no torch, no Python headers).
//
// The contract is python/sglang_cpkv/runtime/plan.py's numpy layout (module docstring there: the history region,
// own slots, shared history slots, the pool and view copies, the current tokens' offsets); this file computes the
// same arrays in a few linear passes over the entries instead of some forty numpy calls. The numpy functions stay the
// reference: the tests compare every staged byte.
//
// The plan runs once per batch between upstream's own per-batch work, so its memory is cold: sets of page ids are
// bit sets (a bit per page id: 1.2 KB for 9,216 pages, where a 4- or 8-byte mark per page would be 37-74 KB of
// cache misses), a page's region slot is a rank in its bit set (a prefix count per 64-bit word and a popcount), and
// the per-entry arrays are int32.
//
// cpkv_plan_layout: the layout into this thread's scratch; returns the sizes the caller needs to size the staging.
// cpkv_plan_pack:   the staging buffer (int64 part, then int32 part).
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

// cpkv_plan_layout's refusals.
constexpr int64_t kBadItemsize = -1;     // a page table of ids neither 4 nor 8 bytes wide
constexpr int64_t kTooManyEntries = -2;  // 2^30 entries or more (plan.MAX_ENTRIES: every slot must fit int32)

// Entry flags.
constexpr uint8_t kFlagWrites = 1;       // takes current tokens
constexpr uint8_t kFlagHistory = 2;      // holds history rows
constexpr uint8_t kFlagShared = 4;       // history only: its page's region slot

// A set of keys in [0, n): 64 per word; `before[w]` counts the keys of the words before w once ranked.
struct BitSet {
  std::vector<uint64_t> words;
  std::vector<int32_t> before;

  void fit(int64_t n) {
    const size_t w = static_cast<size_t>((n + 63) / 64);
    if (words.size() < w) {
      words.resize(w, 0);
      before.resize(w, 0);
    }
  }
  // The keys below k (after rank()).
  int32_t rank_of(int64_t k) const {
    return before[k >> 6] + __builtin_popcountll(words[k >> 6] & ((uint64_t{1} << (k & 63)) - 1));
  }
  // Prefix counts of the words [0, num_words); returns the keys held.
  int64_t rank(int64_t num_words) {
    int32_t held = 0;
    for (int64_t w = 0; w < num_words; ++w) {
      before[w] = held;
      held += __builtin_popcountll(words[w]);
    }
    return held;
  }
};

struct Scratch {
  BitSet written;  // page ids some entry writes current tokens into (capacity + 1: the last is the bad-id bucket)
  BitSet region;   // region keys: (page % cp) * (C / cp) + page / cp, i.e. (owner rank, owner pool page) order
  // Validation only (host tables): seen[id] == stamp + r marks "seen in request r", so nothing is cleared per call.
  std::vector<uint32_t> seen;
  uint32_t generation = 0;
  // The last layout. Per-entry arrays only grow (a shrink and regrow would zero them again on every call): their
  // lengths are the sizes below. keys: under CP, each region entry's region key (at cp 1 the key is the page id).
  std::vector<int32_t> pages, keys, entry_slots, region_keys, own_entries, own_history;  // own_*: entry numbers
  std::vector<uint8_t> flags;
  std::vector<int64_t> token_ends, dense_offsets, block_counts, pages_needed;
  int64_t num_requests = 0, width = 0, cp_size = 1, cp_rank = 0, capacity = 0, num_own_history = 0;
  int64_t sizes[kNumSizes] = {};
  bool pages_known = false;

  // The page id of a region key.
  int64_t page_of(int64_t key) const {
    if (cp_size == 1) return key;
    const int64_t per_rank = capacity / cp_size;
    return (key % per_rank) * cp_size + key / per_rank;
  }
};

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

thread_local Scratch scratch;

// Validation stamps for this call: `count` consecutive values no entry of `seen` holds yet.
uint32_t next_stamps(Scratch& s, uint32_t count) {
  if (s.generation > UINT32_MAX - count - 1) {
    std::fill(s.seen.begin(), s.seen.end(), 0);
    s.generation = 0;
  }
  const uint32_t first = s.generation + 1;
  s.generation += count;
  return first;
}

// The entries' page ids (outside [0, C): C, the bad-id bucket, never shared) and flags, and the pages written this
// call, request by request. Request r's entries from page index prefix / page_size on take current tokens (none
// without current tokens); those below ceil(prefix / page_size) hold history rows. With `validate`, returns the
// first request with an id outside [0, C) or repeated.
template <typename T>
int64_t read_entries(const T* table, Scratch& s, const int64_t* starts, const int64_t* prefix, const int64_t* extend,
                     int64_t page_size, bool validate) {
  int64_t bad_request = -1;
  const int64_t capacity = s.capacity;
  int32_t* pages = s.pages.data();
  uint8_t* flags = s.flags.data();
  uint64_t* written = s.written.words.data();
  const uint32_t stamp = validate ? next_stamps(s, static_cast<uint32_t>(s.num_requests)) : 0;
  const int64_t width = s.width, num_requests = s.num_requests;
  const int64_t* pages_needed = s.pages_needed.data();
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t n = pages_needed[r], start = starts[r];
    int32_t* out = pages + start;
    if (table == nullptr) {
      std::fill(out, out + n, static_cast<int32_t>(capacity));
    } else if (validate && bad_request < 0) {
      const T* row = table + r * width;
      uint32_t* seen = s.seen.data();
      for (int64_t j = 0; j < n; ++j) {
        const int64_t id = static_cast<int64_t>(row[j]);
        const bool inside = id >= 0 && id < capacity;
        out[j] = static_cast<int32_t>(inside ? id : capacity);
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
        out[j] = static_cast<int32_t>(id >= 0 && id < capacity ? id : capacity);
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
    for (int64_t j = fw; j < n; ++j) written[out[j] >> 6] |= uint64_t{1} << (out[j] & 63);
  }
  return bad_request;
}

}  // namespace

extern "C" {

// The layout of one batch (numpy reference: plan._NumpyLayout). `table`: the host page table, row-major
// [R, width] of `table_itemsize` (4 or 8) bytes, or null when the page ids are not on the host (a device table and
// no history: every entry its own slot). `pages_needed`: n_r per request. `validate`: check the table's ids
// (in [0, C), distinct within a request). Under CP `capacity` is a multiple of `cp_size` (the plan checks it).
// Writes `sizes` [kNumSizes], `entry_starts` [R] and `block_counts` [cp_size] (each rank's history-region pages).
// Returns 0, kBadItemsize or kTooManyEntries.
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
  if (table != nullptr && table_itemsize != 4 && table_itemsize != 8) return kBadItemsize;
  Scratch& s = scratch;
  // The last layout's region bits (kept for its staging), cleared: this layout starts from empty sets.
  for (int64_t i = 0; i < s.sizes[kRegion]; ++i) s.region.words[s.region_keys[i] >> 6] = 0;
  s.sizes[kRegion] = 0;
  s.sizes[kLayoutId] += 1;  // first: no earlier layout stages from here on, even if this call refuses the batch
  int64_t entries = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    entry_starts[r] = entries;
    entries += pages_needed[r];
  }
  if (entries >= (int64_t{1} << 30)) return kTooManyEntries;  // own slots and region slots both below 2^31
  s.num_requests = num_requests;
  s.width = width;
  s.cp_size = cp_size;
  s.cp_rank = cp_rank;
  s.capacity = capacity;
  s.pages_known = table != nullptr;
  s.pages_needed.assign(pages_needed, pages_needed + num_requests);
  s.written.fit(capacity + 1);
  s.region.fit(capacity);
  if (validate && s.seen.size() < static_cast<size_t>(capacity)) s.seen.resize(capacity, 0);

  at_least(s.pages, entries);
  uint8_t* flags = at_least(s.flags, entries);
  const int64_t written_words = (capacity + 1 + 63) / 64;
  int64_t bad_request = -1;
  if (table == nullptr || table_itemsize == 4) {
    bad_request = read_entries(static_cast<const int32_t*>(table), s, entry_starts, prefix, extend, page_size,
                               validate != 0);
  } else {
    bad_request = read_entries(static_cast<const int64_t*>(table), s, entry_starts, prefix, extend, page_size,
                               validate != 0);
  }
  const int32_t* pages = s.pages.data();

  // Which entries share their page's region slot, which pages the region holds (at cp 1 the shared entries' pages,
  // under CP every page read as history), and the own entries and those of them holding history, in entry order.
  int64_t own = 0, own_history = 0;
  int32_t* keys = at_least(s.keys, cp_size == 1 ? 0 : entries);
  int32_t* own_entries = at_least(s.own_entries, entries);  // appended to where taken: a few cache lines per request
  int32_t* own_history_entries = at_least(s.own_history, entries);
  const uint64_t* written = s.written.words.data();
  uint64_t* region_words = s.region.words.data();
  const int64_t per_rank = capacity / cp_size;
  const bool cp_pow2 = (cp_size & (cp_size - 1)) == 0;
  const int cp_shift = __builtin_ctzll(static_cast<uint64_t>(cp_size));
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t page = pages[e];
    const bool fetchable = page < capacity;
    const uint8_t f = flags[e];
    const bool shared = !(f & kFlagWrites) && fetchable && !((written[page >> 6] >> (page & 63)) & 1);
    const bool holds_history = !shared && (f & kFlagHistory) && fetchable;
    flags[e] = f | (shared ? kFlagShared : 0);
    if (!shared) own_entries[own++] = static_cast<int32_t>(e);
    if (holds_history) own_history_entries[own_history++] = static_cast<int32_t>(e);
    if (cp_size == 1) {
      if (shared) region_words[page >> 6] |= uint64_t{1} << (page & 63);
    } else if ((f & kFlagHistory) && fetchable) {
      const int64_t owner = cp_pow2 ? page & (cp_size - 1) : page % cp_size;
      const int64_t key = owner * per_rank + (cp_pow2 ? page >> cp_shift : page / cp_size);
      keys[e] = static_cast<int32_t>(key);
      region_words[key >> 6] |= uint64_t{1} << (key & 63);
    }
  }
  s.num_own_history = own_history;
  std::fill(s.written.words.begin(), s.written.words.begin() + written_words, 0);  // empty for the next call

  // The region, in key order: its slots are the keys' ranks.
  const int64_t marked = s.region.rank((capacity + 63) / 64);
  int32_t* region_keys = at_least(s.region_keys, marked);
  for (int64_t w = 0, found = 0; found < marked; ++w) {
    for (uint64_t bits = region_words[w]; bits != 0; bits &= bits - 1) {
      region_keys[found++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(bits));
    }
  }
  s.block_counts.assign(cp_size, 0);
  for (int64_t k = 0; k < cp_size; ++k) {  // rank k's keys are [k * per_rank, (k + 1) * per_rank)
    const int64_t below_end = k + 1 == cp_size ? marked : s.region.rank_of((k + 1) * per_rank);
    s.block_counts[k] = below_end - s.region.rank_of(k * per_rank);
  }

  // Slots: a shared entry its page's region slot, every other entry an own slot after the region, in entry order.
  int32_t* entry_slots = at_least(s.entry_slots, entries);
  int32_t next_own = static_cast<int32_t>(marked);
  for (int64_t e = 0; e < entries; ++e) {
    const bool shared = flags[e] & kFlagShared;
    entry_slots[e] = shared ? s.region.rank_of(cp_size == 1 ? pages[e] : keys[e]) : next_own;
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
      const int64_t first =
          int64_t{entry_slots[entry_starts[r] + prefix[r] / page_size]} * page_size + prefix[r] % page_size;
      s.dense_offsets[r] = first - (end - extend[r]);
    }
  }

  s.sizes[kEntries] = entries;
  s.sizes[kRegion] = marked;
  s.sizes[kOwn] = own;
  s.sizes[kPoolCopies] = cp_size == 1 ? marked + own_history : s.block_counts[cp_rank];
  s.sizes[kViewCopies] = cp_size == 1 ? 0 : own_history;
  s.sizes[kBadRequest] = bad_request;
  std::memcpy(sizes, s.sizes, sizeof(s.sizes));
  std::memcpy(block_counts, s.block_counts.data(), sizeof(int64_t) * cp_size);
  return 0;
}

// The staging of the last layout (numpy reference: plan._NumpyLayout.fill):
//   int64 [E]          entry_req
//         [R]          token_ends, then [R] dense_offsets
//         [E]          the entries' cells r * width + j (only when the page ids are not on the host)
//   int32 [num_errors] zeros (the error counter)
//         [E]          entry_slots
//         [P]          pool copy pages (this rank's pool pages), then [P] their slots
//         [V]          view copy sources, then [V] destinations (under CP)
//         [E]          the entries' page ids, then [num_slots] slot_pages (only when the page ids are on the host)
// `layout_id`: the layout's kLayoutId. Returns the bytes written, -1 when `num_slots` is below the layout's slots,
// -2 when another layout was made on this thread since.
int64_t cpkv_plan_pack(int64_t layout_id, int64_t num_slots, int64_t num_errors, void* buffer) {
  const Scratch& s = scratch;
  const int64_t entries = s.sizes[kEntries], region = s.sizes[kRegion], own = s.sizes[kOwn];
  const int64_t requests = s.num_requests, cp_size = s.cp_size;
  if (layout_id != s.sizes[kLayoutId]) return -2;
  if (num_slots < region + own) return -1;
  const int32_t* pages = s.pages.data();
  const int32_t* entry_slots = s.entry_slots.data();
  const int32_t* region_keys = s.region_keys.data();
  const int32_t* own_entries = s.own_entries.data();
  const int32_t* own_history_entries = s.own_history.data();
  const int64_t own_history = s.num_own_history;
  const int64_t* pages_needed = s.pages_needed.data();
  const int64_t pad = num_slots - region - own;

  int64_t* p = static_cast<int64_t*>(buffer);
  for (int64_t r = 0; r < requests; ++r) {
    std::fill(p, p + pages_needed[r], r);
    p += pages_needed[r];
  }
  std::memcpy(p, s.token_ends.data(), sizeof(int64_t) * requests);
  p += requests;
  std::memcpy(p, s.dense_offsets.data(), sizeof(int64_t) * requests);
  p += requests;
  if (!s.pages_known) {
    for (int64_t r = 0; r < requests; ++r) {
      for (int64_t j = 0; j < pages_needed[r]; ++j) *p++ = r * s.width + j;
    }
  }

  int32_t* q = reinterpret_cast<int32_t*>(p);
  std::fill(q, q + num_errors, 0);
  q += num_errors;
  std::memcpy(q, entry_slots, sizeof(int32_t) * entries);
  q += entries;
  if (cp_size == 1) {  // the region's pages, then the own entries' history pages, straight from the pool
    std::memcpy(q, region_keys, sizeof(int32_t) * region);
    q += region;
    for (int64_t i = 0; i < own_history; ++i) *q++ = pages[own_history_entries[i]];
    for (int64_t i = 0; i < region; ++i) *q++ = static_cast<int32_t>(i);
  } else {  // this rank's block of the region, at its owner pool pages; then the region into own slots
    const int64_t per_rank = s.capacity / cp_size;
    int64_t start = 0;
    for (int64_t k = 0; k < s.cp_rank; ++k) start += s.block_counts[k];
    const int64_t count = s.block_counts[s.cp_rank];
    for (int64_t i = start; i < start + count; ++i) *q++ = static_cast<int32_t>(region_keys[i] % per_rank);
    for (int64_t i = start; i < start + count; ++i) *q++ = static_cast<int32_t>(i);
    for (int64_t i = 0; i < own_history; ++i) *q++ = s.region.rank_of(s.keys[own_history_entries[i]]);
  }
  // The own history slots (the pool copies' at cp 1, the view copies' under CP).
  for (int64_t i = 0; i < own_history; ++i) *q++ = entry_slots[own_history_entries[i]];
  if (s.pages_known) {
    std::memcpy(q, pages, sizeof(int32_t) * entries);
    q += entries;
    for (int64_t i = 0; i < region; ++i) *q++ = static_cast<int32_t>(s.page_of(region_keys[i]));
    for (int64_t i = 0; i < own; ++i) *q++ = pages[own_entries[i]];
    std::fill(q, q + pad, -1);
    q += pad;
  }
  return reinterpret_cast<char*>(q) - static_cast<char*>(buffer);
}

}  // extern "C"
