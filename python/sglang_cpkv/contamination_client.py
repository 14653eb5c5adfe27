"""Live bs>1 contamination check against a running server or P/D router (OpenAI ``/v1/completions``).

Exit status (the most serious that applies, in this order; the method: ``docs/operations.md``, "Check bs>1"):
  1  contamination: an answer contains another request's marker
  4  nondeterministic: the two bs=1 passes differ, so bs>1 cannot be judged against them
  2  mismatch: a bs=N answer differs from its bs=1 golden, no marker involved
  3  request error: a request failed (HTTP error, timeout, malformed answer, finish_reason "abort")
  0  pass: every bs=N answer equals its golden, no marker leaked
  5  usage or configuration error (bad arguments, --out not writable, aiohttp missing): nothing was sent
  6  internal error of this client (a bug: the traceback is printed)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import aiohttp

EXIT_PASS = 0
EXIT_CONTAMINATION = 1
EXIT_MISMATCH = 2
EXIT_REQUEST_ERROR = 3
EXIT_NONDETERMINISTIC = 4
EXIT_USAGE = 5
EXIT_INTERNAL = 6
# The verdicts, most serious first: the first that applies is the run's verdict and exit status.
VERDICTS = (
    ("contamination", EXIT_CONTAMINATION),
    ("nondeterministic", EXIT_NONDETERMINISTIC),
    ("mismatch", EXIT_MISMATCH),
    ("request_error", EXIT_REQUEST_ERROR),
    ("pass", EXIT_PASS),
)
MAX_REQUESTS = 256
MAX_ROUNDS = 20
MAX_NEW_TOKENS = 4096
MAX_PREFIX_WORDS = 200_000
DEFAULT_URL = "http://127.0.0.1:8000"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
ABORT_FINISH_REASON = "abort"

# Words of the shared prefix: plain, tokenizer-friendly, no digit runs that could look like a marker.
PREFIX_VOCAB = [
    "river",
    "stone",
    "lantern",
    "orchard",
    "valley",
    "harbor",
    "meadow",
    "copper",
    "signal",
    "garden",
    "ledger",
    "bridge",
    "canyon",
    "compass",
    "thunder",
    "window",
    "pepper",
    "violet",
    "marble",
    "summit",
    "anchor",
    "feather",
    "cinder",
    "glacier",
]


class ClientError(Exception):
    """A request that did not produce a completion (HTTP status, timeout, malformed body, an abort)."""


class UsageError(Exception):
    """A bad argument or setting, found before anything is sent."""


@dataclass(frozen=True)
class Probe:
    index: int
    marker: str
    prompt: str


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None


@dataclass
class RequestResult:
    index: int
    marker: str
    round: int
    equal: bool
    first_diff: int | None  # byte offset of the first difference, None when equal
    golden_bytes: int
    batch_bytes: int
    text: str
    finish_reason: str | None
    leaked_markers: list[str] = field(default_factory=list)  # other requests' markers in the bs=N answer


def make_markers(n: int, seed: int) -> list[str]:
    """``n`` distinct markers ``cpkv-<8 hex>``; fixed width so no marker is a substring of another."""
    rng = random.Random(seed)
    markers: list[str] = []
    while len(markers) < n:
        marker = f"cpkv-{rng.getrandbits(32):08x}"
        if marker not in markers:
            markers.append(marker)
    return markers


def make_probes(n: int, prefix_words: int, seed: int) -> list[Probe]:
    rng = random.Random(seed ^ 0x5EED)
    prefix = " ".join(rng.choice(PREFIX_VOCAB) for _ in range(prefix_words))
    probes = []
    for i, marker in enumerate(make_markers(n, seed)):
        suffix = f"\n\nThe secret code of this document is {marker}. Repeat the secret code exactly, then describe the document.\nSecret code:"
        probes.append(Probe(i, marker, "Document:\n" + prefix + suffix))
    return probes


def first_difference(a: bytes, b: bytes) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def leaked(text: str, own: str, markers: Sequence[str]) -> list[str]:
    return [m for m in markers if m != own and m in text]


def describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"


def _json_body(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError:
        raise ClientError(f"{what}: not JSON: {text[:200]!r}") from None


async def resolve_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists (OpenAI ``/v1/models``)."""
    async with session.get(url + MODELS_PATH) as response:
        text = await response.text()
        if response.status != 200:
            raise ClientError(f"GET {MODELS_PATH}: HTTP {response.status}: {text[:200]}")
    body = _json_body(text, f"GET {MODELS_PATH}")
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ClientError(f"GET {MODELS_PATH}: no model id in {str(body)[:200]}") from None


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> Completion:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    async with session.post(url + COMPLETIONS_PATH, json=payload) as response:
        text = await response.text()
        if response.status != 200:
            raise ClientError(f"POST {COMPLETIONS_PATH}: HTTP {response.status}: {text[:200]}")
    body = _json_body(text, f"POST {COMPLETIONS_PATH}")
    try:
        choice = body["choices"][0]
        completion = Completion(choice["text"], choice.get("finish_reason"))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ClientError(f"POST {COMPLETIONS_PATH}: no choices[0].text in {text[:200]}") from None
    if not isinstance(completion.text, str):  # e.g. "text": null: nothing to compare
        raise ClientError(f"POST {COMPLETIONS_PATH}: choices[0].text is not a string in {text[:200]}")
    if completion.finish_reason == ABORT_FINISH_REASON:
        # An HTTP 200 whose generation the server aborted: no completion to compare.
        raise ClientError(f"POST {COMPLETIONS_PATH}: the server aborted the request (finish_reason abort)")
    return completion


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise UsageError(f"--url {url!r}: expected http(s)://HOST:PORT (the server or router root)")
    return url.rstrip("/")


