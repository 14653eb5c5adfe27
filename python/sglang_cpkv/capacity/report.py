"""The planner's outputs: the stdout table, the JSON, the plot (matplotlib, imported only for ``--plot``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 2**30


def _k(tokens: int | None) -> str:
    return "-" if tokens is None else f"{tokens / 1000:,.0f}K"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def budget_lines(rows: list[dict[str, Any]], hbm_bytes: float, weights_bytes: float) -> list[str]:
    """What the budget column is: the operator's setting, and what upstream's own default gives that server."""
    described: list[tuple[int, str]] = []  # (cp, what its budget is)
    for row in rows:
        fraction, default = row["mem_fraction_static"], row["upstream_mem_fraction_static"]
        given = (
            f"--kv-budget-gib {row['kv_budget_gib']:.1f}"
            if fraction is None
            else f"the operator's --mem-fraction-static {fraction:.3f} x {hbm_bytes / 1e9:.0f} GB HBM - "
            f"{weights_bytes / GIB:.1f} GiB weights = {row['kv_budget_gib']:.1f} GiB"
        )
        resolved = default * hbm_bytes - weights_bytes
        line = (
            f"budget per GPU: {given}; upstream's default for this server resolves to --mem-fraction-static "
            f"{default:.3f} ({'no KV budget' if resolved <= 0 else f'{resolved / GIB:.1f} GiB'})"
        )
        described.append((row["cp"], line))
    if len({line for _, line in described}) == 1:
        return [f"every cp: {described[0][1]}"]
    return [f"cp {cp}: {line}" for cp, line in described]


def table(rows: list[dict[str, Any]], title: str, request_tokens: int, notes: list[str] = ()) -> str:
    """The per-cp table: capacity first, then the batch's per-layer bytes and their lower-bound times."""
    lines = [title, f"(longest: the longest request that fits; concurrent: requests of {request_tokens} tokens)", ""]
    head = (
        f"{'cp':>3} {'attn_tp':>7} {'budget GiB':>10} {'mode KV':>9} {'replicated':>10} {'ratio':>6} "
        f"{'kv-sharding':>11} {'ratio':>6} {'mode @ks cell':>13} {'ratio':>6} {'reserved':>13} {'longest':>8} "
        f"{'concurrent':>10}"
    )
    lines += [head, "-" * len(head)]
    for row in rows:
        reservation = row["reservation"]
        reserved = "-" if reservation is None else f"{reservation['gib']:.3f} GiB"
        sharding_ratio = row["ratio_kv_sharding"]
        refused = bool(row.get("mode_refused"))
        mode_kv = "refused" if refused else _k(row["kv_tokens"])
        ratio = "-" if refused else f"{row['ratio']:.2f}x"
        at_cell = row["kv_tokens_at_sharding_cell"]
        at_cell_ratio = "-" if at_cell is None else f"{row['ratio_at_sharding_cell']:.2f}x"
        lines.append(
            f"{row['cp']:>3} {row['attn_tp']:>7} {row['kv_budget_gib']:>10.1f} {mode_kv:>9} "
            f"{_k(row['kv_tokens_replicated']):>10} {ratio:>6} {_k(row['kv_tokens_kv_sharding']):>11} "
            f"{'-' if sharding_ratio is None else f'{sharding_ratio:.2f}x':>6} {_k(at_cell):>13} "
            f"{at_cell_ratio:>6} {reserved:>13} "
            f"{_k(row['longest_context']):>8} {row['concurrent_requests']:>10}"
        )
    sharding = next((row for row in reversed(rows) if row["kv_sharding"]), None)
    if sharding is not None:
        cell, replicated_cell = sharding["kv_sharding"]["cell_bytes"], sharding["replicated"]["cell_bytes"]
        lines.append(
            f"kv-sharding: upstream's --enable-kv-cache-sharding, trtllm only; its KV cell is the trtllm layout "
            f"({cell:,} bytes a token, the replicated and mode columns' {replicated_cell:,}), so its ratio's bound is "
            f"cp x {replicated_cell:,} / {cell:,} ({sharding['cp']} x: "
            f"{sharding['cp'] * replicated_cell / cell:.2f}x). 'mode @ks cell': the mode's node at that cell "
            "(computed: the mode runs the flashmla routes, not trtllm), to compare like for like."
        )
    lines += list(notes)
    if "host" in rows[0]:
        lines.append(
            "HiCache host tier per rank (--hicache-ratio / --hicache-size), and the distinct tokens the node caches:"
        )
        for row in rows:
            replicated = row["replicated"]["host"]
            mode = (
                "does not run"
                if row["host"] is None
                else (
                    f"{_k(row['host']['host_tokens_per_rank'])} tokens, {row['host']['host_gib_per_rank']:.1f} GiB a rank, "
                    f"{_k(row['host']['host_tokens_node'])} on the node"
                )
            )
            lines.append(
                f"  cp {row['cp']}: mode {mode}; replicated {_k(replicated['host_tokens_per_rank'])} tokens, "
                f"{replicated['host_gib_per_rank']:.1f} GiB a rank, {_k(replicated['host_tokens_node'])} on the node"
            )
    for row in rows:
        if row.get("mode_refused"):
            lines.append(f"cp {row['cp']}: the mode is refused at start-up here: {row['mode_refused']}")
    batch = rows[0]["layer"]["batch"]
    lines += [
        "",
        f"Per layer, one rank, batch {batch['requests']} x {batch['history']} history + {batch['extend']} current "
        "(latent + index K; lower bounds at the GPU's peaks):",
    ]
    head = (
        f"{'cp':>3} {'packed':>6} {'link MB':>9} {'HBM MB':>9} {'exchange':>10} {'copies':>10} {'total':>10} "
        f"{'floor':>10} {'floor MB':>9}  measured layer"
    )
    lines += [head, "-" * len(head)]
    for row in rows:
        layer = row["layer"]
        measured = layer["measured_layer"]
        seen = "-"
        if measured is not None:
            seen = (
                f"{measured['mode_off_ms']:.3f} ms off, {measured['mode_on_ms']:.3f} ms on "
                f"({measured['heads']} heads, top-k {measured['topk']})"
            )
        if layer.get("past_reservation"):
            lines.append(
                f"{row['cp']:>3} past the mode's reservation, a server refuses it: {layer['past_reservation']}"
            )
            continue
        lines.append(
            f"{row['cp']:>3} {layer['packed_pages']:>6} {layer['link_bytes'] / 1e6:>9.1f} {layer['hbm_bytes'] / 1e6:>9.1f} "
            f"{_us(layer['exchange_s']):>10} {_us(layer['copies_s']):>10} {_us(layer['total_s']):>10} "
            f"{_us(layer['floor_s']):>10} {(layer['floor_link_bytes'] + layer['floor_hbm_bytes']) / 1e6:>9.1f}  {seen}"
        )
    return "\n".join(lines)


