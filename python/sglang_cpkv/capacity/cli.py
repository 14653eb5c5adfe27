"""``python -m sglang_cpkv.capacity`` / ``sglang-cpkv-capacity``: what cp buys on a model and GPU (module docs:
:mod:`sglang_cpkv.capacity`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from sglang_cpkv.capacity.presets import GPUS, MODELS
from sglang_cpkv.envs import environment
from sglang_cpkv.pd_launch.config import ENV_DEFAULTS

GIB = 2**30
# The launchers' defaults (sglang_cpkv.pd_launch), read here without importing the planner (which imports torch).
DEFAULT_MEM_FRACTION = float(ENV_DEFAULTS["PD_PREFILL_MEM_FRACTION_STATIC"])


def _writable_file(option: str, text: str) -> Path:
    """``text`` as a file the run can write at its end (refused now, not after the run): not a directory, under a
    directory (the missing ones are created) that can be written."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; {option} takes a file")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not writable")
    return path


def json_path(text: str) -> Path:
    return _writable_file("--json", text)


def plot_path(text: str) -> Path:
    """A file matplotlib can write, its type given by its suffix (matplotlib would append .png to none)."""
    path = _writable_file("--plot", text)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError(
            "needs matplotlib (requirements/dev-cpu.txt pins it): pip install matplotlib"
        ) from None
    types = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in types:
        raise argparse.ArgumentTypeError(
            f"{text}: matplotlib cannot write {path.suffix!r} files; give one of " + ", ".join(f".{t}" for t in types)
        )
    return path


def model_dir_of(args: argparse.Namespace) -> tuple[str, float | None]:
    """(a directory with the model's ``config.json``, its parameter count when a preset knows it)."""
    given = [name for name in ("preset", "model") if getattr(args, name)]
    if len(given) != 1:
        raise ValueError("give exactly one of --preset and --model")
    if args.preset:
        preset = MODELS[args.preset]
        return preset.model_dir, preset.parameters
    path = Path(args.model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"--model {args.model}: no such directory or config.json (nothing is downloaded)")
    if not (path / "config.json").is_file():
        # A Hugging Face cache directory: models--org--name/snapshots/<rev>/config.json
        snapshots = sorted((path / "snapshots").glob("*/config.json"))
        if not snapshots:
            raise ValueError(f"--model {args.model}: no config.json there, nor under snapshots/*/ (a HF cache dir)")
        path = snapshots[-1].parent
    return str(path), None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_cpkv.capacity",
        description="KV capacity per prefill node and the mode's per-layer cost, per cp, from upstream's own pool "
        "sizing (CPU; nothing downloaded).",
    )
    p.add_argument("--preset", choices=sorted(MODELS), help="a named model")
    p.add_argument("--model", help="a model directory with config.json, a config.json, or a HF cache directory")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--hbm-gb", type=float, help="override the GPU's HBM capacity (1e9 bytes)")
    p.add_argument("--hbm-tbps", type=float, help="override the GPU's HBM bandwidth (TB/s)")
    p.add_argument("--link-gbps", type=float, help="override the NVLink bandwidth per direction (GB/s)")
    p.add_argument("--tp", type=int, default=8, help="--tp of the prefill server (GPUs of the node)")
    p.add_argument("--cp", default="1,2,4,8", help="attention-CP sizes to compare (each divides --tp)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget-gib", type=float, help="KV budget per GPU (default: the memory fraction's)")
    budget.add_argument(
        "--mem-fraction-static",
        type=float,
        default=DEFAULT_MEM_FRACTION,
        help=f"the server's --mem-fraction-static: budget = fraction x HBM - weights (default {DEFAULT_MEM_FRACTION}; "
        "upstream's own heuristic reserves 1.5 MB of activations per chunk token, 0.258 on an H200 at chunk 65536)",
    )
    p.add_argument("--weights-gib", type=float, help="weights per GPU (default: a preset's parameters x 1 byte / tp)")
    p.add_argument("--context-length", type=int, help="--context-length (default: the model's)")
    p.add_argument("--chunked-prefill-size", type=int, default=65536)
    p.add_argument("--cp-shared-kv-max-batch-tokens", type=int, help="the mode's limit (default: context + chunk)")
    p.add_argument(
        "--layer-ahead",
        choices=["on", "off"],
        help="the mode's layer-ahead history prefetch, as SGLANG_CPKV_LAYER_AHEAD sets it on the server (two dense "
        "views per kind, or one); default: the server's (on under CP, or this process's SGLANG_CPKV_LAYER_AHEAD)",
    )
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    p.add_argument(
        "--prefill-backend",
        default=ENV_DEFAULTS["PD_DSA_PREFILL_BACKEND"],
        help="--dsa-prefill-backend of the sized servers (default: the launchers' PD_DSA_PREFILL_BACKEND default, "
        "%(default)s; upstream's own default on Blackwell FP8 is trtllm, which the mode refuses)",
    )
    p.add_argument(
        "--decode-backend",
        default=ENV_DEFAULTS["PD_DSA_DECODE_BACKEND"],
        help="--dsa-decode-backend of the sized servers (default: the launchers' PD_DSA_DECODE_BACKEND default, "
        "%(default)s); upstream's kv-sharding is sized with trtllm for both",
    )
    p.add_argument("--request-tokens", type=int, default=131072, help="request length for the concurrency figure")
    p.add_argument("--batch-requests", type=int, default=8, help="requests of the per-layer batch")
    p.add_argument("--batch-history", type=int, default=8192, help="history tokens per request of the batch")
    p.add_argument("--batch-extend", type=int, default=1024, help="current tokens per request of the batch")
    p.add_argument("--history-sweep", default="2048,8192,32768,131072", help="histories of the plot's right panel")
    p.add_argument(
        "--hicache-ratio",
        type=float,
        help="report the HiCache host tier (--enable-hierarchical-cache) of this host-to-device ratio per rank",
    )
    p.add_argument(
        "--hicache-size", type=float, default=0, help="report the HiCache host tier of this many GB per rank"
    )
    p.add_argument("--json", type=json_path, help="write one object per cp here")
    p.add_argument("--plot", type=plot_path, help="write the plot here (.png, .pdf, .svg, ...; needs matplotlib)")
    return p


