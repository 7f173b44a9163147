"""The decode step's numba kernels on the CPU (kernels/decode_attn.py, window_keys.py, indexer_top.py,
latent_rows.py) against their torch forms, the ones a GPU runs (`numba_ok` False): the same greedy
tokens, logits within float32 rounding (the indexer's and the attention's sums run in other orders;
everything else is copies and elementwise ops of the same bits)."""
import kernels.arrays
from kernels import decode_attn, indexer_top
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.model import kv
from runtime.plan import Plan


def _run(ck, prompt, monkeypatch, torch_forms: bool):
    if torch_forms:
        for mod in (kernels.arrays, kv):
            monkeypatch.setattr(mod, "numba_ok", lambda *ts: False)
    e = Engine(ck, Plan(moe_strategy="cpu", prefill_chunk=16))
    e.model.fuse_decode = False          # the unfused numba forms (the fused path is held to them: test_decode_fused.py)
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
    calls = {"select": 0, "attend": 0}
    one, att = indexer_top.select_one, decode_attn.attend

    def spy():
        calls.update(select=0, attend=0)
        monkeypatch.setattr(indexer_top, "select_one", lambda *a: calls.update(select=1) or one(*a))
        monkeypatch.setattr(decode_attn, "attend", lambda *a: calls.update(attend=1) or att(*a))
    spy()
    fast = _run(ck, prompt, monkeypatch, torch_forms=False)
    assert calls == {"select": 1, "attend": 1}                   # the numba forms ran
    spy()
    slow = _run(ck, prompt, monkeypatch, torch_forms=True)
    assert calls == {"select": 0, "attend": 0}                   # the torch forms ran
    assert fast.tokens == slow.tokens
    for a, b in zip(fast.logits, slow.logits):
        assert float((a.double() - b.double()).abs().max()) < 1e-4
