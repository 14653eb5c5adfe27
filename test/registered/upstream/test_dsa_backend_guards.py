"""DSA prefill/decode backends and the FP8 KV row layout, against the real (patched) 0.5.23 ServerArgs.

Every case resolves a real ``ServerArgs`` for a local DeepSeek-V3.2 config on CPU (a patched
``torch.cuda.get_device_capability`` plays the GPU) and reads the pool row size from upstream's own
``calculate_mla_kv_cache_dim``. What each backend *reads* is the independent fact from upstream's
``dsa_backend.py``: trtllm and tilelang read raw FP8 rows, flashmla_* dequantize packed ones.

* User-set backends are respected on SM>=10 (the seed's first bug, fixed upstream in April 2026):
  no patch; the manifest's history records it.
* The layout mix on pristine upstream is shown by running pristine upstream logic: the pristine
  ``_dsa_split_backend_resolution`` is rebuilt by reverse-applying the queue's patches to the
  installed ``overrides.py`` (its sha256 must equal the manifest's pristine hash) and swapped into
  the resolution pipeline for the "unpatched" runs.
* The table: for (SM 90/100/103, kv dtype, role, prefill set or not, decode set or not) the patched
  resolution equals the pristine one except exactly where the pristine one mixes FP8 layouts; there
  the unset side joins the user-set side's family, or an explicit mix fails on a non-P/D server.
* P/D: the patched ``get_pd_kv_layout`` publishes the DSA FP8 layout and the decode side's
  ``try_ensure_parallel_info`` refuses a prefill server with the other layout, before any transfer.

On unpatched upstream the reverse-apply, the family, the refusal and the P/D cases fail.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import sys
import types
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.overlay.patches import Patch, apply_patch  # noqa: E402
from sglang_cpkv.overlay.queue import load_queue  # noqa: E402
from sglang_cpkv.upstream_import import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.arg_groups import model_hook, overrides  # noqa: E402
from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402
from sglang.srt.disaggregation.common import conn as common_conn  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

MODEL_DIR = Path(__file__).parent / "fixtures" / "dsa_v32"  # DeepseekV32ForCausalLM, kv_lora 512, rope 64
RAW_ROW, PACKED_ROW = 576, 656  # 512 + 64 fp8; 512 fp8 + 16 scale bytes + 64 bf16
# What each backend's kernels read from an FP8 pool (dsa_backend.py: _forward_trtllm, the TileLang
# kernels, and the flashmla_* paths that dequantize / feed FlashMLA's FP8 kernels).
READS_ROW = {
    "trtllm": RAW_ROW,
    "tilelang": RAW_ROW,
    "flashmla_auto": PACKED_ROW,
    "flashmla_kv": PACKED_ROW,
    "flashmla_sparse": PACKED_ROW,
}
OVERRIDES_REL = "srt/arg_groups/overrides.py"
REPO_ROOT = Path(__file__).resolve().parents[3]


def pristine_split_backend_resolution():
    """Upstream's own ``_dsa_split_backend_resolution``, from the installed file minus our patches."""
    queue = load_queue(REPO_ROOT)
    path = Path(overrides.__file__)
    files = {OVERRIDES_REL: path.read_text().splitlines(keepends=True)}
    touching = [p for p in queue.parsed() if OVERRIDES_REL in p.touches]
    assert touching, "no patch in the queue touches overrides.py: the layout guard is not applied"
    for patch in reversed(touching):
        single = Patch(patch.name, patch.header, [fp for fp in patch.files if fp.path == OVERRIDES_REL])
        apply_patch(files, single, reverse=True)
    text = "".join(files[OVERRIDES_REL])
    want = queue.manifest["pristine_sha256"][OVERRIDES_REL]
    assert hashlib.sha256(text.encode()).hexdigest() == want, "reverse-applied overrides.py is not the pinned original"
    tree = ast.parse(text)
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_dsa_split_backend_resolution"]
    func.decorator_list = []  # do not register it a second time
    namespace = dict(vars(overrides))
    exec(compile(ast.Module(body=[func], type_ignores=[]), f"<pristine {OVERRIDES_REL}>", "exec"), namespace)
    return namespace["_dsa_split_backend_resolution"]


@pytest.fixture(scope="module")
def pristine_pass():
    return pristine_split_backend_resolution()


