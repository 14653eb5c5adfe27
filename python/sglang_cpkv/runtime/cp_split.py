"""How the current tokens of a batch are split across CP ranks, as upstream 0.5.23 splits them.

A :class:`CpSplit` is host metadata made once per batch; :meth:`CpSplit.shard` applies it to any token-major tensor
(hidden states, ``out_cache_loc``, the companion request ids; padded rows get ``pad_value``: -1 for locations and
ids, never written nor read). The serving path takes the split upstream ran (:func:`upstream_interleave_split`, from
the batch's ``attn_cp_metadata``; :mod:`sglang_cpkv.hooks.dsa_metadata`); :func:`build_cp_split` computes one from
the host ``extend_lens`` (``"interleave"``, ``"zigzag"``, ``"none"``: :func:`split_applies`) for the un-split batch,
the capacity planner and the tests. The strategies and their padding: ``docs/design/cp-shared-kv.md`` section 6;
the contract's "CP".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from sglang_cpkv.ops.errors import CpSharedKvError

CpStrategy = Literal["interleave", "zigzag", "none"]
CP_STRATEGIES: tuple[str, ...] = ("interleave", "zigzag", "none")


def split_applies(strategy: CpStrategy, extend_lens: Sequence[int], cp_size: int) -> bool:
    """Whether upstream 0.5.23 splits this batch at all (its ``can_apply``).

    Interleave needs ``sum(extend) >= cp``; zigzag needs every ``extend >= 2 cp``; otherwise
    upstream runs the batch un-split on every rank (strategy ``"none"`` here).
    """
    if cp_size <= 1 or strategy == "none":
        return False
    if strategy == "interleave":
        total = sum(extend_lens)
        return total > 0 and total >= cp_size
    if strategy == "zigzag":
        return sum(extend_lens) >= 2 * cp_size and all(n >= 2 * cp_size for n in extend_lens)
    raise CpSharedKvError(f"unknown CP strategy {strategy!r}; expected one of {CP_STRATEGIES}")


def _zigzag_block_sizes(extend_len: int, cp_size: int) -> list[int]:
    blocks = 2 * cp_size
    base, rem = divmod(extend_len, blocks)
    return [base + 1 if b < rem else base for b in range(blocks)]


def _rank_token_indices(strategy: CpStrategy, extend_lens: Sequence[int], cp_size: int, rank: int) -> torch.Tensor:
    """int64 ``[logical]`` global token indices of ``rank``'s real local rows, in local order."""
    total = sum(extend_lens)
    if strategy == "none" or cp_size == 1:
        return torch.arange(total, dtype=torch.int64)
    if strategy == "interleave":
        return torch.arange(rank, total, cp_size, dtype=torch.int64)
    # zigzag: "prev" block `rank` of every request, then "next" block 2cp-1-rank of every request.
    prev: list[torch.Tensor] = []
    nxt: list[torch.Tensor] = []
    req_start = 0
    for extend_len in extend_lens:
        sizes = _zigzag_block_sizes(extend_len, cp_size)
        starts = [req_start + sum(sizes[:b]) for b in range(2 * cp_size)]
        for block, out in ((rank, prev), (2 * cp_size - 1 - rank, nxt)):
            out.append(torch.arange(starts[block], starts[block] + sizes[block], dtype=torch.int64))
        req_start += extend_len
    return torch.cat(prev + nxt) if prev else torch.empty(0, dtype=torch.int64)


def _interleave_rows(num_tokens: int, cp_size: int) -> list[int]:
    """Real local rows of each rank under interleave (token ``t`` on rank ``t % cp``)."""
    return [len(range(r, num_tokens, cp_size)) for r in range(cp_size)]


