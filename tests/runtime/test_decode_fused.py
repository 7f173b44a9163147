"""The fused decode layer (runtime/model/decode.py, kernels/decode_layer.py) against the unfused one:
the same kernels on the same rows, so the same greedy tokens and logits to the bit, alone, in a decode
batch and with hash-routed layers; wider steps and other weights keep the unfused path."""
import numpy as np
import pytest
import torch

from kernels import decode_layer
from runtime.checkpoint.reader import Checkpoint
from runtime.checkpoint.synth import make_checkpoint
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.model import transformer
from runtime.plan import Plan


class Spy:
    """Counts the fused kernels' calls."""

    def __init__(self, monkeypatch):
        self.n = {}
        for name in ("attn_in", "attend_one", "attn_out", "engram", "source_in"):
            f = getattr(decode_layer, name)
            monkeypatch.setattr(decode_layer, name, self._wrap(name, f))

    def _wrap(self, name, f):
        def g(*a):
            self.n[name] = self.n.get(name, 0) + 1
            return f(*a)
        return g


def _generate(ck, prompt, fuse: bool, spy: Spy, **plan):
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=16, **plan))
    e.model.fuse_decode = fuse
    spy.n.clear()
    try:
        return e.generate(prompt, 8, keep_logits=True), dict(spy.n)
    finally:
        e.close()


def _prompt(c, n=60):
    return [(11 * k) % (c.vocab_size - 1) + 1 for k in range(n)]


def _same(a, b):
    assert a.tokens == b.tokens
    assert len(a.logits) == len(b.logits) > 1
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


def test_fused_decode_is_the_unfused_to_the_bit(tiny_dir, monkeypatch):
    ck = Checkpoint(tiny_dir)
    c = ck.config
    prompt = _prompt(c)
    assert (len(prompt) + 1 - c.window_size) // max(c.compress_ratios[s] for s in c.kv_source_layers) > 0   # rows visible
    spy = Spy(monkeypatch)
    fused, calls = _generate(ck, prompt, True, spy)
    L, steps = c.num_hidden_layers, 7                        # 8 tokens: the first from the prefill
    dec_sources = [s for s in c.kv_source_layers if s >= c.num_encoder_layers]
    assert dec_sources and c.engram_layer_ids
    assert calls == {"attn_in": L * steps, "attend_one": L * steps, "attn_out": L * steps,
                     "engram": len(c.engram_layer_ids) * steps,            # the Engram tables held in memory
                     "source_in": len(dec_sources) * steps}
    plain, calls = _generate(ck, prompt, False, spy)
    assert calls == {}
    _same(fused, plain)


def test_fused_decode_with_hash_layers(tmp_path, monkeypatch):
    ck = Checkpoint(make_checkpoint(ModelConfig.preset("tiny").replace(name="tiny-hash", n_hash_layers=2), tmp_path, seed=0))
    spy = Spy(monkeypatch)
    fused, calls = _generate(ck, _prompt(ck.config), True, spy)
    assert calls["attn_out"] > 0
    _same(fused, _generate(ck, _prompt(ck.config), False, spy)[0])


def test_a_decode_batch_fused_and_not(tiny_dir, monkeypatch):
    """Three sequences' decode tokens in one pass: fused (one attend_one each per layer) and not."""
    ck = Checkpoint(tiny_dir)
    c = ck.config
    spy = Spy(monkeypatch)
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=64, max_num_seqs=3))
    try:
        out = {}
        for fuse in (True, False):
            e.model.fuse_decode = fuse
            states = [e.model.new_state(128) for _ in range(3)]
            last = [e.model.forward(st, _prompt(c, 40 + 7 * j))[-1] for j, st in enumerate(states)]
            spy.n.clear()
            logits = []
            for _ in range(4):
                toks = [[int(x.argmax())] for x in last]
                last = [y[-1] for y in e.model.forward_many(states, toks)]
                logits += last
            out[fuse] = logits, dict(spy.n)
    finally:
        e.close()
    assert out[True][1]["attend_one"] == 3 * 4 * c.num_hidden_layers and out[True][1]["attn_in"] == 4 * c.num_hidden_layers
    assert out[False][1] == {}
    for x, y in zip(out[True][0], out[False][0]):
        assert torch.equal(x, y)


def test_wider_steps_and_other_weights_stay_unfused(tiny_dir, monkeypatch):
    ck = Checkpoint(tiny_dir)
    c = ck.config
    spy = Spy(monkeypatch)
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=64, max_num_seqs=decode_layer.MAX_ROWS + 1))
    try:
        states = [e.model.new_state(64) for _ in range(decode_layer.MAX_ROWS + 1)]
        for st in states:
            e.model.forward(st, _prompt(c, 20))
        spy.n.clear()
        e.model.forward_many(states, [[5]] * len(states))            # more rows than the GEMVs' decode widths
        e.model.forward(states[0], [5, 6])                             # a two-token step (a verify block)
        assert spy.n == {}
        e.model.forward(states[1], [5])
        assert spy.n["attn_in"] == c.num_hidden_layers
    finally:
        e.close()
    ref = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=64), reference=True)   # float64, dequantized weights
    try:
        spy.n.clear()
        ref.generate(_prompt(c, 20), 3)
        assert spy.n == {}
    finally:
        ref.close()


