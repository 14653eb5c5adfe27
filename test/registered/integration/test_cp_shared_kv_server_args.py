"""``--enable-cp-shared-kv`` against the real upstream ``ServerArgs`` resolution (CPU).

Two upstream trees are built beside the install (:mod:`sglang_cpkv.testing.upstream_trees`):
the pinned wheel's pristine files and the same files with our queue applied. Each resolves the
same command lines in its own process (:mod:`sglang_cpkv.testing.resolve_server_args`), with a
local DSA ``config.json`` and a Hopper device capability. Checked:

* flag off: every resolved field of the patched tree equals the pristine tree's, for DSA with and
  without prefill CP and for a non-DSA model (the hook is a no-op);
* flag on with a supported configuration: accepted, and nothing else changes;
* each unsupported combination: refused with the error naming it.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import DSA_CONFIG, LLAMA_CONFIG

register_cpu_ci(est_time=30, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

FLAG = "--enable-cp-shared-kv"
ALL_RANKS_ENV = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}
DRAFT_ENV = {**ALL_RANKS_ENV, "SGLANG_CP_DRAFT_SHARED_KV": "1"}
CP = ["--enable-prefill-cp", "--cp-strategy", "interleave"]
PREFILL = ["--disaggregation-mode", "prefill"]
HICACHE = "--enable-hierarchical-cache"
EAGLE = [
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    "1",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "2",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    # DSA pages are 64 * index_kpool tokens (upstream forces it over --page-size): kpool 2 -> 128.
    kpool2 = {**DSA_CONFIG, "index_kpool": 2}
    glm_dsa = {**DSA_CONFIG, "architectures": ["GlmMoeDsaForCausalLM"]}
    for name, config in (("dsa", DSA_CONFIG), ("dsa_kpool2", kpool2), ("glm_dsa", glm_dsa), ("llama", LLAMA_CONFIG)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        paths[name] = str(path)
    return paths


def _argv(models, model, *extra):
    # A fixed seed: upstream draws a random one per process otherwise.
    return [
        "--model-path",
        models[model],
        "--skip-tokenizer-init",
        "--device",
        "cuda",
        "--tp",
        "8",
        "--random-seed",
        "1",
        *extra,
    ]


def _start_resolving(tree: Path, cases: list[dict]) -> subprocess.Popen:
    python_dir = Path(__file__).resolve().parents[3] / "python"
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{python_dir}"}
    for name in DRAFT_ENV:
        env.pop(name, None)
    # stderr to a file: upstream logs warnings per case, more than a pipe holds while stdout is read.
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the process: read once it exits)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_cpkv.testing.resolve_server_args"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
    )
    proc.err_file = err
    proc.stdin.write(json.dumps(cases))
    proc.stdin.close()
    return proc


def _results(proc: subprocess.Popen) -> list[dict]:
    out = proc.stdout.read()
    code = proc.wait(timeout=600)
    if code:
        proc.err_file.seek(0)
        raise AssertionError(proc.err_file.read()[-4000:])
    return json.loads(out)


def _flag_off_cases(models):
    return [
        {"argv": _argv(models, "dsa")},
        {"argv": _argv(models, "dsa", *CP)},
        {"argv": _argv(models, "dsa", *CP, *PREFILL), "env": ALL_RANKS_ENV},
        {"argv": _argv(models, "dsa", *CP, "--attn-cp-size", "4", "--dsa-prefill-backend", "flashmla_kv")},
        {"argv": _argv(models, "llama")},
    ]


def _valid_case(models):
    return {"argv": _argv(models, "dsa", *CP, *PREFILL, FLAG), "env": ALL_RANKS_ENV}


def _speculative_cases(models):
    """EAGLE with the flag and the draft setting (accepted), and the same without the flag."""
    return [
        {"argv": _argv(models, "dsa", *CP, *PREFILL, *EAGLE, FLAG), "env": DRAFT_ENV},
        {"argv": _argv(models, "dsa", *CP, *PREFILL, *EAGLE), "env": DRAFT_ENV},
    ]


def _triton_case(models):
    """The mode with the triton_sparse_mla prefill backend (it reads the dense view like flashmla_sparse)."""
    return {
        "argv": _argv(models, "dsa", *CP, *PREFILL, "--dsa-prefill-backend", "triton_sparse_mla", FLAG),
        "env": ALL_RANKS_ENV,
    }


def _limit_case(models):
    """The mode with an explicit limit for its reserved buffers."""
    return {
        "argv": _argv(models, "dsa", *CP, *PREFILL, "--cp-shared-kv-max-batch-tokens", "1000000", FLAG),
        "env": ALL_RANKS_ENV,
    }


def _hicache_cases(models):
    """HiCache beside the mode in both host layouts it is proven with (write-through, kernel I/O, cache mode)."""
    return [
        {
            "argv": _argv(models, "dsa", *CP, *PREFILL, HICACHE, "--hicache-mem-layout", layout, FLAG),
            "env": ALL_RANKS_ENV,
        }
        for layout in ("layer_first", "page_first")
    ]


def _limit_without_mode_case(models):
    """The limit of the mode's buffers without the mode."""
    return {
        "argv": _argv(models, "dsa", *CP, *PREFILL, "--cp-shared-kv-max-batch-tokens", "1000000"),
        "env": ALL_RANKS_ENV,
    }


