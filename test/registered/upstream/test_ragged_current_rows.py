"""The rows ``read-history-less-requests-alike-on-ragged.patch`` moves (torch only; the patched backend itself is
driven by upstream's kit in ``integration/test_cp_shared_kv_kit.py`` at cp 1 and ``..._kit_cp2*.py`` at cp 2, mode off and on).

For every batch of a random sweep (history / no history, a CP cut keeping some requests with fewer keys than
their sequence), each history-less kept request's keys are found position by position in both buffers the RAGGED
route builds: ``page_table_1_flattened`` (kept requests' keys, request-major) and the chunk (every request's
current tokens, batch order), and the write leaves every other row as it was."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from sglang_cpkv.hooks.upstream_fixes.ragged_current_rows import history_less_rows, write_history_less_rows
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="cpkv-cpu")


def _batch(rng):
    bs = rng.randint(1, 6)
    prefix = [rng.choice([0, 0, rng.randint(1, 300)]) for _ in range(bs)]
    extend = [rng.randint(1, 90) for _ in range(bs)]
    kept = sorted(rng.sample(range(bs), rng.randint(1, bs))) if rng.random() < 0.5 else None
    rows = kept if kept is not None else list(range(bs))
    keys = [prefix[b] + rng.randint(1, extend[b]) for b in rows]  # a CP rank's keys end at its last local query
    return prefix, extend, kept, keys


@pytest.mark.parametrize("seed", range(40))
def test_each_history_less_key_found_in_both_buffers(seed):
    rng = random.Random(seed)
    prefix, extend, kept, keys = _batch(rng)
    rows = kept if kept is not None else list(range(len(prefix)))
    # Every key named by (request, position): the flattened buffer over the kept requests, the chunk over all.
    flat = [(b, p) for b, n in zip(rows, keys) for p in range(n)]
    chunk = [(b, prefix[b] + t) for b in range(len(prefix)) for t in range(extend[b])]
    want = [(i, chunk.index(key)) for i, key in enumerate(flat) if prefix[key[0]] == 0]

    got = history_less_rows(prefix, extend, kept, keys, "cpu")

    if not want:
        assert got is None
        return
    assert got.dtype == torch.int64 and got.shape == (2, len(want))
    assert list(zip(*got.tolist())) == want

    width = 8
    dequantized = torch.randn(len(flat), 1, width).to(torch.bfloat16)
    k, k_rope = torch.randn(len(chunk), 1, 6).to(torch.bfloat16), torch.randn(len(chunk), 2).to(torch.bfloat16)
    before = dequantized.clone()
    out = write_history_less_rows(dequantized, k, k_rope, got)
    assert out.data_ptr() == dequantized.data_ptr()
    bf16 = torch.cat([k.squeeze(1), k_rope], dim=-1)
    moved = dict(want)
    for i in range(len(flat)):
        expect = bf16[moved[i]] if i in moved else before[i, 0]
        assert torch.equal(out[i, 0], expect), i


def test_no_rows_leave_the_buffer_as_it_is():
    kv = torch.randn(5, 1, 4)
    assert write_history_less_rows(kv, torch.zeros(3, 2), torch.zeros(3, 2), None) is kv
    assert history_less_rows([10, 20], [5, 5], None, [15, 25], "cpu") is None


def test_lengths_that_disagree_are_refused():
    with pytest.raises(ValueError, match="request 1 has no history and 5 current tokens but 6 keys"):
        history_less_rows([10, 0], [5, 5], None, [15, 6], "cpu")
    with pytest.raises(ValueError, match="2 kept rows and 1 key counts"):
        history_less_rows([10, 0], [5, 5], [0, 1], [15], "cpu")
    with pytest.raises(ValueError, match="widths do not add up"):
        write_history_less_rows(torch.zeros(2, 1, 8), torch.zeros(2, 5), torch.zeros(2, 2), torch.zeros(2, 1).long())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