def test_fits_names_what_the_simd_paths_take():
    from kernels.bf16_dense import Bf16Weight
    from kernels.fp8_dense import Fp8Weight
    w8 = Fp8Weight(np.zeros((64, 64), np.uint8), np.zeros((2, 2), np.uint8), (32, 32))
    w16 = Bf16Weight(np.zeros((8, 64), np.uint16))
    from kernels.cpu_moe import LANES
    simd = LANES > 0
    assert decode_layer.fits(1, [w8], [w16]) == simd
    assert not decode_layer.fits(decode_layer.MAX_ROWS + 1, [w8], [w16])
    assert not decode_layer.fits(1, [torch.zeros(64, 64)], [])
    odd = Fp8Weight(np.zeros((64, 48), np.uint8), np.zeros((2, 2), np.uint8), (32, 32))   # K not a multiple of the block
    assert not decode_layer.fits(1, [odd], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_tables_on_the_cpu_against_the_torch_form(dtype):
    """The numba tables (every CPU path's) against torch's float64 cos / sin, rounded: within one unit
    in the last place of the output dtype (the C library and torch's vector math may differ there)."""
    pos = torch.randint(0, 1 << 20, (300,), generator=torch.Generator().manual_seed(1))
    cos, sin = transformer.rope_tables(pos, 64, 10000.0, dtype)
    ang = pos.to(torch.float64)[:, None] * transformer._inv_freq(64, 10000.0)[None]
    eps = torch.finfo(dtype).eps
    for got, ref in ((cos, ang.cos()), (sin, ang.sin())):
        assert got.dtype == dtype
        assert float((got.double() - ref).abs().max()) <= eps


@pytest.mark.parametrize("seqs,draft", [(1, 0), (4, 0), (64, 0), (1, 3), (2, 5), (4, 3)])
def test_the_held_intermediates_are_what_the_budget_counts(tiny_dir, full_skeleton, seqs, draft):
    """The widest fused step: a token per sequence, or with DSpark a verify block of draft + 1 rows per
    sequence, at most decode_layer.MAX_ROWS rows."""
    from runtime.budget import decode_work_bytes
    from runtime.model.decode import Work, work_shapes
    for d in (tiny_dir, full_skeleton):
        ck = Checkpoint(d)
        plan = Plan(max_num_seqs=seqs, dspark=bool(draft), draft_length=draft or 2)
        S = min(seqs * (draft + 1), decode_layer.MAX_ROWS)
        assert decode_work_bytes(plan, ck.footprint()) == Work.make(S, work_shapes(ck.config)).nbytes() > 0


def test_a_verify_block_holds_what_the_budget_counts(tiny_dir, monkeypatch):
    """A DSpark run on the fused path: the intermediates and decode buffers it holds for its verify
    blocks are within the plan's counts (decode_work_bytes, forward_shared_bytes' rows)."""
    from runtime import budget
    from runtime.model.decode import Work
    held = []
    make = Work.make.__func__
    monkeypatch.setattr(Work, "make", classmethod(lambda cls, *a: held.append(make(cls, *a)) or held[-1]))
    ck = Checkpoint(tiny_dir)
    plan = Plan(moe_strategy="cpu", dspark=True, draft_length=4)
    e = Engine(ck, plan)
    try:
        e.generate(_prompt(ck.config, 30), 12)
    finally:
        e.close()
    fp = ck.footprint()
    assert max(w.kv[0].shape[0] for w in held) == 5                    # a verify block's 5 rows, fused
    assert max(w.nbytes() for w in held) <= budget.decode_work_bytes(plan, fp)
    rows = budget.forward_shared_bytes(plan, fp) - budget.step_tokens(plan) * fp.kv_lora_rank * 4
    assert max(sum(a.nbytes for a in w.kv) for w in held) <= rows


def test_engram_read_from_nvme_stays_a_read_in_the_fused_step(tiny_dir, monkeypatch):
    """nvme_direct: the rows come from the reader (EngramStore.rows), the rest of the layer fused."""
    ck = Checkpoint(tiny_dir)
    spy = Spy(monkeypatch)
    fused, calls = _generate(ck, _prompt(ck.config), True, spy, engram_placement="nvme_direct")
    assert "engram" not in calls and calls["attn_in"] > 0
    _same(fused, _generate(ck, _prompt(ck.config), False, spy, engram_placement="nvme_direct")[0])
