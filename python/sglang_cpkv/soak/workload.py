"""The soak's traffic: seeded, recorded, shaped like a P/D prefill server's.

:func:`make_workload` draws, from one seed, requests that arrive by a Poisson process over scheduler iterations;
prompts are long-tailed (a few tokens to many pages); conversations take several turns, each turn's prompt the
previous one's plus an answer and a new message (radix hits that end mid-page or on a page boundary); conversations
start from a few shared system prompts; some requests set ``ignore_eos``; some are aborted while waiting, in the middle
of their chunked prefill or while their KV is in transfer (:class:`Abort`, judged on the scheduler's own queues by
:mod:`sglang_cpkv.soak.prefill`). Pure Python: every rank and the decode draw the same workload from the seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from enum import Enum

PAGE = 64


class Abort(str, Enum):
    """When the client gives up on a request (its ``AbortReq`` reaches the prefill ranks and the decode)."""

    WAITING = "waiting"  # still in the bootstrap or waiting queue
    MID_CHUNK = "mid_chunk"  # its prefill is chunked and a chunk has run, more are to come
    MID_TRANSFER = "mid_transfer"  # its prefill is done and its KV is in transfer to the decode


@dataclass(frozen=True)
class RequestSpec:
    """One request: its id, the iteration it arrives at, its prompt, and how it ends."""

    rid: str
    arrival: int
    input_ids: tuple[int, ...]
    ignore_eos: bool
    abort: Abort | None
    conversation: int
    turn: int


@dataclass(frozen=True)
class WorkloadConfig:
    """The shape of the traffic (recorded in the report)."""

    requests: int
    seed: int
    mean_gap: float = 0.6  # mean scheduler iterations between arrivals (Poisson)
    system_prompts: int = 4
    system_prompt_tokens: tuple[int, ...] = (64, 128, 200, 448)  # two on a page boundary, two mid-page
    new_conversation: float = 0.45  # else a new turn of an open conversation
    median_message: int = 48
    message_sigma: float = 1.3  # lognormal: a long tail of many pages
    max_prompt: int = 2000  # under each scenario's arrival bound (the node pool less admission's N-page reserve)
    page_aligned: float = 0.3  # a prompt padded to a page boundary
    ignore_eos: float = 0.3
    abort: float = 0.06  # per kind
    vocab: int = 150_000


def _message(rng: random.Random, cfg: WorkloadConfig) -> list[int]:
    n = max(1, min(cfg.max_prompt, int(rng.lognormvariate(math.log(cfg.median_message), cfg.message_sigma))))
    return [rng.randrange(100, cfg.vocab) for _ in range(n)]


def make_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    """``cfg.requests`` requests in arrival order (ties: creation order)."""
    rng = random.Random(cfg.seed)
    systems = [
        [rng.randrange(100, cfg.vocab) for _ in range(n)] for n in cfg.system_prompt_tokens[: cfg.system_prompts]
    ]
    conversations: list[list[int]] = []  # each conversation's latest prompt + answer
    specs, clock = [], 0.0
    for i in range(cfg.requests):
        clock += rng.expovariate(1.0 / cfg.mean_gap)
        if not conversations or rng.random() < cfg.new_conversation:
            conv = len(conversations)
            prompt = list(rng.choice(systems)) + _message(rng, cfg)
            conversations.append(prompt)
            turn = 0
        else:
            conv = rng.randrange(len(conversations))
            prompt = conversations[conv] + _message(rng, cfg)
            turn = 1
        if rng.random() < cfg.page_aligned:  # the next turn's radix hit then holds this whole prompt
            prompt += [rng.randrange(100, cfg.vocab) for _ in range(-len(prompt) % PAGE)]
        prompt = prompt[: cfg.max_prompt]
        answer = [rng.randrange(100, cfg.vocab) for _ in range(rng.choice((1, 5, 37)))]
        conversations[conv] = prompt + answer  # the next turn extends this prompt: a radix hit of its whole pages
        roll = rng.random()
        abort = None
        for k, kind in enumerate(Abort):
            if cfg.abort * k <= roll < cfg.abort * (k + 1):
                abort = kind
        specs.append(
            RequestSpec(
                rid=f"s{cfg.seed}-r{i:06d}",  # fixed width: upstream aborts every rid an abort's rid prefixes
                arrival=int(clock),
                input_ids=tuple(prompt),
                ignore_eos=rng.random() < cfg.ignore_eos,
                abort=abort,
                conversation=conv,
                turn=turn,
            )
        )
    return specs


def describe(cfg: WorkloadConfig, specs: list[RequestSpec]) -> dict:
    """The workload as the report records it."""
    lengths = sorted(len(s.input_ids) for s in specs)
    return {
        "config": dataclasses.asdict(cfg),
        "requests": len(specs),
        "iterations_of_arrivals": specs[-1].arrival + 1 if specs else 0,
        "prompt_tokens": {
            "min": lengths[0] if lengths else 0,
            "median": lengths[len(lengths) // 2] if lengths else 0,
            "p99": lengths[int(len(lengths) * 0.99)] if lengths else 0,
            "max": lengths[-1] if lengths else 0,
            "sum": sum(lengths),
        },
        "later_turns": sum(1 for s in specs if s.turn),
        "ignore_eos": sum(1 for s in specs if s.ignore_eos),
        "aborts": {kind.value: sum(1 for s in specs if s.abort is kind) for kind in Abort},
    }
