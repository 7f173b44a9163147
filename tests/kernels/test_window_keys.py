"""A decode query's window keys gathered in one call (kernels/window_keys.py) against the visibility
rule written out per slot, the numba and torch forms the same rows, and the decode attention over the
gathered rows (runtime/model/attention.py attend_decode) against softmax attention in float64."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kernels.arrays
from kernels import decode_attn, window_keys
from runtime.model.attention import attend_decode
from runtime.model import kv
from runtime.model.kv import Ring


def _ring(rng, R, C, p, dtype=torch.float32):
    """A ring at a decode position p: its slots hold positions p-R..p-1 (some stale: >= p, as after a
    rollback; some never written: -1)."""
    ring = Ring(R, (C, C), dtype, "cpu")
    for d in ring.data:
        d.copy_(torch.from_numpy(rng.standard_normal((R, C))))
    held = np.arange(max(0, p - R), p)
    ring.pos[:] = -1
    ring.pos[held % R] = torch.from_numpy(held)
    for s in range(R):
        if rng.random() < 0.2:
            ring.pos[s] = int(rng.choice([-1, p, p + 1]))
    return ring


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.integers(1, 9), st.integers(0, 60), st.integers(1, 24), st.integers(0, 3), st.integers(0, 2**31))
def test_gather_takes_exactly_the_visible_slots_in_slot_order_then_the_new_key(R, C, p, window, at, seed):
    rng = np.random.default_rng(seed)
    ring = _ring(rng, R, C, p)
    kn, vn = torch.randn(C, dtype=torch.float32), torch.randn(C, dtype=torch.float32)
    want = [s for s in range(R) if 0 <= int(ring.pos[s]) < p and int(ring.pos[s]) > p - window]
    for numba_form in (True, False):                  # numpy views through numba, tensors through torch ops
        K, V = torch.full((at + R + 1, C), 7.0), torch.full((at + R + 1, C), 7.0)
        args = (ring.views, kn.numpy(), vn.numpy(), K.numpy(), V.numpy()) if numba_form else \
            ((*ring.data, ring.pos), kn, vn, K, V)
        assert isinstance(args[0][0], np.ndarray) == numba_form
        n = window_keys.gather(args[0], p, window, *args[1:], at)
        assert n == len(want) + 1
        assert torch.equal(K[at:at + n], torch.cat([ring.data[0][want], kn[None]]))
        assert torch.equal(V[at:at + n], torch.cat([ring.data[1][want], vn[None]]))
        assert bool((K[:at] == 7.0).all()) and bool((K[at + n:] == 7.0).all())      # nothing else written


def test_a_buffer_too_small_is_refused_with_its_rows():
    ring = Ring(5, (4, 4), torch.float32, "cpu")
    K = torch.empty(5, 4)
    with pytest.raises(ValueError, match="buffer of 5 rows cannot take 6 from row 0"):
        window_keys.gather(ring.views, 3, 4, K[0].numpy(), K[0].numpy(), K.numpy(), K.clone().numpy(), 0)


def _reference(q, p, kn, vn, ring, window, gk, gv):
    """Softmax attention in float64 over the visible slots (a mask over the whole ring), the new key and
    the selected rows."""
    vis = (ring.pos >= 0) & (ring.pos < p) & (ring.pos > p - window)
    keys = torch.cat([ring.data[0][vis], kn[None], gk]).double()
    vals = torch.cat([ring.data[1][vis], vn[None], gv]).double()
    s = q.double() @ keys.T / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ vals


@pytest.mark.parametrize("numba_form", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_decode_attention_matches_float64_and_is_the_same_alone_or_batched(dtype, tol, numba_form, monkeypatch):
    """Both forms: one numba call per sequence (kernels/decode_attn.py) and the torch ops a GPU runs."""
    calls = []
    att = decode_attn.attend
    monkeypatch.setattr(decode_attn, "attend", lambda *a: calls.append(1) or att(*a))
    if not numba_form:
        monkeypatch.setattr(kernels.arrays, "numba_ok", lambda *ts: False)
    rng = np.random.default_rng(5)
    S, R, C, Hq, k, window = 3, 9, 16, 4, 6, 7
    pos = torch.tensor([12, 30, 9])
    rings = [_ring(rng, R, C, int(p), dtype) for p in pos]
    q, kn, vn = (torch.from_numpy(rng.standard_normal(sh)).to(dtype) for sh in ((S, Hq, C), (S, C), (S, C)))
    n_sel = [6, 0, 3]
    K, V = torch.zeros(S, k + R + 1, C, dtype=dtype), torch.zeros(S, k + R + 1, C, dtype=dtype)
    K[:, :k], V[:, :k] = torch.randn(S, k, C, dtype=dtype), torch.randn(S, k, C, dtype=dtype)
    sel = [(K[j, :n].clone(), V[j, :n].clone()) for j, n in enumerate(n_sel)]
    out = attend_decode(q, pos, kn, vn, rings, window, (K.clone(), V.clone()), n_sel)
    for j in range(S):
        ref = _reference(q[j], int(pos[j]), kn[j], vn[j], rings[j], window, *sel[j])
        assert float((out[j].double() - ref).abs().max() / ref.abs().max()) < tol
        one = attend_decode(q[j:j + 1], pos[j:j + 1], kn[j:j + 1], vn[j:j + 1], rings[j:j + 1], window,
                            (K[j:j + 1].clone(), V[j:j + 1].clone()), n_sel[j:j + 1])
        assert torch.equal(one[0], out[j])                                          # bit for bit
    # a window layer: its keys go after row k, the selected rows untouched for the layers that reuse them
    Kw, Vw = K.clone(), V.clone()
    out = attend_decode(q, pos, kn, vn, rings, window, (Kw, Vw), None)
    assert torch.equal(Kw[:, :k], K[:, :k])
    for j in range(S):
        ref = _reference(q[j], int(pos[j]), kn[j], vn[j], rings[j], window, K[j, :0], V[j, :0])
        assert float((out[j].double() - ref).abs().max() / ref.abs().max()) < tol
    assert bool(calls) == numba_form                                                # the form meant ran


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(0, 40), st.integers(1, 20), st.integers(0, 2**31))
def test_a_ring_write_in_one_call_is_the_torch_writes(R, C, p0, T, seed):
    """Ring.write through kernels/window_keys.py write against its torch form: the same slots, values
    and positions, only the last R of T positions kept."""
    rng = np.random.default_rng(seed)
    rings = [_ring(rng, R, C, p0) for _ in range(2)]
    rings[1].data[0].copy_(rings[0].data[0]), rings[1].data[1].copy_(rings[0].data[1]), rings[1].pos.copy_(rings[0].pos)
    pos = torch.arange(p0, p0 + T)
    k, v = torch.randn(T, C), torch.randn(T, C)
    calls = []
    w = window_keys.write
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(window_keys, "write", lambda *a: calls.append(1) or w(*a))
        rings[0].write(pos, k, v)                                # numba
        mp.setattr(kv, "numba_ok", lambda *ts: False)
        rings[1].write(pos, k, v)                                # the torch form (a GPU's)
    assert calls == [1]
    assert torch.equal(rings[0].pos, rings[1].pos)
    assert torch.equal(rings[0].data[0], rings[1].data[0])
    assert torch.equal(rings[0].data[1], rings[1].data[1])
    kept = pos[-R:]
    assert torch.equal(rings[0].pos[kept % R], kept)