@dataclass(frozen=True)
class CpSplit:
    """The split of one batch's ``N`` current tokens over ``cp_size`` ranks, seen from ``cp_rank``.

    Attributes:
        strategy: ``"interleave"``, ``"zigzag"`` or ``"none"`` (un-split, replicated).
        cp_size, cp_rank: the CP group size and this rank.
        num_tokens: ``N``.
        per_rank_logical: real local rows of each rank (upstream's ``per_rank_logical_token``).
        physical_rows: padded local rows, the same on every rank (``per_rank_actual_token``).
        extend_lens: the requests' current tokens (zigzag cuts each request; the other strategies use their sum).
        local_token_index: host int64 ``[per_rank_logical[cp_rank]]``, the global token index of
            each real local row of this rank, in local row order (made on first use: the serving hooks take
            upstream's own split and never ask).
        gather_index: host int64 ``[N]``; row ``t`` of the rank-major all-gather
            ``[cp_size * physical_rows, ...]`` that holds token ``t`` (for ``"none"``, rank 0's); made on first use.
    """

    strategy: CpStrategy
    cp_size: int
    cp_rank: int
    num_tokens: int
    per_rank_logical: tuple[int, ...]
    physical_rows: int
    extend_lens: tuple[int, ...]

    @cached_property
    def local_token_index(self) -> torch.Tensor:
        return _rank_token_indices(self.strategy, self.extend_lens, self.cp_size, self.cp_rank)

    @cached_property
    def gather_index(self) -> torch.Tensor:
        if self.strategy == "none":
            return torch.arange(self.num_tokens, dtype=torch.int64)
        gather_index = torch.empty(self.num_tokens, dtype=torch.int64)
        for rank in range(self.cp_size):
            tokens = _rank_token_indices(self.strategy, self.extend_lens, self.cp_size, rank)
            gather_index[tokens] = rank * self.physical_rows + torch.arange(tokens.numel(), dtype=torch.int64)
        return gather_index

    def shard(self, x: torch.Tensor, pad_value: float | int, local_index: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's padded local rows of a token-major tensor.

        Args:
            x: ``[>= N, ...]`` in global token order (rows past ``N`` are ignored, as upstream
                cuts to ``total_seq_lens``).
            pad_value: the value of the padded rows (0 for activations, -1 for ids/locations).
            local_index: ``local_token_index`` already on ``x.device`` (the plan keeps one), or
                None to copy it there.

        Returns:
            ``[physical_rows, ...]``, same dtype/device as ``x``: real rows first, then padding. Un-split
            (``"none"``) that is ``x[:N]`` itself, a view.
        """
        if x.shape[0] < self.num_tokens:
            raise CpSharedKvError(f"CP shard: tensor has {x.shape[0]} rows, the batch has {self.num_tokens} tokens")
        if self.strategy == "none":
            return x[: self.num_tokens]
        index = self.local_token_index.to(x.device) if local_index is None else local_index
        out = x.new_full((self.physical_rows, *x.shape[1:]), pad_value)
        out[: index.numel()] = x.index_select(0, index)
        return out

    def unshard(self, gathered: torch.Tensor, gather_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token-order rows ``[N, ...]`` from the rank-major all-gather ``[cp * physical, ...]``.

        Under ``"none"`` nothing is gathered: ``gathered`` is this rank's ``[N, ...]`` rows.
        """
        expected = self.physical_rows if self.strategy == "none" else self.cp_size * self.physical_rows
        if gathered.shape[0] != expected:
            raise CpSharedKvError(
                f"CP unshard: gathered {gathered.shape[0]} rows, expected cp_size*physical_rows = "
                f"{self.cp_size}*{self.physical_rows} = {expected}"
            )
        index = self.gather_index.to(gathered.device) if gather_index is None else gather_index
        return gathered.index_select(0, index)


def build_cp_split(strategy: CpStrategy, extend_lens: Sequence[int], cp_size: int, cp_rank: int) -> CpSplit:
    """The split of a batch, from the host ``extend_lens``.

    Raises:
        CpSharedKvError: unknown strategy, ``cp_size < 1``, ``cp_rank`` outside ``[0, cp_size)``,
            or a strategy that upstream would not apply to this batch (use ``"none"`` then).
    """
    if strategy not in CP_STRATEGIES:
        raise CpSharedKvError(f"unknown CP strategy {strategy!r}; expected one of {CP_STRATEGIES}")
    if cp_size < 1:
        raise CpSharedKvError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise CpSharedKvError(f"cp_rank {cp_rank} outside [0, cp_size={cp_size})")
    extend_lens = [int(n) for n in extend_lens]
    total = sum(extend_lens)
    if strategy != "none" and cp_size > 1 and not split_applies(strategy, extend_lens, cp_size):
        raise CpSharedKvError(
            f"CP strategy {strategy!r} does not apply to extend_lens={extend_lens} at cp_size={cp_size} "
            "(upstream runs such a batch un-split): build the plan with strategy='none'"
        )
    effective = "none" if cp_size == 1 else strategy
    if effective == "none":
        return CpSplit("none", cp_size, cp_rank, total, (total,) * cp_size, total, tuple(extend_lens))
    if effective == "interleave":
        logical = _interleave_rows(total, cp_size)
    else:
        blocks = [_zigzag_block_sizes(n, cp_size) for n in extend_lens]
        logical = [sum(b[r] + b[2 * cp_size - 1 - r] for b in blocks) for r in range(cp_size)]
    align = 2 * cp_size if effective == "zigzag" else cp_size
    physical = -(-max(logical) // align) * align
    return CpSplit(effective, cp_size, cp_rank, total, tuple(logical), physical, tuple(extend_lens))


def upstream_interleave_split(
    num_tokens: int, per_rank_logical: Sequence[int] | None, per_rank_physical: Sequence[int], cp_rank: int
) -> CpSplit:
    """The split upstream ran for an interleave batch, from its ``attn_cp_metadata`` (the serving path's split).

    Args:
        num_tokens: the batch's current tokens (``total_seq_lens``).
        per_rank_logical: ``per_rank_logical_token``, the real rows of each rank.
        per_rank_physical: ``per_rank_actual_token`` after ``pad_logical_token_to_physical``, one padded length.

    Raises:
        CpSharedKvError: metadata that is not an interleave split of ``num_tokens`` (token ``t`` on rank ``t % cp``,
            every rank padded to one length), naming it.
    """
    if per_rank_logical is None:
        raise CpSharedKvError(
            "upstream's attn_cp_metadata carries no per_rank_logical_token: its padding "
            "(pad_logical_token_to_physical, in prepare_cp_forward) did not run for this batch"
        )
    cp_size = len(per_rank_logical)
    logical = [int(n) for n in per_rank_logical]
    physical = {int(n) for n in per_rank_physical}
    interleave = _interleave_rows(num_tokens, cp_size)
    if (
        cp_size < 2
        or len(per_rank_physical) != cp_size
        or len(physical) != 1
        or logical != interleave
        or max(logical) > min(physical)
        or not 0 <= cp_rank < cp_size
    ):
        raise CpSharedKvError(
            f"upstream's attn_cp_metadata is not an interleave split of {num_tokens} tokens for CP rank {cp_rank}: "
            f"per_rank_logical_token {logical} (interleave: {interleave}), per_rank_actual_token "
            f"{list(per_rank_physical)}"
        )
    return CpSplit("interleave", cp_size, cp_rank, num_tokens, tuple(logical), physical.pop(), (num_tokens,))
