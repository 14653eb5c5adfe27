"""Per-request comparison of a run with its bs=1 goldens, and the contamination (foreign marker) detector.

A run's request ``r`` passes when, byte for byte:

* its attention output at every position the run computed equals the golden's at that position;
* its dense KV view after every forward, at positions ``[0, end)`` and every layer, equals the
  golden's final dense view there (the golden's view covers the whole prompt);
* none of the value rows its attention read is a **foreign marker**: a KV row that only another
  request of the batch has (a golden row of that request at one of its marker positions, same
  layer) and that is not one of ``r``'s own golden rows.

Contamination (a foreign marker read) is what the negative control must show on the collision class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_cpkv.harness.engine import RequestTrace, RunTrace


def _row_keys(rows: torch.Tensor) -> list[bytes]:
    """One bytes key per row of ``[n, ...]``."""
    flat = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    return [row.tobytes() for row in flat]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool per leading index ``[..., row]``: byte equality of the trailing row."""
    return (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all(-1)


@dataclass
class RequestVerdict:
    """Mismatches of one request (positions are logical token positions)."""

    request: int
    out_mismatch_positions: list[int] = field(default_factory=list)
    dense_mismatches: list[str] = field(default_factory=list)
    foreign_marker_reads: list[dict] = field(default_factory=list)

    @property
    def equal_to_golden(self) -> bool:
        return not self.out_mismatch_positions and not self.dense_mismatches

    @property
    def contaminated(self) -> bool:
        return bool(self.foreign_marker_reads)


def compare_request(trace: RequestTrace, golden: RequestTrace) -> RequestVerdict:
    """Output and dense-view byte equality of one request with its golden (no marker check)."""
    verdict = RequestVerdict(trace.request)
    if trace.length != golden.length:
        verdict.dense_mismatches.append(f"prompt length {trace.length} != golden {golden.length}")
        return verdict
    same_out = _same_bytes(trace.out, golden.out).all(0)  # [length]
    verdict.out_mismatch_positions = (trace.computed & ~same_out).nonzero().flatten().tolist()
    golden_view = golden.dense_views[-1]
    for f, view in enumerate(trace.dense_views):
        end = view.shape[1]
        bad = ~_same_bytes(view, golden_view[:, :end])  # [L, end]
        if bool(bad.any()):
            layer, pos = (int(i) for i in bad.nonzero()[0])
            verdict.dense_mismatches.append(
                f"forward {f} (positions [0, {end})): {int(bad.sum())} rows differ, first at layer {layer} position {pos}"
            )
    return verdict


def foreign_marker_reads(run: RunTrace, goldens: RunTrace, marker_start: tuple[int, ...]) -> dict[int, list[dict]]:
    """Per request of ``run``: every read of another batch request's marker row (see the module docstring)."""
    requests = [t.request for t in run.requests]
    num_layers = run.requests[0].out.shape[0]
    found: dict[int, list[dict]] = {r: [] for r in requests}
    for layer in range(num_layers):
        own = {r: set(_row_keys(goldens.requests[r].dense_views[-1][layer])) for r in requests}
        marker_owner: dict[bytes, int] = {}
        for q in requests:
            for key in _row_keys(goldens.requests[q].dense_views[-1][layer, marker_start[q] :]):
                marker_owner.setdefault(key, q)
        for trace in run.requests:
            r = trace.request
            positions, cols = trace.read_mask[layer].nonzero(as_tuple=True)
            keys = _row_keys(trace.reads[layer, positions, cols]) if positions.numel() else []
            for pos, key in zip(positions.tolist(), keys):
                q = marker_owner.get(key)
                if q is not None and q != r and key not in own[r]:
                    found[r].append({"layer": layer, "position": pos, "marker_of": q})
    return found


def judge_run(run: RunTrace, goldens: RunTrace, marker_start: tuple[int, ...]) -> list[RequestVerdict]:
    """Every request of ``run`` against its golden, with the foreign marker reads."""
    foreign = foreign_marker_reads(run, goldens, marker_start)
    verdicts = []
    for trace in run.requests:
        verdict = compare_request(trace, goldens.requests[trace.request])
        verdict.foreign_marker_reads = foreign[trace.request]
        verdicts.append(verdict)
    return verdicts
