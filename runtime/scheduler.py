"""Continuous batching: many sequences share each forward pass of one engine.

Every `step()` runs one forward over up to `plan.max_num_seqs` running sequences: each decoding
sequence contributes its next token, and prefilling sequences contribute prompt chunks (at most
`prefill_chunk` tokens each) while the step's token budget (`max_batched_tokens`, default the prefill
chunk) lasts, so a long prompt is prefilled across steps without stalling the streams. The linears and
the experts run once over all the step's tokens (each MoE layer reads the union of their experts once);
attention runs over each sequence's own state, the decode tokens of all of them in one batched pass
(runtime/model/transformer.py forward_many, attention.attend_decode). Sampling is per sequence (its own
seeded generator), as a request running alone samples.

DSpark composes: with a drafter in the plan, each decoding sequence drafts up to draft_length tokens
from its last verified position (the drafter runs per sequence), and the step verifies every
sequence's block [last token, drafts] in the same batched forward; each keeps its accepted prefix
plus the target's next token and rolls its state back past the rejected drafts (engine.verify_drafts:
greedy keeps a draft iff it is the target's argmax, so a sequence's tokens are those it would get alone).

Memory: each admitted sequence holds one KV state of at most `max_context` (the plan counts
`max_num_seqs` of them: runtime/budget.py), so a request waits while `max_num_seqs` run and none is
ever preempted; one that can never fit (prompt + max_tokens over max_context) is refused at `add`.
Not batched (they run one sequence at a time): bounded-replay prefill chunks.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from runtime import budget
from runtime.engine import draft_block, verify_drafts


@dataclass
class Sequence:
    prompt: list
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: frozenset = frozenset()
    rid: int = field(default_factory=itertools.count().__next__)
    tokens: list = field(default_factory=list)      # generated so far
    prefilled: int = 0                              # prompt tokens run so far
    state: object = None
    gen: object = None
    last: object = None                             # logits of the last position run
    finished: bool = False
    keep_logits: list | None = None                 # a list: the logits each token was sampled from (tests)
    t_added: float = field(default_factory=time.perf_counter)
    hidden: list | None = None                      # DSpark: the target layers' hidden states at the last verified position
    drafts: tuple = ((), ())                        # DSpark: this step's (draft tokens, drafter distributions)
    spec: dict = field(default_factory=lambda: {"steps": 0, "drafted": 0, "accepted": 0})

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


class Scheduler:
    def __init__(self, engine):
        self.engine, self.model, self.plan = engine, engine.model, engine.plan
        self.max_seqs = max(1, self.plan.max_num_seqs)
        self.budget = self.plan.max_batched_tokens or self.plan.prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        cfg = engine.cfg
        self.speculative = bool(self.plan.dspark and not engine.reference and cfg.dspark_num_layers)
        self.targets = cfg.dspark_target_layer_ids

    def add(self, seq: Sequence) -> Sequence:
        if seq.max_tokens < 1 or not seq.prompt:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1 (got {len(seq.prompt)} prompt tokens, "
                             f"max_tokens {seq.max_tokens})")
        budget.check_request(self.plan, len(seq.prompt), seq.max_tokens)     # can never fit: refused now
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence (queued or running): its state is freed."""
        seq.finished = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.state = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            s = self.waiting.popleft()
            s.state = self.model.new_state(len(s.prompt) + s.max_tokens, budget.spare(self.plan))
            s.gen = torch.Generator().manual_seed(s.seed)
            self.running.append(s)

    def _plan_step(self) -> list[tuple[Sequence, list]]:
        """(sequence, tokens to run) for this step: every decoding sequence's next token (and its drafts)
        first, then prompt chunks while the token budget lasts (the first one always gets a chunk)."""
        work, left = [], self.budget
        for s in self.running:
            if s.decoding:
                drafts = self._draft(s) if self.speculative else []
                work.append((s, [s.tokens[-1]] + drafts))
                left -= 1 + len(drafts)
        for s in self.running:
            if not s.decoding and (left > 0 or not work):
                n = min(self.plan.prefill_chunk, len(s.prompt) - s.prefilled, max(left, 1))
                work.append((s, s.prompt[s.prefilled:s.prefilled + n]))
                left -= n
        return work

    def step(self) -> list[tuple[Sequence, int]]:
        """One forward for the running sequences. -> [(sequence, token)] decided this step; a sequence
        whose request is done (max_tokens, or a stop id) has `finished` set and left `running`."""
        self._admit()
        work = self._plan_step()
        if not work:
            return []
        with torch.inference_mode():
            batched = [(s, t) for s, t in work if not self._alone(s)]
            outs = dict(zip((s.rid for s, _ in batched),
                            self.model.forward_many([s.state for s, _ in batched], [t for _, t in batched],
                                                    verify=[s.decoding for s, _ in batched]))) if batched else {}
            for s, t in work:
                if self._alone(s):
                    dec = max(0, len(s.prompt) - self.engine.cfg.window_size)
                    outs[s.rid] = self.model.forward(s.state, t, decoder_start=dec)
        out = []
        for s, t in work:
            if self.speculative and s.decoding and s.tokens:          # a verify pass: [last token, drafts]
                out += [(s, tok) for tok in self._verify(s, outs[s.rid])]
                continue
            if not s.decoding:
                s.prefilled += len(t)
            logits = outs[s.rid]
            if logits is not None:
                s.last = logits[-1]
            if s.decoding:
                if self.speculative:
                    s.hidden = [s.state.target_hidden[layer][-1] for layer in self.targets]
                out += [(s, tok) for tok in self._emit(s, [self.engine._sample(s.last, s.temperature, s.gen)], [s.last])]
        for s in [s for s in self.running if s.finished]:
            self.running.remove(s)
            s.state = None
        return out

    def _emit(self, s: Sequence, toks: list, logits: list) -> list:
        """Append the step's tokens for `s` up to max_tokens or its first stop id. -> those appended."""
        kept = []
        for tok, lg in zip(toks, logits):
            if s.finished:
                break
            if s.keep_logits is not None:
                s.keep_logits.append(lg.detach().clone())
            s.tokens.append(tok)
            kept.append(tok)
            s.finished = len(s.tokens) >= s.max_tokens or tok in s.stop_ids
        return kept

    def _draft(self, s: Sequence) -> list:
        """DSpark: up to draft_length drafts from the sequence's last token and verified hidden states."""
        d = min(self.plan.draft_length, s.max_tokens - len(s.tokens))
        s.drafts = draft_block(self.model, s.tokens[-1], s.hidden, d, s.temperature, s.gen)
        return list(s.drafts[0])

    def _verify(self, s: Sequence, V) -> list:
        """The target's verdict on this step's block: keep the accepted drafts and the target's next
        token, roll the state back past the rejected ones."""
        drafts, qs = s.drafts
        a, z = verify_drafts(V, list(drafts), list(qs), s.temperature, s.gen)
        st = s.state
        st.rollback(st.pos - len(drafts) + a)                       # base + 1 + a; base = pos before the pass
        s.hidden = [st.target_hidden[layer][a] for layer in self.targets]
        s.spec["steps"] += 1
        s.spec["drafted"] += len(drafts)
        s.spec["accepted"] += a
        return self._emit(s, list(drafts[:a]) + [z], [V[j] for j in range(a + 1)])

    def _alone(self, s: Sequence) -> bool:
        """A bounded-replay prefill chunk runs by itself (its decoder skips positions)."""
        return (not s.decoding and self.plan.prefill_mode == "bounded_replay" and not self.engine.reference
                and bool(self.engine.cfg.num_encoder_layers))