# (name, model, extra argv, env, a fragment of the expected error)
BAD_CASES = [
    (
        "decode role",
        "dsa",
        ["--disaggregation-mode", "decode", FLAG],
        ALL_RANKS_ENV,
        "--disaggregation-mode prefill), got 'decode'",
    ),
    ("no disaggregation", "dsa", [*CP, FLAG], ALL_RANKS_ENV, "--disaggregation-mode prefill), got 'null'"),
    ("prefill CP off", "dsa", [*PREFILL, FLAG], ALL_RANKS_ENV, "enable_prefill_cp=False, attn_cp_size=1"),
    ("zigzag", "dsa", ["--enable-prefill-cp", "--cp-strategy", "zigzag", *PREFILL, FLAG], ALL_RANKS_ENV, None),
    ("page size 128", "dsa_kpool2", [*CP, *PREFILL, FLAG], ALL_RANKS_ENV, "page size 64 (DSA index_kpool 1), got 128"),
    ("trtllm prefill", "dsa", [*CP, *PREFILL, "--dsa-prefill-backend", "trtllm", FLAG], ALL_RANKS_ENV, "got 'trtllm'"),
    (
        "tilelang prefill",
        "dsa",
        [*CP, *PREFILL, "--dsa-prefill-backend", "tilelang", FLAG],
        ALL_RANKS_ENV,
        "got 'tilelang'",
    ),
    (
        "layer split",
        "dsa",
        [*CP, *PREFILL, "--enable-dsa-cache-layer-split", "--disaggregation-transfer-backend", "mooncake", FLAG],
        ALL_RANKS_ENV,
        "--enable-dsa-cache-layer-split",
    ),
    (
        "speculative without the draft setting",
        "dsa",
        [*CP, *PREFILL, *EAGLE, FLAG],
        ALL_RANKS_ENV,
        "requires SGLANG_CPKV_DRAFT_SHARED_KV=1",
    ),
    ("EAGLE3 draft", "dsa", [*CP, *PREFILL, "--speculative-algorithm", "EAGLE3", FLAG], DRAFT_ENV, "got 'EAGLE3'"),
    (
        "nixl transfer",
        "dsa",
        [*CP, *PREFILL, "--disaggregation-transfer-backend", "nixl", FLAG],
        ALL_RANKS_ENV,
        "got 'nixl'",
    ),
    (
        "pipeline parallelism",
        "dsa",
        [*CP, *PREFILL, "--pp-size", "2", FLAG],
        ALL_RANKS_ENV,
        "requires --pp-size 1, got 2",
    ),
    ("single CP rank sends", "dsa", [*CP, *PREFILL, FLAG], {}, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1"),
    (
        "limit below one request",
        "dsa",
        [*CP, *PREFILL, "--cp-shared-kv-max-batch-tokens", "1000", FLAG],
        ALL_RANKS_ENV,
        "--cp-shared-kv-max-batch-tokens 1000 must hold one request of the context length",
    ),
    (
        "chunked prefill off",
        "dsa",
        [*CP, *PREFILL, "--chunked-prefill-size", "-1", FLAG],
        ALL_RANKS_ENV,
        "requires chunked prefill (--chunked-prefill-size > 0, got -1)",
    ),
]


def _refused(flag: str) -> str:
    """The start of the message of a feature refused beside the mode (``hooks/server_args.REFUSED_FEATURES``)."""
    return f"cannot be combined with {flag}: "


# Each feature refused beside the mode, turned on by one command line: (name, model, extra argv, env, fragment);
# the name is the case the compatibility table (docs/design/cp-shared-kv-compatibility.md) cites.
REFUSED_FEATURE_CASES = [
    ("FlexKV", "dsa", ["--enable-flexkv"], ALL_RANKS_ENV, "--enable-flexkv"),
    (
        "unified cache linker",
        "dsa",
        ["--enable-unified-cache-external-linker"],
        ALL_RANKS_ENV,
        "--enable-unified-cache-external-linker",
    ),
    ("HiSparse", "dsa", ["--enable-hisparse", "--disable-radix-cache"], ALL_RANKS_ENV, "--enable-hisparse"),
    (
        "two-batch overlap",
        "dsa",
        ["--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"],
        ALL_RANKS_ENV,
        "--enable-two-batch-overlap",
    ),
    ("DP attention", "dsa", ["--dp", "2", "--enable-dp-attention"], ALL_RANKS_ENV, "--enable-dp-attention"),
    ("attention TP in a CP rank", "dsa", ["--attn-cp-size", "4"], ALL_RANKS_ENV, "--attn-cp-size"),
    ("torch.compile", "dsa", ["--enable-torch-compile"], ALL_RANKS_ENV, "--enable-torch-compile"),
    ("mixed chunk", "dsa", ["--enable-mixed-chunk"], ALL_RANKS_ENV, "--enable-mixed-chunk"),
    ("dynamic chunking", "dsa", ["--enable-dynamic-chunking"], ALL_RANKS_ENV, "--enable-dynamic-chunking"),
    ("LoRA", "dsa", ["--enable-lora"], ALL_RANKS_ENV, "--enable-lora"),
    ("priority scheduling", "dsa", ["--enable-priority-scheduling"], ALL_RANKS_ENV, "--enable-priority-scheduling"),
    (
        "KV checksum",
        "dsa",
        ["--disaggregation-enable-kv-checksum"],
        ALL_RANKS_ENV,
        "--disaggregation-enable-kv-checksum",
    ),
    ("PD role switch", "dsa", ["--enable-pd-role-switch"], ALL_RANKS_ENV, "--enable-pd-role-switch"),
    ("indexer top-k return", "dsa", ["--enable-return-indexer-topk"], ALL_RANKS_ENV, "--enable-return-indexer-topk"),
    (
        "routed experts return",
        "dsa",
        ["--enable-return-routed-experts"],
        ALL_RANKS_ENV,
        "--enable-return-routed-experts",
    ),
    (
        "triton union",
        "dsa",
        ["--dsa-prefill-backend", "triton_sparse_mla", "--dsa-triton-union", "2"],
        ALL_RANKS_ENV,
        "--dsa-triton-union",
    ),
    ("PD multiplexing", "dsa", ["--enable-pdmux"], ALL_RANKS_ENV, "--enable-pdmux"),
    ("memory saver", "dsa", ["--enable-memory-saver"], ALL_RANKS_ENV, "--enable-memory-saver"),
    ("KV canary", "dsa", ["--kv-canary", "log"], ALL_RANKS_ENV, "--kv-canary"),
    (
        "draft KV dtype",
        "dsa",
        [*EAGLE, "--speculative-draft-kv-cache-dtype", "fp8_e4m3"],
        DRAFT_ENV,
        "--speculative-draft-kv-cache-dtype",
    ),
    (
        "draft attention backend",
        "dsa",
        [*EAGLE, "--speculative-draft-attention-backend", "dsa"],
        DRAFT_ENV,
        "--speculative-draft-attention-backend",
    ),
    ("multi-layer EAGLE", "dsa", [*EAGLE, "--enable-multi-layer-eagle"], DRAFT_ENV, "--enable-multi-layer-eagle"),
    ("adaptive speculation", "dsa", [*EAGLE, "--speculative-adaptive"], DRAFT_ENV, "--speculative-adaptive"),
    ("CP decode attention TP", "glm_dsa", ["--enable-cp-decode-attn-tp"], ALL_RANKS_ENV, "--enable-cp-decode-attn-tp"),
    (
        "decoupled speculative role",
        "dsa",
        ["--decoupled-spec-role", "verifier"],
        ALL_RANKS_ENV,
        "--decoupled-spec-role",
    ),
    # The page-interleave allocator of the mode's page ids (hooks/page_ids.py) needs upstream's built-in radix cache.
    ("radix cache backend", "dsa", ["--radix-cache-backend", "flexkv"], ALL_RANKS_ENV, "--radix-cache-backend"),
    ("streaming session", "dsa", ["--enable-streaming-session"], ALL_RANKS_ENV, "--enable-streaming-session"),
    ("session radix cache", "dsa", ["--enable-session-radix-cache"], ALL_RANKS_ENV, "--enable-session-radix-cache"),
]
BAD_CASES += [
    (name, model, [*CP, *PREFILL, *extra, FLAG], env, _refused(flag))
    for name, model, extra, env, flag in REFUSED_FEATURE_CASES
]
# HiCache beside the mode: the forms upstream's CP-sharded DSA HiCache supports, no storage backend (hooks/hicache.py).
BAD_CASES += [
    (
        "hierarchical cache with a storage backend",
        "dsa",
        [*CP, *PREFILL, HICACHE, "--hicache-storage-backend", "file", "--hicache-write-policy", "write_back", FLAG],
        ALL_RANKS_ENV,
        "cannot be combined with --hicache-storage-backend ('file')",
    ),
    (
        "hierarchical cache with direct I/O",
        "dsa",
        [*CP, *PREFILL, HICACHE, "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", FLAG],
        ALL_RANKS_ENV,
        "requires --hicache-io-backend kernel",
    ),
    (
        "hierarchical cache in another host layout",
        "dsa",
        [*CP, *PREFILL, HICACHE, "--hicache-mem-layout", "page_first_direct", FLAG],
        ALL_RANKS_ENV,
        "requires --hicache-mem-layout in ('layer_first', 'page_first')",
    ),
]
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
BAD_CASES += [
    (
        "radix tree core other than python",
        "dsa",
        [*CP, *PREFILL, FLAG],
        {**ALL_RANKS_ENV, TREE_CORE_ENV: "rust"},  # upstream's default core, chosen explicitly
        f"requires {TREE_CORE_ENV}=python (or unset) with the radix cache on",
    ),
]
# Refused by upstream's own resolution beside the mode's base configuration (the message is upstream's).
UPSTREAM_REFUSED_CASES = [
    ("deterministic inference", ["--enable-deterministic-inference"], "deterministic"),
    ("KV dtype fp8_e5m2", ["--kv-cache-dtype", "fp8_e5m2"], "fp8_e4m3"),
    ("DCP", ["--dcp-size", "2"], "dcp"),
    ("LMCache", ["--enable-lmcache"], "lmcache"),
    ("page-major KV layout", ["--enable-page-major-kv-layout"], "page"),
    ("unified memory", ["--enable-unified-memory"], "'dsa'"),
    ("multi-item scoring", ["--enable-mis"], "flashinfer"),
    ("NGRAM", ["--speculative-algorithm", "NGRAM"], "topk"),
    ("kv sharding", ["--enable-kv-cache-sharding"], "KV sharding"),
    ("diffusion decoding", ["--dllm-algorithm", "LowConfidence"], "diffusion LLM"),
    # buffer_only needs a storage backend, which the mode refuses (hooks/hicache.py).
    (
        "hierarchical cache as a storage buffer",
        [HICACHE, "--hicache-host-memory-mode", "buffer_only"],
        "storage backend",
    ),
]


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    from sglang_cpkv.testing.upstream_trees import patched_tree, pristine_tree

    off = _flag_off_cases(models)
    non_dsa = {"argv": _argv(models, "llama", *CP, *PREFILL, FLAG), "env": ALL_RANKS_ENV}
    bad = [{"argv": _argv(models, model, *extra), "env": env} for _, model, extra, env, _ in BAD_CASES]
    bad += [
        {"argv": _argv(models, "dsa", *CP, *PREFILL, *extra, FLAG), "env": ALL_RANKS_ENV}
        for _, extra, _ in UPSTREAM_REFUSED_CASES
    ]
    # Both trees resolve at once (two processes; the imports dominate).
    patched_proc = _start_resolving(
        patched_tree(tmp_path_factory.mktemp("patched")),
        off
        + [_valid_case(models), non_dsa]
        + bad
        + _speculative_cases(models)
        + [_triton_case(models)]
        + [_limit_case(models)]
        + [_limit_without_mode_case(models)]
        + _hicache_cases(models),
    )
    nbad = len(BAD_CASES) + len(UPSTREAM_REFUSED_CASES)
    pristine_proc = _start_resolving(pristine_tree(tmp_path_factory.mktemp("pristine")), off + [_valid_case(models)])
    patched, pristine = _results(patched_proc), _results(pristine_proc)
    n = len(off)
    return {
        "pristine_off": pristine[:n],
        "patched_off": patched[:n],
        "pristine_valid": pristine[n],
        "patched_valid": patched[n],
        "non_dsa": patched[n + 1],
        "bad": dict(zip([name for name, *_ in BAD_CASES], patched[n + 2 : n + 2 + len(BAD_CASES)])),
        "upstream_refused": dict(
            zip([name for name, *_ in UPSTREAM_REFUSED_CASES], patched[n + 2 + len(BAD_CASES) : n + 2 + nbad])
        ),
        "speculative": patched[n + 2 + nbad],
        "speculative_off": patched[n + 3 + nbad],
        "triton_sparse_mla": patched[n + 4 + nbad],
        "limit": patched[n + 5 + nbad],
        "limit_without_mode": patched[n + 6 + nbad],
        "hicache": patched[n + 7 + nbad :],
    }


OUR_FIELDS = ("enable_cp_shared_kv", "cp_shared_kv_max_batch_tokens")


def _without_flag(resolved: dict) -> dict:
    return {k: v for k, v in resolved.items() if k not in OUR_FIELDS}


def test_patched_tree_has_the_flag_and_pristine_does_not(results):
    assert results["patched_off"][0]["resolved"]["enable_cp_shared_kv"] == "False"
    assert results["patched_off"][0]["resolved"]["cp_shared_kv_max_batch_tokens"] == "None"
    assert not set(OUR_FIELDS) & set(results["pristine_off"][0]["resolved"])
    # The pristine parser does not know the flag at all.
    assert results["pristine_valid"]["error"] == "SystemExit"


@pytest.mark.parametrize("case", range(5))
def test_flag_off_resolves_exactly_like_pristine_upstream(results, case):
    pristine, patched = results["pristine_off"][case], results["patched_off"][case]
    assert "resolved" in pristine, pristine
    assert "resolved" in patched, patched
    assert _without_flag(patched["resolved"]) == pristine["resolved"]


def test_triton_sparse_mla_prefill_backend_is_accepted(results):
    accepted = results["triton_sparse_mla"]
    assert "resolved" in accepted, accepted
    assert accepted["resolved"]["dsa_prefill_backend"] == "'triton_sparse_mla'"  # resolved values are reprs


def test_an_explicit_limit_for_the_reserved_buffers_is_accepted(results):
    accepted = results["limit"]
    assert "resolved" in accepted, accepted
    assert accepted["resolved"]["cp_shared_kv_max_batch_tokens"] == "1000000"


def test_flag_on_supported_configuration_is_accepted_and_changes_nothing_else(results):
    valid = results["patched_valid"]
    assert "resolved" in valid, valid
    assert valid["resolved"]["enable_cp_shared_kv"] == "True"
    assert valid["resolved"]["attn_cp_size"] == "8"
    assert valid["resolved"]["page_size"] == "64"
    # Same command line without the flag (case 2 of the flag-off set) resolves to the same values.
    assert _without_flag(valid["resolved"]) == _without_flag(results["patched_off"][2]["resolved"])


def test_eagle_with_the_draft_setting_is_accepted_and_changes_nothing_else(results):
    got, off = results["speculative"], results["speculative_off"]
    assert "resolved" in got, got
    assert "resolved" in off, off
    assert got["resolved"]["enable_cp_shared_kv"] == "True"
    assert got["resolved"]["speculative_algorithm"] == repr("EAGLE")
    assert _without_flag(got["resolved"]) == _without_flag(off["resolved"])


def test_non_dsa_model_is_refused(results):
    got = results["non_dsa"]
    assert got.get("error") == "ValueError", got
    assert "requires a DSA model" in got["message"] and "LlamaForCausalLM" in got["message"]


@pytest.mark.parametrize("name, model, extra, env, fragment", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_unsupported_combination_is_refused(results, name, model, extra, env, fragment):
    got = results["bad"][name]
    assert "error" in got, f"{name}: accepted, expected a refusal"
    if name == "zigzag":
        # Upstream refuses DeepSeek-V3.2 + zigzag before our hook; either refusal names zigzag.
        assert "zigzag" in got["message"], got
        return
    assert got["error"] == "ValueError", got
    assert got["message"].startswith(FLAG), got
    assert fragment in got["message"], got


@pytest.mark.parametrize("name", [c[0] for c in UPSTREAM_REFUSED_CASES])
def test_refused_by_upstream_beside_the_mode(results, name):
    got = results["upstream_refused"][name]
    fragment = {c[0]: c[2] for c in UPSTREAM_REFUSED_CASES}[name]
    assert "error" in got, f"{name}: accepted, expected upstream's refusal"
    assert fragment.lower() in got["message"].lower(), got


@pytest.mark.parametrize("layout", [0, 1])
def test_hierarchical_cache_in_the_proven_forms_is_accepted(results, layout):
    got = results["hicache"][layout]
    assert "resolved" in got, got
    assert got["resolved"]["enable_hierarchical_cache"] == "True"
    assert got["resolved"]["hicache_mem_layout"] == repr(("layer_first", "page_first")[layout])
    assert got["resolved"]["hicache_io_backend"] == repr("kernel")


def test_the_hicache_hook_stands_where_upstream_wraps_its_own_sharded_host_pool():
    """The premises of hooks/hicache.py in the pinned wheel: upstream wraps the KV host pool in its sharded wrapper only
    beside a device pool with the kv-sharding mixin (the mode's DSA pool has none: the patch wraps it), and a load-back
    under a page-interleave allocator (the mode's) allocates page ids of its host copy's owner class."""
    import inspect

    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller, hybrid_pool_assembler
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    assert not issubclass(DSATokenToKVPool, PageInterleaveKVPoolMixin)
    source = inspect.getsource(hybrid_pool_assembler.build_kv_host_pool)
    assert "isinstance(kv_pool, PageInterleaveKVPoolMixin)" in source
    assert "cp_shared_kv_hicache.owner_sharded_host_pool(host_pool, kv_pool)" in source
    load = inspect.getsource(hybrid_cache_controller.HybridCacheController.load)
    assert "isinstance(full_allocator, PageInterleavePoolAllocator)" in load and "alloc_cyclic(" in load


def test_the_limit_without_the_mode_is_refused(results):
    got = results["limit_without_mode"]
    assert got.get("error") == "ValueError", got
    assert got["message"].startswith("--cp-shared-kv-max-batch-tokens 1000000 needs --enable-cp-shared-kv"), got


# Only Glm5Next resolves these on, and upstream refuses that hybrid model on a CPU platform before the mode's
# hook (its Mamba cache): the base configuration is resolved, then the value is declared the way upstream's model
# hooks declare theirs (a resolved override), and the hook runs again on it.
GLM5NEXT_ONLY = {
    "CP-TP group sharing (Glm5Next resolves it on)": lambda view: {"enable_cp_tp_group_sharing": True},
    "--cuda-graph-backend-prefill": lambda view: {
        "cuda_graph_config": dataclasses.replace(
            view.cuda_graph_config, prefill=dataclasses.replace(view.cuda_graph_config.prefill, backend="breakable")
        )
    },
}


@pytest.mark.parametrize("flag", list(GLM5NEXT_ONLY))
def test_refusals_only_a_glm5next_server_reaches(models, flag, monkeypatch):
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import torch
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_cpkv.hooks.server_args import validate_cp_shared_kv_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for name, value in ALL_RANKS_ENV.items():
        monkeypatch.setenv(name, value)
    server_args = prepare_server_args(_valid_case(models)["argv"])
    server_args.resolve_once()
    validate_cp_shared_kv_args(server_args)  # the base configuration is accepted
    server_args._resolved_overrides.append(("glm5next", GLM5NEXT_ONLY[flag](resolving_view(server_args))))
    with pytest.raises(ValueError, match=re.escape(_refused(flag))):
        validate_cp_shared_kv_args(server_args)


@pytest.mark.parametrize(
    "core, extra, left",
    [(None, [], "python"), ("python", [], "python"), ("rust", ["--disable-radix-cache"], "rust")],
    ids=["unset", "python", "rust-without-radix-cache"],
)
def test_the_mode_takes_the_rotation_aware_tree_core(models, monkeypatch, core, extra, left):
    """The radix tree core the page-interleave allocator needs: chosen when the operator did not choose (as upstream's
    kv-sharding does), kept when it is upstream's Python core, and any core with the radix cache off (no tree)."""
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import torch
    from sglang.srt.server_args import prepare_server_args

    from sglang_cpkv.hooks.server_args import validate_cp_shared_kv_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for name, value in ALL_RANKS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(TREE_CORE_ENV, "unused")  # recorded, so that the value the hook leaves is put back
    if core is None:
        monkeypatch.delenv(TREE_CORE_ENV)
    else:
        monkeypatch.setenv(TREE_CORE_ENV, core)
    server_args = prepare_server_args([*_valid_case(models)["argv"], *extra])
    server_args.resolve_once()
    assert server_args.enable_cp_shared_kv
    validate_cp_shared_kv_args(server_args)  # accepted, and again on the value it left
    assert os.environ[TREE_CORE_ENV] == left


def test_a_refused_start_up_leaves_the_tree_core_setting_as_it_was(models, monkeypatch):
    """The tree core the mode chooses is written only once every check has passed: a resolution refused by the last
    check (no all-CP-ranks transfer) leaves the variable unset."""
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import torch
    from sglang.srt.server_args import prepare_server_args

    from sglang_cpkv.hooks.server_args import validate_cp_shared_kv_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for name, value in ALL_RANKS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(TREE_CORE_ENV, "unused")  # recorded, so that the value the hook leaves is put back
    monkeypatch.delenv(TREE_CORE_ENV)
    server_args = prepare_server_args(_valid_case(models)["argv"])
    server_args.resolve_once()  # accepted: the mode chose the Python core
    assert os.environ[TREE_CORE_ENV] == "python"
    monkeypatch.delenv(TREE_CORE_ENV)
    for name in ALL_RANKS_ENV:
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1"):
        validate_cp_shared_kv_args(server_args)
    assert TREE_CORE_ENV not in os.environ


def test_every_refused_feature_has_a_case():
    """A refusal added to the hook without a command line that proves it fails here."""
    from sglang_cpkv.hooks.server_args import REFUSED_FEATURES

    tested = {flag for *_, flag in REFUSED_FEATURE_CASES} | set(GLM5NEXT_ONLY)
    missing = [r.flag for r in REFUSED_FEATURES if r.flag not in tested]
    assert not missing, f"no REFUSED_FEATURE_CASES entry turns these on: {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
