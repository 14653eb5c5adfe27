"""Live bs>1 contamination check against a running server or P/D router (OpenAI ``/v1/completions``).

N requests share one long prefix and differ only in a suffix carrying a distinct marker. Each request is
first sent alone, one after another (the bs=1 golden), then all of them at once (bs=N, the prefix pages
shared in one batch), greedy (temperature 0). Per request it reports whether the bs=N completion equals the
golden byte for byte, and whether a completion contains another request's marker (contamination: that
request's KV or output leaked into this one). The prompt asks the model to repeat its marker, so a request
that reads another's KV tends to print that other marker.

    python scripts/validate_bs_gt1_contamination.py --url http://127.0.0.1:8000 -n 8 --out result.json

Exit status: 0 all equal and clean; 1 contamination; 2 a byte mismatch without contamination; 3 a request
failed (HTTP error, timeout, malformed answer). The client only talks to ``--url``. It needs aiohttp
(in the image and the dev environment), imported when a check runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import aiohttp

EXIT_OK, EXIT_CONTAMINATION, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2, 3
MAX_REQUESTS = 256
MAX_ROUNDS = 20
MAX_NEW_TOKENS = 4096
MAX_PREFIX_WORDS = 200_000
DEFAULT_URL = "http://127.0.0.1:8000"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
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
    """A request that did not produce a completion (HTTP status, timeout, malformed body)."""


@dataclass(frozen=True)
class Probe:
    index: int
    marker: str
    prompt: str


@dataclass
class RequestResult:
    index: int
    marker: str
    round: int
    equal: bool
    first_diff: int | None  # byte offset of the first difference, None when equal
    golden_bytes: int
    batch_bytes: int
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


async def resolve_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists (OpenAI ``/v1/models``)."""
    async with session.get(url + MODELS_PATH) as response:
        if response.status != 200:
            raise ClientError(f"GET {MODELS_PATH}: HTTP {response.status}: {(await response.text())[:200]}")
        body = await response.json(content_type=None)
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ClientError(f"GET {MODELS_PATH}: no model id in {str(body)[:200]}") from None


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> str:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    async with session.post(url + COMPLETIONS_PATH, json=payload) as response:
        text = await response.text()
        if response.status != 200:
            raise ClientError(f"POST {COMPLETIONS_PATH}: HTTP {response.status}: {text[:200]}")
    try:
        return json.loads(text)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ClientError(f"POST {COMPLETIONS_PATH}: no choices[0].text in {text[:200]}") from None


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"--url {url!r}: expected http(s)://HOST:PORT (the server or router root)")
    return url.rstrip("/")


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
    """Run golden (sequential) and bs=N (concurrent) passes; return the JSON-able summary."""
    import aiohttp

    url = check_url(url)
    for name, value, top in (
        ("num_requests", num_requests, MAX_REQUESTS),
        ("rounds", rounds, MAX_ROUNDS),
        ("max_tokens", max_tokens, MAX_NEW_TOKENS),
        ("prefix_words", prefix_words, MAX_PREFIX_WORDS),
    ):
        if not 1 <= value <= top:
            raise ValueError(f"{name}={value} must be in [1, {top}]")
    if num_requests < 2:
        raise ValueError(f"num_requests={num_requests}: a bs>1 check needs at least 2 requests")
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
        "golden_leaks": [],
        "results": [],
    }
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=num_requests)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            model = model or await resolve_model(session, url)
            summary["model"] = model
            golden = [await complete(session, url, model, p.prompt, max_tokens) for p in probes]
        except (ClientError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            summary["errors"].append(f"golden: {describe(exc)}")
            return _finish(summary, started)
        # A golden answer naming another request's marker means the server leaked across *sequential*
        # requests (stale cache): contamination the batch comparison alone would not attribute.
        for p, text in zip(probes, golden):
            for m in leaked(text, p.marker, markers):
                summary["golden_leaks"].append({"index": p.index, "marker": p.marker, "leaked_marker": m})
        for r in range(rounds):
            answers = await asyncio.gather(
                *(complete(session, url, model, p.prompt, max_tokens) for p in probes), return_exceptions=True
            )
            for p, gold, answer in zip(probes, golden, answers):
                if isinstance(answer, BaseException):
                    summary["errors"].append(f"round {r} request {p.index}: {describe(answer)}")
                    continue
                g, b = gold.encode(), answer.encode()
                diff = first_difference(g, b)
                summary["results"].append(
                    asdict(
                        RequestResult(
                            p.index, p.marker, r, diff is None, diff, len(g), len(b), leaked(answer, p.marker, markers)
                        )
                    )
                )
        summary["golden_sha256"] = [hashlib.sha256(t.encode()).hexdigest()[:16] for t in golden]
    return _finish(summary, started)


def _finish(summary: dict, started: float) -> dict:
    results = summary["results"]
    contaminated = sorted({(r["round"], r["index"]) for r in results if r["leaked_markers"]})
    mismatched = sorted({(r["round"], r["index"]) for r in results if not r["equal"]})
    summary["contaminated"] = [{"round": rd, "index": i} for rd, i in contaminated]
    summary["mismatched"] = [{"round": rd, "index": i} for rd, i in mismatched]
    if contaminated or summary["golden_leaks"]:
        verdict, code = "contamination", EXIT_CONTAMINATION
    elif mismatched:
        verdict, code = "mismatch", EXIT_MISMATCH
    elif summary["errors"]:
        verdict, code = "error", EXIT_ERROR
    else:
        verdict, code = "pass", EXIT_OK
    summary["verdict"] = verdict
    summary["exit_status"] = code
    summary["passed"] = code == EXIT_OK
    summary["elapsed_s"] = round(time.monotonic() - started, 3)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server or router root (default {DEFAULT_URL})")
    parser.add_argument("-n", "--num-requests", type=int, default=8, help=f"concurrent requests, 2..{MAX_REQUESTS}")
    parser.add_argument(
        "--rounds", type=int, default=1, help=f"concurrent passes compared with the golden, 1..{MAX_ROUNDS}"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help=f"greedy tokens per request, 1..{MAX_NEW_TOKENS}")
    parser.add_argument("--prefix-words", type=int, default=3000, help="length of the shared prefix in words")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prefix text and the markers")
    parser.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", default=None, help="also write the JSON summary to this file")
    args = parser.parse_args(argv)
    try:
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
    except ValueError as exc:
        parser.error(str(exc))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(
        f"verdict: {summary['verdict']} ({len(summary['contaminated'])} contaminated, {len(summary['mismatched'])} mismatched, "
        f"{len(summary['errors'])} errors)",
        file=sys.stderr,
    )
    return summary["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