def resolve(monkeypatch, *, sm, kv, role="null", prefill=None, decode=None, split_pass=None):
    """Resolve one ServerArgs; return ("ok", prefill, decode, pool row) or ("error", message)."""
    args = ServerArgs(
        model_path=str(MODEL_DIR),
        skip_tokenizer_init=True,
        device="cuda",
        kv_cache_dtype=kv,
        disaggregation_mode=role,
        dsa_prefill_backend=prefill,
        dsa_decode_backend=decode,
    )
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "get_device_capability", lambda *a, **k: sm)
        if split_pass is not None:
            patched.setattr(model_hook, "_dsa_split_backend_resolution", split_pass)
        try:
            args.resolve_once()
        except (ValueError, AssertionError) as exc:
            return ("error", str(exc))
    resolved = args.resolved_dict()
    runtime_context.get_context().set_server_args(args)
    hf = overrides.model_config_of(args).hf_config
    model_config = types.SimpleNamespace(
        hf_config=hf, kv_lora_rank=hf.kv_lora_rank, qk_rope_head_dim=hf.qk_rope_head_dim
    )
    dtype = torch.float8_e4m3fn if resolved["kv_cache_dtype"] == "fp8_e4m3" else torch.bfloat16
    row = calculate_mla_kv_cache_dim(model_config=model_config, kv_cache_dtype=dtype)
    return ("ok", resolved["dsa_prefill_backend"], resolved["dsa_decode_backend"], row)


def test_user_set_backends_respected_on_blackwell(monkeypatch):
    """The seed's first bug (SM>=10 FP8 overwrote user-set backends) is gone upstream."""
    for sm in ((10, 0), (10, 3)):
        got = resolve(monkeypatch, sm=sm, kv="fp8_e4m3", prefill="flashmla_sparse", decode="flashmla_kv")
        assert got[:3] == ("ok", "flashmla_sparse", "flashmla_kv"), got
        got = resolve(monkeypatch, sm=sm, kv="bfloat16", prefill="flashmla_sparse", decode="fa3")
        assert got[:3] == ("ok", "flashmla_sparse", "fa3"), got


def test_pristine_upstream_mixes_layouts(monkeypatch, pristine_pass):
    """The bug, run on pristine logic: one flashmla flag on SM100 FP8 leaves the pool raw."""
    got = resolve(monkeypatch, sm=(10, 0), kv="fp8_e4m3", prefill="flashmla_auto", split_pass=pristine_pass)
    assert got == ("ok", "flashmla_auto", "trtllm", RAW_ROW), got  # flashmla prefill on a raw pool
    got = resolve(monkeypatch, sm=(10, 0), kv="fp8_e4m3", decode="flashmla_kv", split_pass=pristine_pass)
    assert got == ("ok", "trtllm", "flashmla_kv", RAW_ROW), got  # flashmla decode on a raw pool
    # P/D with the same flag on both servers: prefill pool packed, decode pool raw.
    prefill = resolve(
        monkeypatch, sm=(10, 0), kv="fp8_e4m3", role="prefill", prefill="flashmla_auto", split_pass=pristine_pass
    )
    decode = resolve(
        monkeypatch, sm=(10, 0), kv="fp8_e4m3", role="decode", prefill="flashmla_auto", split_pass=pristine_pass
    )
    assert (prefill[3], decode[3]) == (PACKED_ROW, RAW_ROW), (prefill, decode)


def test_explicit_mix_refused_at_start_up(monkeypatch):
    got = resolve(monkeypatch, sm=(10, 0), kv="fp8_e4m3", prefill="flashmla_auto", decode="trtllm")
    assert got[0] == "error", got
    message = got[1]
    for needed in (
        "--dsa-prefill-backend flashmla_auto",
        "--dsa-decode-backend trtllm",
        "656-byte",
        "576-byte",
        "Fix:",
    ):
        assert needed in message, (needed, message)


SMS = ((9, 0), (10, 0), (10, 3))
KV_DTYPES = ("bfloat16", "fp8_e4m3")
ROLES = ("null", "prefill", "decode")
PREFILL_CHOICES = (None, "flashmla_auto", "trtllm", "tilelang")
DECODE_CHOICES = (None, "flashmla_kv", "trtllm", "fa3")


