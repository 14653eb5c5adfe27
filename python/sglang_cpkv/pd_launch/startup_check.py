"""The servers' start-up checks on a CPU machine, run by ``PD_PYTHON`` for ``dry-run`` (reads JSON, writes JSON).

    echo '{"roles": [{"role": "prefill", "argv": [...], "env": {...}}], "gpu_capability": "10.3"}' \\
        | PD_PYTHON -m sglang_cpkv.pd_launch.startup_check

A server role gets what ``sglang.launch_server`` runs before it touches a GPU: upstream's ``ServerArgs`` parser
(abbreviations refused); with the model's ``config.json`` here, upstream's resolution for a GPU of that capability
(the mode's checks, the DSA backend guards); one GPU's KV budget sized as upstream sizes the pool, refused when it
cannot hold one request of the context length. The router: ``sglang_router``'s parser. One ``{"role", "status",
"message"}`` per role: ``ok``, ``partial``, ``refused`` or ``unusable``. From :mod:`.dry_run`; ``docs/operations.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from sglang_cpkv.envs import environment
from sglang_cpkv.pd_launch.config import CP_SHARED_KV_FLAG, DEFAULT_GPU_CAPABILITY

MEM_FRACTION_FLAG = "--mem-fraction-static"


class _Refused(Exception):
    """The role's configuration is refused; the message says by what and why."""


def _parse_with(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    """Parse with ``parser``; turn its argparse error (usage + message on stderr, exit 2) into a refusal."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parser.parse_args(argv)
    except SystemExit:
        lines = captured.getvalue().strip().splitlines()
        error = lines[-1] if lines else "argparse exited without a message"
        hint = ""
        if CP_SHARED_KV_FLAG in error:
            hint = f"\n  ({CP_SHARED_KV_FLAG} comes from our patch queue: run `python -m sglang_cpkv.overlay apply` on this sglang)"
        raise _Refused(f"{what}: {error}{hint}") from None


def _local_config(model_path: str, revision: str | None) -> str | None:
    """The path of the model's config.json on this machine, or None."""
    candidate = Path(model_path).expanduser() / "config.json"
    if candidate.is_file():
        return str(candidate)
    if Path(model_path).expanduser().exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model_path, "config.json", revision=revision)
    except ValueError:  # not a valid hub id
        return None
    return cached if isinstance(cached, str) else None


