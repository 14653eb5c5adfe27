"""The bs>1 contamination client against a local, deterministic /v1/completions server.

The fake server answers with a pure function of the prompt (its tail, which carries the request's marker,
plus a digest). Faults are planted only while two or more requests are in flight, i.e. in the client's
bs=N pass and never in its sequential bs=1 golden passes, the way a batching bug shows up:
  leak     - one request gets another in-flight request's answer (that request's marker)
  mismatch - one answer differs by a byte, no marker involved
  error    - one request gets HTTP 500
  abort    - one request gets HTTP 200 with finish_reason "abort" (the server gave up on it)
  null     - one request gets HTTP 200 with "text": null
and two faults of the whole server: "nondeterministic" answers differ from one call to the next even alone
(bs=1), and "models-not-json" answers /v1/models with a page that is not JSON.
"""

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from sglang_cpkv.contamination_client import (
    EXIT_CONTAMINATION,
    EXIT_INTERNAL,
    EXIT_MISMATCH,
    EXIT_NONDETERMINISTIC,
    EXIT_PASS,
    EXIT_REQUEST_ERROR,
    EXIT_USAGE,
    VERDICTS,
    main,
    make_markers,
    make_probes,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="cpkv-cpu")

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "validate_bs_gt1_contamination.py"
MODEL = "fake-dsa"
CLIENT_ARGS = ["-n", "4", "--prefix-words", "200", "--max-tokens", "16", "--timeout", "30"]


def answer(prompt: str) -> str:
    return prompt[-160:] + " | " + hashlib.sha256(prompt.encode()).hexdigest()[:16]