def write_json(path: Path, rows: list[dict[str, Any]], inputs: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"inputs": inputs, "rows": rows}, indent=1) + "\n")


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Two panels: KV tokens a node holds vs cp (mode, replicated, kv-sharding); per-layer time vs history."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (requirements/dev-cpu.txt pins it): pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    cps = [row["cp"] for row in rows]
    # The mode's line only where a server runs it (not at cp 1, not where start-up refuses it), unbroken only between
    # neighbouring cp that both run it.
    runs: list[list[dict[str, Any]]] = [[]]
    for row in rows:
        if row["mode_runs"]:
            runs[-1].append(row)
        elif runs[-1]:
            runs.append([])
    color = None
    for i, run in enumerate(r for r in runs if r):
        (line,) = left.plot(
            [row["cp"] for row in run],
            [row["kv_tokens"] / 1e3 for row in run],
            "o-",
            color=color,
            label=None if i else "CP shared-KV mode (this distribution; where it runs)",
        )
        color = line.get_color()
    left.plot(cps, [row["kv_tokens_replicated"] / 1e3 for row in rows], "s--", label="upstream replicated CP")
    sharded = [(row["cp"], row["kv_tokens_kv_sharding"]) for row in rows if row["kv_tokens_kv_sharding"]]
    if sharded:
        left.plot(
            [c for c, _ in sharded], [t / 1e3 for _, t in sharded], "^:", label="upstream --enable-kv-cache-sharding"
        )
    left.set_xscale("log", base=2)
    left.set_xticks(cps, [str(c) for c in cps])
    left.set_xlabel("cp (attention-CP ranks of the prefill node)")
    left.set_ylabel("KV tokens the node holds (K)")
    left.set_title("KV capacity (upstream's pool sizing)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)

    for row in rows:
        if row["cp"] == 1:
            continue
        sweep = row["layer"]["sweep"]
        history = [point["history"] / 1e3 for point in sweep]
        (line,) = right.plot(history, [p["exchange_s"] * 1e3 for p in sweep], "o-", label=f"cp {row['cp']} exchange")
        right.plot(
            history, [p["total_s"] * 1e3 for p in sweep], "--", color=line.get_color(), label=f"cp {row['cp']} total"
        )
        right.plot(
            history, [p["floor_s"] * 1e3 for p in sweep], ":", color=line.get_color(), label=f"cp {row['cp']} floor"
        )
    measured = {
        (m["history"], m["mode_off_ms"], m["heads"], m["topk"]) for row in rows if (m := row["layer"]["measured_layer"])
    }
    for history, ms, heads, topk in sorted(measured):
        right.plot([history / 1e3], [ms], "k*", markersize=11)
        right.annotate(
            f"measured attention layer, cp 1\n(kit, {heads} heads, top-k {topk}): {ms:.2f} ms",
            (history / 1e3, ms),
            textcoords="offset points",
            xytext=(8, -22),
            fontsize=8,
        )
    batch = rows[0]["layer"]["batch"]
    right.set_xscale("log", base=2)
    ticks = [point["history"] for point in rows[-1]["layer"]["sweep"]]
    right.set_xticks([t / 1e3 for t in ticks], [f"{t / 1024:g}K" for t in ticks])
    right.set_yscale("log")
    right.set_xlabel(f"history per request ({batch['requests']} requests, {batch['extend']} current tokens each)")
    right.set_ylabel("ms per layer (lower bound at vendor peaks)")
    right.set_title("The mode's per-layer exchange and copies")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
