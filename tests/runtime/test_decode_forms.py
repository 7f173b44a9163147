"""The decode step's numba kernels on the CPU (kernels/window_keys.py, indexer_top.py, latent_rows.py)
against their torch forms, the ones a GPU runs (`numba_ok` False): the same greedy tokens, logits
within float32 rounding (the indexer's scores are summed in another order; everything else is copies
and elementwise ops of the same bits)."""
import pytest
import torch

import kernels.arrays
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.model import attention, kv
from runtime.plan import Plan


def _run(ck, prompt, monkeypatch, torch_forms: bool):
    if torch_forms:
        for mod in (kernels.arrays, attention, kv):
            monkeypatch.setattr(mod, "numba_ok", lambda *ts: False)
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=16))
    try:
        return e.generate(prompt, 8, keep_logits=True)
    finally:
        e.close()
        monkeypatch.undo()


def test_the_torch_forms_decode_the_same(tiny_dir, monkeypatch):
    ck = Checkpoint(tiny_dir)
    c = ck.config
    prompt = [(11 * k) % (c.vocab_size - 1) + 1 for k in range(60)]
    assert (len(prompt) + 1 - c.window_size) // max(c.compress_ratios[s] for s in c.kv_source_layers) > 0   # rows visible
    calls = []
    top = attention.indexer_top.top
    monkeypatch.setattr(attention.indexer_top, "top", lambda *a: calls.append(1) or top(*a))
    fast = _run(ck, prompt, monkeypatch, torch_forms=False)
    assert calls                                                 # the numba form ran
    calls.clear()
    monkeypatch.setattr(attention.indexer_top, "top", lambda *a: calls.append(1) or top(*a))
    slow = _run(ck, prompt, monkeypatch, torch_forms=True)
    assert not calls                                             # the torch form ran
    assert fast.tokens == slow.tokens
    for a, b in zip(fast.logits, slow.logits):
        assert float((a.double() - b.double()).abs().max()) < 1e-4
