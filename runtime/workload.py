"""The workload generator every benchmark shares: prompts of an exact token length from natural text.

A prompt is consecutive paragraphs of the local corpus (runtime.tokenizer.corpus), starting at a
seeded random paragraph, through the checkpoint's tokenizer, cut to exactly `n_tokens`. Consecutive
paragraphs keep the topic locality and the Zipf-like n-gram reuse of real text; different seeds give
fresh prompts (so no cache can be warmed by an earlier one). Random token ids are never a workload.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from runtime.tokenizer import corpus


@dataclass(frozen=True)
class Workload:
    """What a plan is judged on: requests of `prompt_tokens` in, `max_tokens` out, `concurrency` of them
    streaming at once (each stream's inter-token latency within `itl_budget_s` when given)."""
    prompt_tokens: int = 1024
    max_tokens: int = 64
    ttft_budget_s: float | None = None
    concurrency: int = 1
    itl_budget_s: float | None = None

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError(f"workload needs prompt_tokens, max_tokens and concurrency >= 1, got {self}")


def make_prompt(tok: Tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` token ids of natural text (deterministic in seed)."""
    if n_tokens < 1:
        raise ValueError(f"a prompt needs at least one token, got {n_tokens}")
    paras = corpus()
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    i = int(rng.integers(len(paras)))
    while len(ids) < n_tokens:
        ids += tok.encode(paras[i % len(paras)] + "\n").ids
        i += 1
        if i % len(paras) == 0:  # wrapped: jump elsewhere so long prompts are not one fixed cycle
            i = int(rng.integers(len(paras)))
    return ids[:n_tokens]


def make_prompts(tok: Tokenizer, n_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    return [make_prompt(tok, n_tokens, seed * 100_003 + k) for k in range(count)]