class FakeServer:
    def __init__(self, mode: str):
        self.mode = mode
        self.in_flight: list[str] = []
        self.planted = 0
        self.requests = 0
        self.calls: dict[str, int] = {}
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def models(self, request):
        if self.mode == "models-not-json":
            return web.Response(status=200, text="<html>a proxy login page</html>", content_type="text/html")
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        assert body["temperature"] == 0 and body["model"] == MODEL
        prompt = body["prompt"]
        self.requests += 1
        self.calls[prompt] = self.calls.get(prompt, 0) + 1
        self.in_flight.append(prompt)
        finish_reason = "length"
        try:
            await asyncio.sleep(0.05)  # let a concurrent batch arrive
            text = answer(prompt)
            if self.mode == "nondeterministic":
                text += f" (call {self.calls[prompt]})"
            elif self.mode not in ("clean", "models-not-json") and len(self.in_flight) > 1 and not self.planted:
                self.planted += 1
                if self.mode == "leak":
                    text = answer(next(p for p in self.in_flight if p != prompt))
                elif self.mode == "mismatch":
                    text = text[:-1] + ("0" if text[-1] != "0" else "1")
                elif self.mode == "error":
                    return web.Response(status=500, text="planted failure")
                elif self.mode == "abort":
                    text, finish_reason = text[:10], "abort"
                elif self.mode == "null":
                    text = None
        finally:
            self.in_flight.remove(prompt)
        return web.json_response(
            {
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
            }
        )

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def run_client(server: FakeServer, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    code = main(["--url", server.url, *CLIENT_ARGS, "--out", str(out), *extra])
    return code, json.loads(out.read_text())


def test_markers_are_distinct_fixed_width_and_in_each_prompt_tail():
    markers = make_markers(64, seed=7)
    assert len(set(markers)) == 64 and {len(m) for m in markers} == {13}
    assert not any(a != b and a in b for a in markers for b in markers)
    probes = make_probes(4, prefix_words=50, seed=7)
    prefixes = {p.prompt[: p.prompt.index("\n\nThe secret code")] for p in probes}
    assert len(prefixes) == 1  # one shared prefix
    assert all(p.marker in answer(p.prompt) for p in probes)  # the fake echoes the marker


def test_clean_server_passes_and_the_report_holds_every_text_and_finish_reason(tmp_path):
    with FakeServer("clean") as server:
        code, summary = run_client(server, tmp_path, "--rounds", "2")
    assert code == EXIT_PASS and summary["passed"] and summary["verdict"] == "pass"
    assert summary["model"] == MODEL
    assert len(summary["results"]) == 8 and all(r["equal"] and not r["leaked_markers"] for r in summary["results"])
    assert server.requests == 2 * 4 + 2 * 4  # two sequential bs=1 passes + two concurrent rounds
    probes = make_probes(4, prefix_words=200, seed=0)
    for pass_name in ("golden", "golden_repeat"):
        assert [(g["index"], g["text"], g["finish_reason"]) for g in summary[pass_name]] == [
            (p.index, answer(p.prompt), "length") for p in probes
        ]
    for r in summary["results"]:
        assert r["text"] == answer(probes[r["index"]].prompt) and r["finish_reason"] == "length"
    assert summary["nondeterministic"] == [] and summary["errors"] == []


def test_planted_leak_is_flagged_and_exits_nonzero(tmp_path):
    out = tmp_path / "leak.json"
    with FakeServer("leak") as server:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--url", server.url, *CLIENT_ARGS, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == EXIT_CONTAMINATION, proc.stderr
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary
    assert summary["verdict"] == "contamination" and not summary["passed"]
    assert len(summary["contaminated"]) == 1 and summary["golden_leaks"] == []
    victim = next(r for r in summary["results"] if r["leaked_markers"])
    others = {r["marker"] for r in summary["results"]} - {victim["marker"]}
    assert len(victim["leaked_markers"]) == 1 and victim["leaked_markers"][0] in others
    assert not victim["equal"] and victim["leaked_markers"][0] in victim["text"]


def test_byte_mismatch_without_marker_is_a_mismatch(tmp_path):
    with FakeServer("mismatch") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_MISMATCH and summary["verdict"] == "mismatch"
    assert summary["contaminated"] == [] and len(summary["mismatched"]) == 1
    bad = next(r for r in summary["results"] if not r["equal"])
    assert bad["first_diff"] == bad["golden_bytes"] - 1 and bad["batch_bytes"] == bad["golden_bytes"]


def test_failed_request_is_a_request_error(tmp_path):
    with FakeServer("error") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_REQUEST_ERROR and summary["verdict"] == "request_error"
    assert len(summary["errors"]) == 1 and "HTTP 500" in summary["errors"][0]


def test_aborted_request_is_a_request_error_not_a_mismatch(tmp_path):
    with FakeServer("abort") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_REQUEST_ERROR and summary["verdict"] == "request_error", summary
    assert len(summary["errors"]) == 1 and "finish_reason abort" in summary["errors"][0]
    assert summary["mismatched"] == [] and len(summary["results"]) == 3


def test_a_null_text_is_a_request_error_not_an_internal_error(tmp_path):
    with FakeServer("null") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_REQUEST_ERROR and summary["verdict"] == "request_error", summary
    assert len(summary["errors"]) == 1 and "choices[0].text is not a string" in summary["errors"][0]


def test_server_nondeterministic_at_bs1_is_its_own_verdict(tmp_path):
    with FakeServer("nondeterministic") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_NONDETERMINISTIC and summary["verdict"] == "nondeterministic"
    assert [n["index"] for n in summary["nondeterministic"]] == [0, 1, 2, 3]
    assert len(summary["mismatched"]) == 4  # reported, but not the verdict: bs=1 itself does not repeat


def test_models_answer_that_is_not_json_is_a_request_error(tmp_path):
    with FakeServer("models-not-json") as server:
        code, summary = run_client(server, tmp_path)
    assert code == EXIT_REQUEST_ERROR and "GET /v1/models: not JSON" in summary["errors"][0]
    assert server.requests == 0


def run_main(args) -> int:
    try:
        return main(args)
    except SystemExit as exc:  # argparse's own errors exit from inside main
        return exc.code


@pytest.mark.parametrize(
    "args",
    [
        ["-n", "1"],
        ["-n", "100000"],
        ["--url", "http://127.0.0.1:8000/v1/completions"],
        ["--rounds", "0"],
        ["-n", "x"],
        ["--no-such-flag"],
        # 0, negatives and nan would each mean "no timeout" to aiohttp
        ["--timeout", "0"],
        ["--timeout", "-1"],
        ["--timeout", "nan"],
        ["--timeout", "inf"],
    ],
)
def test_usage_errors_exit_with_a_code_no_verdict_uses(args, capsys):
    assert run_main(args) == EXIT_USAGE
    assert EXIT_USAGE not in {code for _, code in VERDICTS} | {EXIT_INTERNAL}
    assert "Traceback" not in capsys.readouterr().err


def test_out_is_checked_before_anything_is_sent(tmp_path, capsys):
    with FakeServer("clean") as server:
        missing = main(["--url", server.url, *CLIENT_ARGS, "--out", str(tmp_path / "no-such-dir" / "r.json")])
        directory = main(["--url", server.url, *CLIENT_ARGS, "--out", str(tmp_path)])
    assert missing == directory == EXIT_USAGE and server.requests == 0
    err = capsys.readouterr().err
    assert "does not exist" in err and "is a directory" in err and "Traceback" not in err


def test_missing_aiohttp_is_a_configuration_error():
    code = "import sys; sys.modules['aiohttp'] = None; from sglang_cpkv.contamination_client import main; sys.exit(main([]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_USAGE and "needs aiohttp" in proc.stderr and "Traceback" not in proc.stderr


def test_help_documents_every_exit_status():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    codes = [code for _, code in VERDICTS] + [EXIT_USAGE, EXIT_INTERNAL]
    assert len(set(codes)) == len(codes)
    for code in codes:
        assert f"\n  {code}  " in proc.stdout, code


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
