"""``pages_per_request`` buckets: the per-batch ``P`` of the dense view, rounded up so shapes repeat.

Every shape of a plan's device tensors that depends on ``P`` (page table ``[R, P]``, dense view
``[R * P * page_size, row]``) takes ``P`` from this fixed list, so that batches of similar length
reuse the same shapes (CUDA-graph capture, allocator reuse):

* powers of two from 1 to 4096 pages (1, 2, 4, ..., 4096);
* past 4096, multiples of 4096 (8192, 12288, ...), so the padding overhead stays under 50%
  below 4096 pages and under one 4096-page step above.

With ``page_size = 64`` the last power-of-two bucket is 256K tokens per request.
"""

from __future__ import annotations

POWER_OF_TWO_BUCKET_LIMIT = 4096
PAGES_PER_REQUEST_BUCKETS: tuple[int, ...] = tuple(1 << k for k in range(13))  # 1 .. 4096


def bucket_pages_per_request(max_pages: int) -> int:
    """The smallest bucket that holds ``max_pages`` pages (at least 1).

    Args:
        max_pages: the largest page count of any request of the batch (``>= 0``).

    Returns:
        ``P``: a value of :data:`PAGES_PER_REQUEST_BUCKETS`, or a multiple of 4096 above it.
    """
    if max_pages < 0:
        raise ValueError(f"max_pages must be >= 0, got {max_pages}")
    for bucket in PAGES_PER_REQUEST_BUCKETS:
        if max_pages <= bucket:
            return bucket
    return -(-max_pages // POWER_OF_TWO_BUCKET_LIMIT) * POWER_OF_TWO_BUCKET_LIMIT