def positive_seconds(raw: str) -> float:
    """``--timeout``: a positive, finite number of seconds (0, negatives and nan would mean no timeout)."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{raw!r} must be a positive, finite number of seconds")
    return value


def check_settings(num_requests: int, rounds: int, max_tokens: int, prefix_words: int) -> None:
    for name, value, top in (
        ("--num-requests", num_requests, MAX_REQUESTS),
        ("--rounds", rounds, MAX_ROUNDS),
        ("--max-tokens", max_tokens, MAX_NEW_TOKENS),
        ("--prefix-words", prefix_words, MAX_PREFIX_WORDS),
    ):
        if not 1 <= value <= top:
            raise UsageError(f"{name} {value} must be in [1, {top}]")
    if num_requests < 2:
        raise UsageError(f"--num-requests {num_requests}: a bs>1 check needs at least 2 requests")


def check_out_path(out: str) -> Path:
    """``--out``, checked before the run: a file (new or writable) in an existing, writable directory."""
    path = Path(out)
    parent = path.parent
    if path.is_dir():
        raise UsageError(f"--out {out}: is a directory")
    if not parent.is_dir():
        raise UsageError(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--out {out}: not writable")
    return path


def _golden_entry(probe: Probe, completion: Completion) -> dict:
    return {
        "index": probe.index,
        "marker": probe.marker,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "sha256": hashlib.sha256(completion.text.encode()).hexdigest()[:16],
    }


async def _sequential(session, url: str, model: str, probes: Sequence[Probe], max_tokens: int) -> list[Completion]:
    return [await complete(session, url, model, p.prompt, max_tokens) for p in probes]


async def run_check(
    url: str,
    num_requests: int = 8,
    rounds: int = 1,
    max_tokens: int = 64,
    prefix_words: int = 3000,
    seed: int = 0,
    model: str | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Two bs=1 passes (sequential), then ``rounds`` bs=N passes (concurrent); return the JSON-able summary.

    Raises:
        UsageError: a bad argument, or aiohttp is missing (before anything is sent).
    """
    url = check_url(url)
    check_settings(num_requests, rounds, max_tokens, prefix_words)
    try:
        import aiohttp
    except ImportError:
        raise UsageError("needs aiohttp (`pip install aiohttp`; the image and the dev environment have it)") from None

    probes = make_probes(num_requests, prefix_words, seed)
    markers = [p.marker for p in probes]
    summary: dict = {
        "url": url,
        "num_requests": num_requests,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "prefix_words": prefix_words,
        "seed": seed,
        "errors": [],
        "golden": [],
        "golden_repeat": [],
        "golden_leaks": [],
        "nondeterministic": [],
        "results": [],
    }
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=num_requests)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            model = model or await resolve_model(session, url)
            summary["model"] = model
            golden = await _sequential(session, url, model, probes, max_tokens)
            summary["golden"] = [_golden_entry(p, c) for p, c in zip(probes, golden)]
            repeat = await _sequential(session, url, model, probes, max_tokens)
            summary["golden_repeat"] = [_golden_entry(p, c) for p, c in zip(probes, repeat)]
        except (ClientError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            summary["errors"].append(f"bs=1 pass: {describe(exc)}")
            return _finish(summary, started)
        # A bs=1 answer naming another request's marker means the server leaked across *sequential*
        # requests (stale cache): contamination the batch comparison alone would not attribute.
        for pass_name, answers in (("golden", golden), ("golden_repeat", repeat)):
            for p, completion in zip(probes, answers):
                for m in leaked(completion.text, p.marker, markers):
                    summary["golden_leaks"].append(
                        {"pass": pass_name, "index": p.index, "marker": p.marker, "leaked_marker": m}
                    )
        for p, first, second in zip(probes, golden, repeat):
            diff = first_difference(first.text.encode(), second.text.encode())
            if diff is not None:
                summary["nondeterministic"].append({"index": p.index, "first_diff": diff})
        for r in range(rounds):
            answers = await asyncio.gather(
                *(complete(session, url, model, p.prompt, max_tokens) for p in probes), return_exceptions=True
            )
            for p, gold, answer in zip(probes, golden, answers):
                if isinstance(answer, BaseException):
                    summary["errors"].append(f"round {r} request {p.index}: {describe(answer)}")
                    continue
                g, b = gold.text.encode(), answer.text.encode()
                diff = first_difference(g, b)
                result = RequestResult(
                    p.index,
                    p.marker,
                    r,
                    diff is None,
                    diff,
                    len(g),
                    len(b),
                    answer.text,
                    answer.finish_reason,
                    leaked(answer.text, p.marker, markers),
                )
                summary["results"].append(asdict(result))
    return _finish(summary, started)


def _finish(summary: dict, started: float) -> dict:
    results = summary["results"]
    contaminated = sorted({(r["round"], r["index"]) for r in results if r["leaked_markers"]})
    mismatched = sorted({(r["round"], r["index"]) for r in results if not r["equal"]})
    summary["contaminated"] = [{"round": rd, "index": i} for rd, i in contaminated]
    summary["mismatched"] = [{"round": rd, "index": i} for rd, i in mismatched]
    applies = {
        "contamination": bool(contaminated or summary["golden_leaks"]),
        "nondeterministic": bool(summary["nondeterministic"]),
        "mismatch": bool(mismatched),
        "request_error": bool(summary["errors"]),
        "pass": True,
    }
    verdict, code = next((name, code) for name, code in VERDICTS if applies[name])
    summary["verdict"] = verdict
    summary["exit_status"] = code
    summary["passed"] = code == EXIT_PASS
    summary["elapsed_s"] = round(time.monotonic() - started, 3)
    return summary


class _Parser(argparse.ArgumentParser):
    """argparse with our usage exit status (argparse's own 2 is the mismatch verdict's)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    summary, _, rest = __doc__.partition("\n\n")
    exit_status = rest[rest.index("Exit status") :].split("\nThe client only", 1)[0]
    parser = _Parser(description=summary, epilog=exit_status, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server or router root (default {DEFAULT_URL})")
    parser.add_argument("-n", "--num-requests", type=int, default=8, help=f"concurrent requests, 2..{MAX_REQUESTS}")
    parser.add_argument(
        "--rounds", type=int, default=1, help=f"concurrent passes compared with the golden, 1..{MAX_ROUNDS}"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help=f"greedy tokens per request, 1..{MAX_NEW_TOKENS}")
    parser.add_argument("--prefix-words", type=int, default=3000, help="length of the shared prefix in words")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prefix text and the markers")
    parser.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    parser.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds per request (> 0)")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file (checked before the run)")
    return parser


def _run(args: argparse.Namespace) -> int:
    out = check_out_path(args.out) if args.out else None
    summary = asyncio.run(
        run_check(
            args.url,
            args.num_requests,
            args.rounds,
            args.max_tokens,
            args.prefix_words,
            args.seed,
            args.model,
            args.timeout,
        )
    )
    text = json.dumps(summary, indent=2)
    print(text)
    if out is not None:
        try:
            out.write_text(text + "\n")
        except OSError as exc:
            raise UsageError(f"--out {out}: {exc.strerror} (the report is on stdout)") from None
    print(
        f"verdict: {summary['verdict']} ({len(summary['contaminated'])} contaminated, "
        f"{len(summary['nondeterministic'])} nondeterministic at bs=1, {len(summary['mismatched'])} mismatched, "
        f"{len(summary['errors'])} errors)",
        file=sys.stderr,
    )
    return summary["exit_status"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # a bug here must not read as a verdict
        traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
