"""What one forward's layers share (runtime/model/transformer.py): RoPE over the forward's positions,
and a decode batch's selected rows, once per (kv source, index source) and never stale."""
import math

import numpy as np
import pytest
import torch

from kernels import decode_layer
from runtime import budget
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.model import transformer
from runtime.model.decode import Work
from runtime.plan import Plan


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return Checkpoint(tiny_dir)


@pytest.mark.parametrize("shape", [(5, 16), (5, 3, 16)])
def test_rope_rotates_each_pair_by_its_angle(shape):
    """Against the rotation written out per element in float64 (math.cos / math.sin). Tolerance: the two
    compute the angle in different orders, ~1 ulp of it: 2^-52 x 65535 ~ 1.5e-11 at the last position."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, dtype=torch.float64, generator=g)
    pos = torch.tensor([0, 1, 7, 300, 65535])
    theta, d = 10000.0, shape[-1] // 2
    want = torch.empty_like(x)
    for t, p in enumerate(pos.tolist()):
        for j in range(d):
            a = p / theta ** (j / d)
            x1, x2 = x[t, ..., j], x[t, ..., d + j]
            want[t, ..., j], want[t, ..., d + j] = x1 * math.cos(a) - x2 * math.sin(a), x2 * math.cos(a) + x1 * math.sin(a)
    got = transformer.rope(x, pos, theta)
    assert (got - want).abs().max() < 5e-11
    assert torch.equal(transformer.rope(x, pos, theta, transformer.rope_tables(pos, d, theta, x.dtype)), got)


def _decode(ck, prompt, n, monkeypatch, fresh_rows: bool, fused: bool):
    """n greedy tokens; -> (logits, selected-row batches built per decode forward: by the unfused
    path's `_selected_rows_batch`, or by the fused path's attend_one, given a kv source ratio r > 0)."""
    calls = []
    build = transformer.Model._selected_rows_batch
    monkeypatch.setattr(transformer.Model, "_selected_rows_batch", lambda self, *a: calls.append(1) or build(self, *a))
    one = decode_layer.attend_one
    monkeypatch.setattr(decode_layer, "attend_one", lambda *a: (a[20] > 0 and calls.append(1)) or one(*a))
    if fresh_rows:                                     # every layer builds its own rows, as before sharing
        layer = transformer.Model._layer
        monkeypatch.setattr(transformer.Model, "_layer", lambda self, *a: (a[-1].pop("rows", None), layer(self, *a))[1])
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=len(prompt)))
    e.model.fuse_decode = fused
    try:
        out = e.generate(prompt, n, keep_logits=True)
    finally:
        e.close()
        monkeypatch.undo()
    return out, len(calls) / (n - 1)


@pytest.mark.parametrize("fused", [True, False])
def test_reuse_layers_share_the_selected_rows_bit_for_bit(ck, monkeypatch, fused):
    c = ck.config
    prompt = [(7 * k) % (c.vocab_size - 1) + 1 for k in range(40)]
    assert (len(prompt) + 1 - c.window_size) // min(c.compress_ratios[s] for s in c.kv_source_layers) > 0   # rows visible
    glob = [i for i in range(c.num_hidden_layers) if c.layer_mode(i) != "window"]
    pairs = {(c.kv_source_of(i), c.index_source_of(i)) for i in glob}
    assert len(pairs) < len(glob)                      # the checkpoint has layers that can share
    shared, per_forward = _decode(ck, prompt, 6, monkeypatch, fresh_rows=False, fused=fused)
    alone, per_forward_alone = _decode(ck, prompt, 6, monkeypatch, fresh_rows=True, fused=fused)
    assert per_forward == len(pairs) and per_forward_alone == len(glob)
    assert shared.tokens == alone.tokens and all(torch.equal(a, b) for a, b in zip(shared.logits, alone.logits))


def test_what_the_layers_share_is_counted_by_the_plan(ck, monkeypatch):
    """The largest the forward's shared tensors get (a prompt chunk's RoPE tables, a decode step's rows)
    is within what runtime/budget.py counts for them."""
    c = ck.config
    plan = Plan(moe_strategy="cpu", prefill_chunk=24, max_num_seqs=1)
    held = []
    layer = transformer.Model._layer

    def spy(self, *a):
        out = layer(self, *a)
        held.append((len(a[2]), sum(_nbytes(t) for k, v in a[-1].items() if k != "rope_np" for t in _tensors(v))))
        return out
    monkeypatch.setattr(transformer.Model, "_layer", spy)
    e = Engine(ck, plan)
    try:
        e.generate([(5 * k) % (c.vocab_size - 1) + 1 for k in range(48)], 4)
    finally:
        e.close()
    fp = ck.footprint()
    decode = max(b for T, b in held if T == 1)
    assert max(b for _, b in held) <= budget.forward_shared_bytes(plan, fp)
    # a decode step holds its selected rows too (more than its one position's tables), within the
    # budget's share for one token
    assert fp.kv_lora_rank * 4 < decode <= budget.forward_shared_bytes(plan.replace(prefill_chunk=1), fp)


def _tensors(v):
    """The arrays a forward's shared value holds; of the fused decode's buffers (runtime/model/decode.py
    Work) its decode rows: the rest of it, the RoPE tables (`rope_np`) too, is decode_work_bytes'."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, Work):
        yield from v.kv


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()


def test_the_decoder_sources_are_timed_as_dense(ck, monkeypatch):
    """Their linears and the KV quantizer run once per forward at the encoder's end: in `dense`, not in
    the time outside every phase."""
    import time
    sources = transformer.Model._decoder_sources
    monkeypatch.setattr(transformer.Model, "_decoder_sources", lambda self, *a: (time.sleep(0.02), sources(self, *a))[1])
    e = Engine(ck, Plan(moe_strategy="cpu"))
    try:
        r = e.generate([3, 5, 7, 11, 13], 4)
    finally:
        e.close()
    assert r.phases["dense"] >= 3 * 0.02 and r.phases["outside_phases"] < 3 * 0.02   # 3 decode forwards


def test_small_forwards_run_torch_on_one_thread_and_wide_ones_on_the_usable_cores(ck, monkeypatch):
    """ONE_POOL_TOKENS: a decode step's torch ops run on one thread (torch's idle workers would spin on
    the cores the CPU-MoE kernel wants next), a prompt chunk's on every usable core; the caller's
    count comes back after each forward."""
    monkeypatch.setattr(transformer, "ONE_POOL_TOKENS", 8)           # tiny's prompt of 20 is then wide
    eng = Engine(ck, Plan(max_context=40, prefill_chunk=20))
    before = torch.get_num_threads()
    eng.model.torch_threads = before + 1                             # a count told apart from the caller's
    seen, routed = [], eng.experts.routed_np                         # every MoE call's (the fused decode's too)

    def spy(layer, x, *a, **kw):
        seen.append((len(x), torch.get_num_threads()))
        return routed(layer, x, *a, **kw)
    monkeypatch.setattr(eng.experts, "routed_np", spy)
    try:
        eng.generate(list(range(1, 21)), 3)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
        eng.close()
    L = ck.config.num_hidden_layers
    assert seen == [(20, before + 1)] * L + [(1, 1)] * (2 * L)