def inputs_of(args: argparse.Namespace):
    from sglang_cpkv.capacity.planner import PlanInputs, check_inputs, check_model, cp_list

    model_dir, parameters = model_dir_of(args)
    check_model(model_dir)
    gpu = GPUS[args.gpu]
    if args.hbm_gb is not None:
        gpu = replace(gpu, hbm_bytes=args.hbm_gb * 1e9)
    if args.hbm_tbps is not None:
        gpu = replace(gpu, hbm_bandwidth=args.hbm_tbps * 1e12)
    if args.link_gbps is not None:
        gpu = replace(gpu, link_bandwidth=args.link_gbps * 1e9)
    if min(gpu.hbm_bytes, gpu.hbm_bandwidth, gpu.link_bandwidth) <= 0:
        raise ValueError("--hbm-gb, --hbm-tbps and --link-gbps must be > 0")
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    for name in ("kv_budget_gib", "weights_gib", "hbm_gb", "hbm_tbps", "link_gbps", "mem_fraction_static"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.weights_gib is not None:
        weights = args.weights_gib * GIB
    elif args.kv_budget_gib is None:
        if parameters is None:
            raise ValueError("--model without --kv-budget-gib needs --weights-gib (weights per GPU)")
        weights = parameters / args.tp
    else:
        weights = 0.0
    try:
        sweep = tuple(int(h) for h in args.history_sweep.split(","))
    except ValueError:
        raise ValueError(f"--history-sweep: a comma-separated list of integers, got {args.history_sweep!r}") from None
    inputs = PlanInputs(
        model_dir=model_dir,
        gpu=gpu,
        tp_size=args.tp,
        cp_sizes=cp_list(args.cp),
        weights_bytes_per_gpu=weights,
        kv_budget_bytes=None if args.kv_budget_gib is None else int(args.kv_budget_gib * GIB),
        mem_fraction_static=args.mem_fraction_static,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        context_length=args.context_length,
        chunked_prefill_size=args.chunked_prefill_size,
        max_batch_tokens=args.cp_shared_kv_max_batch_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        prefill_backend=args.prefill_backend,
        decode_backend=args.decode_backend,
        request_tokens=args.request_tokens,
        batch_requests=args.batch_requests,
        batch_history=args.batch_history,
        batch_extend=args.batch_extend,
        history_sweep=sweep,
    )
    check_inputs(inputs)
    return inputs


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        inputs = inputs_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from sglang_cpkv.capacity.planner import plan, stderr_progress
    from sglang_cpkv.capacity.report import budget_lines, plot, table, write_json
    from sglang_cpkv.upstream_import import install_torchvision_stub

    stderr_progress("importing upstream sglang (the first server's resolution takes ~10 s on a CPU)")
    install_torchvision_stub()
    # The operator's layer-ahead setting, which the mode's reservation reads at a server's start-up (hooks/settings.py).
    from sglang_cpkv.hooks.settings import LAYER_AHEAD_ENV

    setting = {} if args.layer_ahead is None else {LAYER_AHEAD_ENV: "1" if args.layer_ahead == "on" else "0"}
    try:
        with environment(setting):
            rows = plan(inputs, progress=stderr_progress)
    except ValueError as error:  # upstream's or our start-up refusal of the server, or the budget
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = args.preset or Path(inputs.model_dir).name
    title = (
        f"{model} on {args.tp} x {inputs.gpu.name.upper()} (TP {args.tp}), chunk {inputs.chunked_prefill_size}, "
        f"{inputs.kv_cache_dtype} KV"
    )
    notes = budget_lines(rows, inputs.gpu.hbm_bytes, inputs.weights_bytes_per_gpu)
    print(table(rows, title, inputs.request_tokens, notes))
    echo = {**vars(args), "json": str(args.json) if args.json else None, "plot": str(args.plot) if args.plot else None}
    echo["gpu_figures"] = {
        "hbm_bytes": inputs.gpu.hbm_bytes,
        "hbm_bandwidth": inputs.gpu.hbm_bandwidth,
        "link_bandwidth_per_direction": inputs.gpu.link_bandwidth,
        "source": inputs.gpu.source + " (vendor figures: times are lower bounds)",
    }
    echo["weights_gib_per_gpu"] = inputs.weights_bytes_per_gpu / GIB
    if args.json:
        write_json(args.json, rows, json.loads(json.dumps(echo, default=str)))
        stderr_progress(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, rows, title)
        stderr_progress(f"wrote {args.plot}")
    return 0
