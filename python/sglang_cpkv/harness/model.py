"""A toy DSA-like prefill layer stack whose arithmetic is exact, so batch composition cannot change a bit.

Every value the model computes is an integer held in fp32 (KV rows stored as bf16), kept on a coarse
grid by ``remainder``:

* hidden states and KV rows are integers in ``[0, GRID)`` (``GRID = 64``; exact in bf16 and fp32);
* weights are integers in ``[0, WEIGHT_GRID)``; every product and sum stays below ``2**24``, so fp32
  represents each partial sum exactly and any summation order (matmul tiling, split-K, batch size,
  row position, the order of the top-k) gives the same bits;
* indexer scores are exact integers; the top-k selection uses an int64 key that is unique per
  position (ties broken by position), so the chosen set is independent of the kernel;
* attention weights are small integers (``score mod 7 + 1``) instead of a softmax, and the output
  is a weighted sum of the selected value rows: exact, order-free.

The bounds (``hidden = kv_dim = 16``, ``index_dim = 8``, ``topk <= 32``): ``h @ W`` <= 16 * 63 * 3;
score <= 8 * 15 * 15; attention output <= topk * 7 * 63; embedding <= 63 * MAX_POSITION (all < 2**24).
:class:`ToyDsaConfig` checks them; the engine refuses positions >= ``MAX_POSITION``.

One layer, on this rank's local query rows (the CP split of the current tokens):

1. ``kv = (h @ W_kv) mod GRID`` (the MLA latent row of the token, written to the dense view and the
   pool);
2. indexer: query ``(h @ W_qi) mod 16``, key of a candidate row ``(row @ W_ki) mod 16`` read from the
   request's dense view at every causal position; the ``WINDOW`` most recent positions (the token
   itself included) always win, then the highest scores: ``topk`` positions per query;
3. sparse attention: the value rows at the remapped top-k locations, weighted by ``score mod 7 + 1``;
4. ``h' = (h + (out mod GRID) @ W_o) mod GRID``.

Layer 0's hidden state is ``(embed[token] + position * pos_vec) mod GRID``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GRID = 64
INDEX_GRID = 16
WEIGHT_GRID = 4
ATTN_WEIGHT_MOD = 7
WINDOW = 4  # the most recent positions every query attends to (itself included)
MAX_POSITION = 4096  # positions below it keep the layer-0 embedding exact
FP32_EXACT = 2**24
# Top-k key: window positions above every scored position, scores above positions (int64, exact).
_WINDOW_BONUS = 2**40

# remap(locs [rows, K], req_id [rows]) -> dense locations int32 [rows, K] (-1: none)
RemapFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ToyDsaConfig:
    """Shapes and seed of the toy model (all ranks and all runs build identical weights from it)."""

    num_layers: int = 3
    hidden: int = 16
    kv_dim: int = 16
    index_dim: int = 8
    topk: int = 8
    vocab: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        limits = {
            "kv/hidden projection": max(self.hidden, self.kv_dim) * (GRID - 1) * (WEIGHT_GRID - 1),
            "indexer score": self.index_dim * (INDEX_GRID - 1) ** 2,
            "attention output": self.topk * ATTN_WEIGHT_MOD * (GRID - 1),
            "embedding + position": (GRID - 1) * MAX_POSITION,
        }
        inexact = {name: bound for name, bound in limits.items() if bound >= FP32_EXACT}
        if inexact:
            raise ValueError(f"toy model shapes make fp32 sums inexact (bound >= 2**24): {inexact}")
        if self.topk <= WINDOW:
            raise ValueError(f"topk={self.topk} must exceed the always-selected window of {WINDOW} positions")


class ToyDsa:
    """The weights of :class:`ToyDsaConfig` on a device, and the layer math."""

    def __init__(self, config: ToyDsaConfig, device: torch.device) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)

        def ints(high: int, *shape: int) -> torch.Tensor:
            return torch.randint(0, high, shape, generator=gen).to(torch.float32).to(device)

        c = config
        self.embed = ints(GRID, c.vocab, c.hidden)
        self.pos_vec = ints(GRID, c.hidden)
        self.w_kv = [ints(WEIGHT_GRID, c.hidden, c.kv_dim) for _ in range(c.num_layers)]
        self.w_q_index = [ints(WEIGHT_GRID, c.hidden, c.index_dim) for _ in range(c.num_layers)]
        self.w_k_index = [ints(WEIGHT_GRID, c.kv_dim, c.index_dim) for _ in range(c.num_layers)]
        self.w_o = [ints(WEIGHT_GRID, c.kv_dim, c.hidden) for _ in range(c.num_layers)]

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, hidden]``: layer 0's hidden state of tokens at positions (int64 ``[N]`` each)."""
        return torch.remainder(self.embed[tokens] + positions.to(torch.float32).unsqueeze(1) * self.pos_vec, GRID)

    def kv_rows(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """bf16 ``[rows, kv_dim]``: the KV row of each hidden state (exact integers)."""
        return torch.remainder(hidden @ self.w_kv[layer], GRID).to(torch.bfloat16)

    def attend(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        candidate_locs: torch.Tensor,
        req_id: torch.Tensor,
        dense: torch.Tensor,
        remap: RemapFn,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indexer + sparse attention for query rows.

        Args:
            hidden: fp32 ``[rows, hidden]``. positions: int64 ``[rows]`` logical position of each
                query (-1: padding row).
            candidate_locs: int64 ``[rows, Lmax]``: the pool location of every causal position
                ``p <= position`` of the row's request at column ``p``, -1 elsewhere.
            req_id: int64 ``[rows]``, request row in the batch (-1: padding).
            dense: ``[R * P * page_size, kv_dim]`` bf16 dense view (history + current).
            remap: pool locations -> dense locations (the runtime's, or the negative control's).

        Returns:
            ``(out fp32 [rows, kv_dim], read rows bf16 [rows, topk, kv_dim], read mask bool
            [rows, topk])``: the attention output and the value rows it summed.
        """
        cfg = self.config
        rows, lmax = candidate_locs.shape
        cand_dense = remap(candidate_locs, req_id).to(torch.int64)
        cand_ok = cand_dense >= 0
        cand_rows = dense[cand_dense.clamp(min=0)].to(torch.float32)
        key_idx = torch.remainder(cand_rows @ self.w_k_index[layer], INDEX_GRID)
        query_idx = torch.remainder(hidden @ self.w_q_index[layer], INDEX_GRID)
        scores = (key_idx * query_idx.unsqueeze(1)).sum(-1)  # exact integers
        col = torch.arange(lmax, device=hidden.device)
        in_window = (col.unsqueeze(0) <= positions.unsqueeze(1)) & (col.unsqueeze(0) > positions.unsqueeze(1) - WINDOW)
        key = scores.to(torch.int64) * lmax + (lmax - 1 - col) + in_window.to(torch.int64) * _WINDOW_BONUS
        key = torch.where(cand_ok, key, -1)
        k = min(cfg.topk, lmax)
        top_key, top_col = key.topk(k, dim=1)
        selected = top_key >= 0
        topk_locs = torch.where(selected, candidate_locs.gather(1, top_col), -1)
        topk_dense = remap(topk_locs, req_id).to(torch.int64)
        read_mask = selected & (topk_dense >= 0)
        reads = torch.where(read_mask.unsqueeze(-1), dense[topk_dense.clamp(min=0)], 0)
        weight = torch.where(read_mask, torch.remainder(scores.gather(1, top_col), ATTN_WEIGHT_MOD) + 1, 0)
        out = (weight.unsqueeze(-1) * reads.to(torch.float32)).sum(1)
        if k < cfg.topk:  # a fixed width for the caller's records
            reads = torch.cat([reads, reads.new_zeros(rows, cfg.topk - k, cfg.kv_dim)], 1)
            read_mask = torch.cat([read_mask, read_mask.new_zeros(rows, cfg.topk - k)], 1)
        return out, reads, read_mask

    def next_hidden(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """fp32 ``[rows, hidden]``: the residual update of a layer (exact integers)."""
        return torch.remainder(hidden + torch.remainder(attn_out, GRID) @ self.w_o[layer], GRID)