def _pin_capability(requested: str) -> str:
    """Make upstream see a GPU of ``requested`` (or this machine's, or the default); say which."""
    import torch

    if requested:
        source = "PD_GPU_CAPABILITY"
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor} (this machine's GPU)"
    else:
        requested, source = DEFAULT_GPU_CAPABILITY, "no GPU here; set PD_GPU_CAPABILITY for another GPU"
    major, minor = (int(x) for x in requested.split("."))
    torch.cuda.get_device_capability = lambda *a, **k: (major, minor)
    return f"{requested} ({source})"


def _gpu_memory(requested: str) -> tuple[float | None, bool, str]:
    """(the serving GPU's memory in bytes or None, whether the resolution must be shown it, what it is)."""
    import torch

    if not requested and torch.cuda.is_available():  # the machine's own GPU: upstream reads its memory itself
        from sglang.srt.utils.common import get_device_memory_capacity

        return get_device_memory_capacity("cuda") * 2**20, False, "this machine's GPU"
    from sglang_cpkv.capacity.presets import GPUS

    capability = requested or DEFAULT_GPU_CAPABILITY
    wanted = tuple(int(x) for x in capability.split("."))
    for gpu in GPUS.values():
        if gpu.capability == wanted:
            said = f"{gpu.name.upper()}, the documented GPU of compute capability {capability}"
            return gpu.hbm_bytes, True, said
    documented = ", ".join(f"{'.'.join(map(str, g.capability))} {g.name.upper()}" for g in GPUS.values())
    return None, False, f"no documented GPU of compute capability {capability} ({documented})"


def _given(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _kv_budget_note(args, argv: list[str], hbm_bytes: float | None, gpu: str) -> str:
    """What the KV budget of one GPU holds, for the result's message; :class:`_Refused` when not one request of the
    context length."""
    if hbm_bytes is None:
        return f"; KV budget NOT checked: {gpu}"
    from sglang_cpkv.capacity.upstream import kv_budget

    try:
        budget = kv_budget(args, hbm_bytes=hbm_bytes)
    except Exception as exc:  # our sizing of a server upstream accepted: said, not a refusal of the server
        return f"; KV budget NOT checked: sizing its pool failed here ({type(exc).__name__}: {exc})"
    if budget is None:
        return "; KV budget NOT checked: the weights of this model cannot be bounded from its config.json"
    why = "as given" if _given(argv, MEM_FRACTION_FLAG) else "upstream's default for this server"
    shown = (
        f"{MEM_FRACTION_FLAG} {budget.mem_fraction_static:g} ({why}) x {budget.hbm_bytes / 1e9:.1f} GB ({gpu}) - "
        f"at least {budget.weights_bytes / 1e9:.1f} GB of weights"
    )
    pool = f"at most {budget.budget_bytes / 1e9:.1f} GB: {budget.node_tokens:,} KV tokens ({budget.kv_cache_dtype})"
    if budget.holds_one_request:
        return (
            f"; KV budget per GPU: {shown} = {pool}, one request of the context length "
            f"({budget.context_len:,} tokens) fits"
        )
    held = "no KV budget" if budget.budget_bytes <= 0 else f"{pool}, fewer than one request needs"
    fp8 = "" if budget.kv_cache_dtype.startswith("fp8") else ", use an FP8 KV cache (--kv-cache-dtype fp8_e4m3)"
    raise _Refused(
        f"the KV budget cannot hold one request of the context length ({budget.context_len:,} tokens): {shown} = "
        f"{held}. Raise {MEM_FRACTION_FLAG} (the rest of the GPU's memory holds the activations: upstream's default "
        f"keeps 1.5 MB per --chunked-prefill-size token){fp8}, or lower --context-length"
    )


def _check_server(argv: list[str], env: dict, gpu_capability: str) -> tuple[str, str]:
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()  # no-op where torchvision is installed (the image); CPU dev environments lack it
    try:
        from sglang.srt.server_args import ServerArgs, prepare_server_args
    except ImportError as exc:
        return "unusable", f"cannot import sglang ({exc})"

    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    namespace = _parse_with(parser, argv, "flags rejected by upstream's parser")
    try:
        ServerArgs.from_cli_args(namespace)
    except (Exception, SystemExit) as exc:
        raise _Refused(f"flags rejected by upstream's ServerArgs: {type(exc).__name__}: {exc}") from None
    parsed = "flags accepted by upstream's ServerArgs parser"
    config = _local_config(namespace.model_path, getattr(namespace, "revision", None))
    if config is None:
        return "partial", (
            f"{parsed}; start-up checks NOT run: no config.json of {namespace.model_path} on this machine "
            "(a local model directory or the Hugging Face cache)"
        )
    capability = _pin_capability(gpu_capability)
    hbm_bytes, show_memory, gpu = _gpu_memory(gpu_capability)
    names_device = any(arg == "--device" or arg.startswith("--device=") for arg in argv)
    resolve_argv = list(argv) if names_device else [*argv, "--device", "cuda"]
    from sglang_cpkv.capacity.upstream import seeing_gpu_memory

    # The hub's config comes from the cache only: a dry-run never downloads.
    with environment({**env, "HF_HUB_OFFLINE": "1"}), seeing_gpu_memory(hbm_bytes if show_memory else None):
        try:
            args = prepare_server_args(resolve_argv)
            args.resolve_once()
        except (Exception, SystemExit) as exc:  # what the server would die of at start-up
            raise _Refused(
                f"the server refuses this at start-up: {type(exc).__name__}: {exc}\n"
                f"  (resolved from {config} for a GPU of compute capability {capability})"
            ) from None
        try:
            budget = _kv_budget_note(args, argv, hbm_bytes, gpu)
        except _Refused as refused:
            raise _Refused(
                f"{refused}\n  (resolved from {config} for a GPU of compute capability {capability})"
            ) from None
    passed = f"start-up checks passed (from {config}, for a GPU of compute capability {capability})"
    return "ok", f"{parsed}; {passed}{budget}"


def _check_router(argv: list[str]) -> tuple[str, str]:
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError as exc:
        return "unusable", f"cannot import sglang_router ({exc})"
    parser = argparse.ArgumentParser(prog="sglang_router.launch_router", allow_abbrev=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    namespace = _parse_with(parser, argv, "flags rejected by sglang_router's parser")
    router = RouterArgs.from_cli_args(namespace, use_router_prefix=False)
    if not (router.pd_disaggregation and router.prefill_urls and router.decode_urls):
        raise _Refused("P/D mode needs --pd-disaggregation, --prefill and --decode")
    return "ok", "flags accepted by sglang_router's parser"


def check(role: str, argv: list[str], env: dict, gpu_capability: str) -> dict:
    try:
        status, message = _check_router(argv) if role == "router" else _check_server(argv, env, gpu_capability)
    except _Refused as exc:
        status, message = "refused", str(exc)
    return {"role": role, "status": status, "message": message}


def main() -> int:
    request = json.load(sys.stdin)
    results = sys.stdout
    sys.stdout = sys.stderr  # upstream may print while resolving; the results stream carries JSON only
    json.dump(
        [check(r["role"], r["argv"], r.get("env", {}), request.get("gpu_capability", "")) for r in request["roles"]],
        results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
