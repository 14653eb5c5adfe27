"""Helpers shared by the Triton CP shared-KV ops: input checks, byte-exact views, launch sizes."""

from __future__ import annotations

import math

import torch

from sglang_cpkv.ops.errors import NUM_ERROR_KINDS

INDEX_DTYPES = (torch.int32, torch.int64)

# Widest integer word first: a wider word means fewer, wider memory transactions per row.
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def check_errors(errors: torch.Tensor, device: torch.device) -> None:
    if (
        errors.dtype != torch.int32
        or errors.dim() != 1
        or errors.numel() < NUM_ERROR_KINDS
        or not errors.is_contiguous()
    ):
        raise ValueError(
            f"errors must be a contiguous int32 [{NUM_ERROR_KINDS}] counter, got {errors.dtype}{tuple(errors.shape)}"
        )
    if errors.device != device:
        raise ValueError(f"errors is on {errors.device}, the op's tensors on {device}")


def check_index(name: str, index: torch.Tensor, device: torch.device, dims: tuple[int, ...] = (1,)) -> torch.Tensor:
    """Return ``index`` contiguous, after checking dtype (int32/int64), rank and device."""
    if index.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}, the op's tensors on {device}")
    return index.contiguous()


def word_rows(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """What a row-copy kernel takes: ``src`` and ``dst`` as ``[rows, words]`` of their widest common integer word
    (byte-exact, :func:`as_words`), that word's bytes, and the alignment in words of every row start of both."""
    src_words, dst_words, word_bytes = as_words(as_rows("src", src), as_rows("dst", dst))
    return src_words, dst_words, word_bytes, alignment_words(word_bytes, src_words.stride(0), dst_words.stride(0))


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, elems]`` without a copy (a copy of a destination would lose the writes)."""
    if t.dim() < 2:
        raise ValueError(f"{name} must have a leading row dim and at least one more, got shape {tuple(t.shape)}")
    try:
        rows = t.view(t.shape[0], math.prod(t.shape[1:]))
    except RuntimeError as exc:
        raise ValueError(
            f"{name} must have contiguous rows (trailing dims viewable as one), got shape {tuple(t.shape)} strides {t.stride()}"
        ) from exc
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (last stride 1), got strides {t.stride()}")
    return rows


def as_words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """View two ``[rows, elems]`` tensors of one dtype as rows of the widest common integer word.

    The copy is then byte-exact whatever the element type (bf16, the 656-byte packed FP8 rows as
    uint8, ...). The word is the widest of 8/4/2/1 bytes that divides the row width, both row
    strides and both storage offsets, so every row starts on a word boundary.

    Returns ``(src_words, dst_words, word_bytes)``.
    """
    elem = src.element_size()
    if src.numel() == 0 or dst.numel() == 0:
        return src, dst, elem
    spans = [
        src.shape[1] * elem,
        src.stride(0) * elem,
        dst.stride(0) * elem,
        src.storage_offset() * elem,
        dst.storage_offset() * elem,
    ]
    # The 1-byte word always qualifies, so the search never comes up empty.
    word_bytes, word_dtype = next(
        (nbytes, dtype)
        for nbytes, dtype in _WORD_DTYPES
        if all(span % nbytes == 0 for span in spans) and src.data_ptr() % nbytes == 0 and dst.data_ptr() % nbytes == 0
    )
    return _view_words(src, word_dtype), _view_words(dst, word_dtype), word_bytes


def _view_words(t: torch.Tensor, word_dtype: torch.dtype) -> torch.Tensor:
    if t.shape[1] == 1 and t.stride(1) != 1:
        t = t.as_strided(t.shape, (t.stride(0), 1))
    return t.view(torch.uint8).view(word_dtype)


def alignment_words(word_bytes: int, *strides_words: int) -> int:
    """Largest power of two (at most 16 bytes' worth of words) dividing every row stride.

    Passed to the kernels as a ``tl.multiple_of`` hint on row offsets: Triton cannot infer it for
    a stride like 82 words (656-byte rows), and without it the copies fall back to 8-byte accesses.
    """
    align = max(1, 16 // word_bytes)
    while align > 1 and any(s % align for s in strides_words):
        align //= 2
    return align


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
