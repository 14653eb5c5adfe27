"""The soak's KV: every row a pure function of the token ids up to and including its position.

A request's position ``p`` has the rolling hash of its tokens ``0..p`` (:func:`prefix_hashes`); the stand-in model
writes, at every layer, the latent row (``k_nope``, ``k_rope``) and the index key that hash expands to
(:func:`latent_rows`, :func:`index_keys`), so two requests that share a prompt write identical rows for it and a row
read anywhere names the prefix it was written for. What a correct read returns, in each form a kernel or the decode
sees it (:class:`ExpectedRows`): the bf16 row, the 656-byte packed FP8 row upstream's writer makes of it, that row
dequantized, the index key's FP8 bytes and scale; the FP8 forms are torch references of upstream's Triton writers,
tested byte for byte against them. Used by :mod:`.model` and :mod:`.decode`; torch only. Design:
``docs/design/cp-shared-kv-soak.md``, "KV that checks itself".
"""

from __future__ import annotations

import torch

NOPE, ROPE, INDEX_DIM = 512, 64, 128
TILE = 128  # FP8 quantization block of the latent and the index key
FP8_MAX = 448.0
_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(token_ids, start_hash: int = 0) -> list[int]:
    """The rolling hash after each token: ``h[p] = (h[p-1] * B + t[p] + 1) mod (2^61 - 1)`` from ``start_hash``."""
    out, h = [], start_hash
    for t in token_ids:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


_TABLE_ROWS = 1 << 16


def _tables(width: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[65536, width]`` tables of value indices: a hash's row combines the rows of its low and high 16 bits."""
    gen = torch.Generator().manual_seed(salt)
    return tuple(torch.randint(0, 1 << 15, (_TABLE_ROWS, width), generator=gen, dtype=torch.int32) for _ in range(2))


_NOPE_TABLES, _ROPE_TABLES, _INDEX_TABLES = _tables(NOPE, 1), _tables(ROPE, 2), _tables(INDEX_DIM, 3)


def _fp8_exact_values() -> torch.Tensor:
    """Values ``m / 64`` for the e4m3 values ``m = (1 + f/8) 2^e`` (``f`` in 1..7, ``m <= 448``) and their negatives:
    exact in bf16, and with a tile's largest magnitude ``7`` (its scale ``1/64``) each quantizes to ``m`` exactly
    and dequantizes to itself. No power of two: Triton's interpreter, which runs upstream's writers on a CPU, rounds
    a value just under a power of two to half of it."""
    ms = [(1 + f / 8) * 2.0**e for e in range(-6, 9) for f in range(1, 8) if (1 + f / 8) * 2.0**e <= 448]
    values = torch.tensor(ms, dtype=torch.float32) / 64
    return torch.cat([values, -values])


_VALUES = _fp8_exact_values()


def _expand(hashes: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], layer: int) -> torch.Tensor:
    """bf16 values of each hash, one per column, layer-dependent (:func:`_fp8_exact_values`; the first of every
    128 columns is +-7, the tile's scale). Two rows agree only where 32 bits of their (layer-salted) hashes do."""
    h = (hashes.to(torch.int64) * 0x9E3779B1 + layer * 0x85EBCA77) % _MOD
    low, high = tables
    index = (low[h & 0xFFFF] + high[(h >> 16) & 0xFFFF]) % _VALUES.numel()
    values = _VALUES[index]
    values[:, ::TILE] = torch.where((h & 1 << 40)[:, None] != 0, 7.0, -7.0)
    return values.to(torch.bfloat16)


def latent_rows(hashes: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_nope [n, 512], k_rope [n, 64])`` bf16 of the positions whose hashes are ``hashes`` (int64 ``[n]``)."""
    return _expand(hashes, _NOPE_TABLES, layer), _expand(hashes, _ROPE_TABLES, layer)


def index_keys(hashes: torch.Tensor, layer: int) -> torch.Tensor:
    """The indexer's keys ``[n, 128]`` bf16 of the positions whose hashes are ``hashes``."""
    return _expand(hashes, _INDEX_TABLES, layer)


def packed_fp8_rows(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 656]``: upstream's packed FP8 latent row (``quantize_k_cache_separate``): per 128-value tile
    ``scale = amax / 448``, values ``clamp(x * (1 / scale))`` as e4m3, then the four fp32 scales, then the bf16 rope."""
    x = k_nope.to(torch.float32).view(-1, NOPE // TILE, TILE)
    scale = x.abs().amax(dim=-1) / FP8_MAX
    q = (x * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    n = x.shape[0]
    return torch.cat(
        [
            q.view(n, NOPE).view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            k_rope.contiguous().view(torch.uint8),
        ],
        dim=1,
    )


def dequantized_rows(packed: torch.Tensor) -> torch.Tensor:
    """bf16 ``[n, 576]`` of packed FP8 rows, as upstream's RAGGED route dequantizes them for its kernel."""
    n = packed.shape[0]
    q = packed[:, :NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.float32).view(n, NOPE // TILE, TILE)
    scale = packed[:, NOPE : NOPE + 4 * (NOPE // TILE)].contiguous().view(torch.float32)
    nope = (q * scale[..., None]).view(n, NOPE).to(torch.bfloat16)
    rope = packed[:, NOPE + 4 * (NOPE // TILE) :].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def index_k_fp8(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 [n, 128], fp32 [n])``: upstream's ``act_quant(keys, 128)`` (amax floored at 1e-4, ``scale = amax *
    (1 / 448)``, ``x / scale`` as e4m3)."""
    x = keys.to(torch.float32)
    amax = x.abs().amax(dim=-1).clamp(min=1e-4)
    scale = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def as_index_k(keys: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 [n, 128], fp32 [n])`` of an index-K read, whatever dtypes the reader returned them in."""
    keys = keys.contiguous().view(torch.uint8).reshape(n, -1).cpu()
    scales = scales.contiguous()
    if scales.dtype != torch.float32:
        scales = scales.view(torch.uint8).reshape(n, -1).view(torch.float32)
    return keys, scales.reshape(n).cpu()


class ExpectedRows:
    """What a correct read of a position returns, in the form of the buffer it is read from.

    Args:
        fp8_pool: the pool stores the 656-byte packed FP8 rows (else bf16 rows of 576 values).
    """

    def __init__(self, fp8_pool: bool) -> None:
        self.fp8_pool = fp8_pool

    def pool_rows(self, hashes: torch.Tensor, layer: int) -> torch.Tensor:
        """uint8 rows as the latent pool holds them."""
        k_nope, k_rope = latent_rows(hashes, layer)
        if self.fp8_pool:
            return packed_fp8_rows(k_nope, k_rope)
        return torch.cat([k_nope, k_rope], dim=1).view(torch.uint8)

    def kernel_rows(self, hashes: torch.Tensor, layer: int, row_bytes: int) -> torch.Tensor:
        """uint8 rows as an attention kernel reads them from a buffer of ``row_bytes``-byte rows: the pool's own
        form, or (an FP8 pool read through a bf16 buffer: the RAGGED route) its rows dequantized."""
        rows = self.pool_rows(hashes, layer)
        if row_bytes == rows.shape[1]:
            return rows
        if self.fp8_pool and row_bytes == (NOPE + ROPE) * 2:
            return dequantized_rows(rows).view(torch.uint8)
        raise ValueError(f"a kernel reads {row_bytes}-byte rows; the pool's rows are {rows.shape[1]} bytes")

    @staticmethod
    def index_k(hashes: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uint8 [n, 128], fp32 [n])`` as the index-K pool holds a position's key."""
        return index_k_fp8(index_keys(hashes, layer))