def test_resolution_table_changes_only_layout_mixes(monkeypatch, pristine_pass):
    changed = []
    for sm, kv, role, prefill, decode in itertools.product(SMS, KV_DTYPES, ROLES, PREFILL_CHOICES, DECODE_CHOICES):
        case = dict(sm=sm, kv=kv, role=role, prefill=prefill, decode=decode)
        before = resolve(monkeypatch, split_pass=pristine_pass, **case)
        after = resolve(monkeypatch, **case)
        one_set = (prefill is None) != (decode is None)
        user = prefill if prefill is not None else decode
        if kv != "fp8_e4m3" or (prefill is None and decode is None):
            assert after == before, (case, before, after)
            continue
        if one_set:
            # Upstream's default for the unset side reads other rows (or upstream refuses that pair).
            mixed = user in READS_ROW and (before[0] == "error" or READS_ROW.get(before[1]) != READS_ROW.get(before[2]))
            if not mixed:
                assert after == before, (case, before, after)
                continue
            changed.append(case)
            assert after[0] == "ok", (case, before, after)
            assert (after[1] if prefill is not None else after[2]) == user, (case, after)
            assert READS_ROW[after[1]] == READS_ROW[after[2]] == READS_ROW[user], (case, after)
            assert role != "null" or after[3] == READS_ROW[user], (case, after)  # the pool holds what both read
            continue
        explicit_mix = prefill in READS_ROW and decode in READS_ROW and READS_ROW[prefill] != READS_ROW[decode]
        if not explicit_mix or role != "null":
            assert after == before, (case, before, after)
            continue
        changed.append(case)
        assert after[0] == "error" and "--dsa-prefill-backend" in after[1] and "--dsa-decode-backend" in after[1], (
            case,
            after,
        )
    # The changes are exactly the FP8 mixes: one flashmla/trtllm/tilelang flag on the "wrong" default.
    assert any(c["sm"] == (10, 0) and c["prefill"] == "flashmla_auto" and c["decode"] is None for c in changed)
    assert any(c["sm"] == (9, 0) and c["prefill"] == "trtllm" and c["decode"] is None for c in changed)


def test_pd_pair_with_same_flags_agrees(monkeypatch):
    for sm, prefill, decode in (
        ((10, 0), "flashmla_auto", None),
        ((10, 3), None, "flashmla_kv"),
        ((9, 0), "trtllm", None),
    ):
        rows = [
            resolve(monkeypatch, sm=sm, kv="fp8_e4m3", role=role, prefill=prefill, decode=decode)[3]
            for role in ("prefill", "decode")
        ]
        assert rows[0] == rows[1], (sm, prefill, decode, rows)


def _dsa_pool(row: int):
    """The attributes upstream's DSATokenToKVPool exposes for its FP8 layout."""
    return types.SimpleNamespace(
        use_dsa=True, dtype=torch.float8_e4m3fn, dsa_kv_cache_store_fp8=row == PACKED_ROW, kv_cache_dim=row
    )


def _decode_manager(decode_row: int):
    """A decode-side CommonKVManager's state as try_ensure_parallel_info reads it before any transfer."""
    kv_args = types.SimpleNamespace(page_size=64, state_types=[])
    manager = types.SimpleNamespace(
        prefill_info_table={},
        kv_args=kv_args,
        kv_cache_dtype_str="fp8_e4m3",
        kv_layout=disagg_utils.get_pd_kv_layout(_dsa_pool(decode_row)),
        attn_tp_size=1,
        is_mla_backend=True,
        is_hybrid_mla_backend=False,
        dsv41_spec_layout=None,
    )
    return manager


def test_pd_handshake_refuses_layout_mismatch(monkeypatch):
    assert disagg_utils.get_pd_kv_layout(_dsa_pool(PACKED_ROW)) != disagg_utils.get_pd_kv_layout(_dsa_pool(RAW_ROW))
    assert disagg_utils.get_pd_kv_layout(types.SimpleNamespace(use_dsa=True, dtype=torch.bfloat16)) is None
    prefill_info = common_conn.PrefillServerInfo(
        attn_tp_size=1,
        attn_cp_size=8,
        dp_size=1,
        pp_size=1,
        page_size=64,
        kv_cache_dtype="fp8_e4m3",
        follow_bootstrap_room=True,
        kv_layout=disagg_utils.get_pd_kv_layout(_dsa_pool(PACKED_ROW)),
    )
    response = types.SimpleNamespace(status_code=200, json=lambda: dataclasses.asdict(prefill_info))
    monkeypatch.setattr(common_conn.requests, "get", lambda *a, **k: response)
    with pytest.raises(RuntimeError) as refused:
        common_conn.CommonKVManager.try_ensure_parallel_info(_decode_manager(RAW_ROW), "prefill:8998")
    for needed in ("packed 656-byte", "raw 576-byte", "--dsa-prefill-backend", "--dsa-decode-backend", "Fix:"):
        assert needed in str(refused.value), (needed, str(refused.value))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
