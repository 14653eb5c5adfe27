"""The CP shared-KV mode's buffers, reserved: sized once from one operator limit, never grown.

One limit, ``max_batch_tokens`` (``--cp-shared-kv-max-batch-tokens``; default :func:`default_max_batch_tokens`),
bounds every buffer: per attention backend (the target's, a draft's) the dense views of each kind, the current-row
scratch and the batch plan's device tensors (at most ``max_batch_entries`` page-table entries). The scheduler admits
against it (``hooks/reservation.py``); a batch that still exceeds it is refused at plan build naming the setting
(:meth:`Reservation.check_batch`), never an out-of-memory error in a forward. :attr:`Reservation.total_bytes` is
charged to the KV budget before the pool is sized. Used by the hooks (:mod:`sglang_cpkv.hooks.reservation`,
:mod:`sglang_cpkv.hooks.dsa_batch`), checked mode and the capacity planner. Sizing: ``docs/design/cp-shared-kv.md``
section 2b.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.ops.reference import inverse_bytes
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.runtime.plan import staging_bytes

SETTING = "--cp-shared-kv-max-batch-tokens"

# Device bytes of a batch plan (runtime/plan.py) besides its inverse: per page-table entry its page id (int32), slot
# (int32) and request (int64) as staged; per dense slot its page (int32), request (int64, made on first use: checked
# mode), own entry (int64), region page (int32) and its pool / view copy pairs (4 x int32); per current token its
# dense location and its request (made on first use: checked mode), split request, location and token index, gather
# index and owned cache row (int64 each).
PLAN_BYTES_PER_ENTRY = 4 + 4 + 8
PLAN_BYTES_PER_SLOT = 4 + 8 + 8 + 4 + 4 * 4
PLAN_BYTES_PER_TOKEN = 8 + 8 + 8 * 5
# Each scratch row's location (int64), made once with the scratch.
SCRATCH_LOC_BYTES = 8


def page_rounded(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages (what a request occupies in the dense view)."""
    return -(-tokens // page_size) * page_size


def default_max_batch_tokens(context_len: int, chunk_tokens: int, page_size: int) -> int:
    """One request of ``context_len`` tokens plus a chunk of ``chunk_tokens`` more in up to
    ``ceil(chunk_tokens / page_size)`` other requests, each page-rounded.

    Each request occupies whole pages of the dense view, so ``k`` requests holding ``T`` tokens need up to
    ``T + k * (page_size - 1)``: the default counts that rounding for as many other requests as the chunk has
    pages (one request of the full context beside 31 requests of 224 tokens in a 8192-token chunk fits). More,
    smaller requests than that may wait for a later batch (the admission hook counts each one's rounding)."""
    others = chunk_tokens + -(-chunk_tokens // page_size) * (page_size - 1)
    return page_rounded(context_len, page_size) + page_rounded(others, page_size)


@dataclass(frozen=True)
class Reservation:
    """The mode's buffers for one server (see the module docstring).

    Attributes:
        max_batch_tokens: the limit (tokens of KV one batch's dense view may hold).
        chunk_tokens: the most current tokens of one batch (the chunked-prefill size).
        page_size, cp_size: the pool's page size and the attention-CP size.
        layer_ahead: histories are taken one layer ahead (two dense buffers per kind), else synchronously (one).
        latent_token_bytes: bytes of one token of the latent KV pool (656 packed FP8, 1152 bf16, ...).
        index_k_token_bytes: bytes of one token of the DSA index-K pool (keys and scales); 0: none.
        backends: attention backends that run the mode (1, or 2 with a speculative draft).
    """

    max_batch_tokens: int
    chunk_tokens: int
    page_size: int
    cp_size: int
    layer_ahead: bool
    latent_token_bytes: int
    index_k_token_bytes: int
    backends: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "chunk_tokens", "page_size", "cp_size", "backends"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.latent_token_bytes < 1 or self.index_k_token_bytes < 0:
            raise ValueError(
                f"token bytes must be positive, got latent {self.latent_token_bytes}, "
                f"index K {self.index_k_token_bytes}"
            )

    @property
    def views_per_kind(self) -> int:
        """Dense buffers per kind: two with the layer-ahead history (one read while the next is filled), else one."""
        return 2 if self.layer_ahead else 1

    @property
    def max_batch_entries(self) -> int:
        """Page-table entries one batch may have (module docstring)."""
        return self.max_batch_tokens

    @property
    def dense_slots(self) -> int:
        """``S``: dense slots (pages) of every dense buffer."""
        return round_dense_slots(-(-self.max_batch_tokens // self.page_size))

    @property
    def plan_staging_bytes(self) -> int:
        """Pinned host bytes of the plan's staging buffer (:class:`~.plan.PlanStaging`) for the largest batch."""
        return staging_bytes(self.max_batch_entries, self.dense_slots)

    @property
    def plan_staging_refusal(self) -> str:
        """What a batch too large for the staging buffer is told."""
        return f"raise {SETTING} (now {self.max_batch_tokens}, a batch's page-table entries at most)"

    def parts(self) -> dict[str, int]:
        """Bytes of each buffer group of one backend."""
        page_tokens = self.page_size
        kinds = {"latent": self.latent_token_bytes, "index_k": self.index_k_token_bytes}
        parts = {}
        for kind, token_bytes in kinds.items():
            if not token_bytes:
                continue
            page_bytes = page_tokens * token_bytes
            parts[f"{kind} dense views"] = self.views_per_kind * self.dense_slots * page_bytes
        parts["current-row scratch"] = (self.chunk_tokens + 1) * (self.latent_token_bytes + SCRATCH_LOC_BYTES)
        parts["batch plan"] = (
            inverse_bytes(self.max_batch_entries)
            + self.max_batch_entries * PLAN_BYTES_PER_ENTRY
            + self.dense_slots * PLAN_BYTES_PER_SLOT
            + self.chunk_tokens * PLAN_BYTES_PER_TOKEN
        )
        return parts

    @property
    def total_bytes(self) -> int:
        """What the KV budget is charged: every part, for every backend."""
        return self.backends * sum(self.parts().values())

    def describe(self) -> str:
        """The start-up log line."""
        parts = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in self.parts().items())
        return (
            f"CP shared-KV: reserved {self.total_bytes / 2**30:.3f} GiB of the KV budget for {self.backends} "
            f"backend(s) ({SETTING} {self.max_batch_tokens}: {self.dense_slots} dense slots of {self.page_size} "
            f"tokens, {self.views_per_kind} view(s) per kind, cp {self.cp_size}; per backend: {parts}; "
            f"plan staging {self.plan_staging_bytes / 2**20:.1f} MiB of pinned host memory)"
        )

    def check_batch(self, dense_tokens: int, num_slots: int, num_tokens: int, entries: int) -> None:
        """Refuse a batch the reserved buffers cannot hold (the admission hook keeps batches under it)."""
        if entries > self.max_batch_entries:
            raise CpSharedKvError(
                f"the batch has {entries} page-table entries (pages of its requests' views, a shared prompt once per "
                f"request), more than the {self.max_batch_entries} {SETTING} {self.max_batch_tokens} reserves its "
                f"plan for: raise {SETTING}"
            )
        if num_slots > self.dense_slots:
            raise CpSharedKvError(
                f"the batch needs {dense_tokens} tokens of dense KV ({num_slots} slots), more than {SETTING} "
                f"{self.max_batch_tokens} reserves ({self.dense_slots} slots): raise {SETTING}"
            )
        if num_tokens > self.chunk_tokens:
            raise CpSharedKvError(
                f"the batch has {num_tokens} current tokens, more than the {self.chunk_tokens} the reservation "
                "holds (--chunked-prefill-size)"
            )
