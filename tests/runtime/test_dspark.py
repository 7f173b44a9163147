"""DSpark: greedy verification is lossless whatever the drafter proposes; speculative sampling keeps
the target's distribution.

Lossless is checked twice. On the float64 reference engine the verify pass computes what one-token
decode computes up to float64 rounding, so tokens and logits must agree to 1e-9: any slip in the
draft, verify or rollback bookkeeping shows. On the placed float32 runtime (what serves) the fused
decode path (runtime/model/decode.py) takes a verify block's rows one by one through the kernels
one-token decode uses, so tokens and every step's logits must be the same to the bit. Where that path
does not run (no SIMD GEMVs, or a step wider than decode_layer.MAX_ROWS) a verify block sums in another
order than one-token decode, and the CPU-MoE kernel quantizes each expert input to int8 per 32 values:
a ~1e-7 difference that lands on a rounding midpoint moves one code by one step (measured on an AMX
Xeon: one step of one prompt moved its logits by 3.7e-3, the rest by ~1e-6; on mini the median step by
3.3e-2, parting greedy output at top-2 margins of 5.6e-3 and 1.1e-1). There the tokens must match
(within the greedy-margin rule) and the typical step must agree to float noise."""
import pytest
import torch
from tokenizers import Tokenizer

from runtime.engine import Engine, verify_drafts
from runtime.model import transformer
from runtime.plan import Plan
from runtime.workload import make_prompt

N = 40
TOL = 1.5e-3                     # the runtime's tolerance (tests/runtime/test_runtime.py)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    return [make_prompt(tok, 30 + 7 * k, seed=100 + k) for k in range(3)]


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):
    e = Engine(tiny_dir, Plan(), reference=True)
    return [e.generate(p, N, keep_logits=True) for p in prompts]


@pytest.fixture(scope="module")
def plain32(tiny_dir, prompts):
    """Plain decode on the float32 runtime; each result's `fused`: whether its decode steps took the fused
    path (runtime/model/decode.py)."""
    e = Engine(tiny_dir, Plan())
    out = [e.generate(p, N, keep_logits=True) for p in prompts]
    for o in out:
        o.fused = e.model.fused is not None and e.model.fused.layers is not None
    e.close()
    return out


def _oracle(engine, greedy_tokens, wrong_every=0):
    """A drafter that proposes the target's own greedy continuation (every `wrong_every`-th draft
    corrupted), so accept, partial accept and reject paths all run."""
    count = {"pos": -1, "j": 0, "n": 0}
    vocab = engine.cfg.vocab_size

    def draft(tok, hidden):
        st = engine.state
        if st.pos != count["pos"]:
            count["pos"], count["j"] = st.pos, 0
        idx = st.pos + 1 + count["j"]
        count["j"] += 1
        count["n"] += 1
        y = greedy_tokens[idx] if idx < len(greedy_tokens) else 0
        if wrong_every and count["n"] % wrong_every == 0:
            y = (y + 1) % vocab
        logits = torch.full((vocab,), -10.0)
        logits[y] = 10.0
        return logits, hidden[0]
    return draft


@pytest.mark.parametrize("drafter", ["distilled", "oracle", "oracle-mixed"])
@pytest.mark.parametrize("draft_length", [1, 2, 3, 5])
def test_greedy_verification_is_lossless(tiny_dir, prompts, plain, drafter, draft_length):
    e = Engine(tiny_dir, Plan(dspark=True, draft_length=draft_length), reference=True)
    for prompt, ref in zip(prompts, plain):
        if drafter != "distilled":
            e.model.draft = _oracle(e, prompt + ref.tokens, wrong_every=3 if drafter == "oracle-mixed" else 0)
        out = e.generate(prompt, N, keep_logits=True)
        assert out.tokens == ref.tokens
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-9
        s = out.dspark
        assert s["steps"] > 0 and s["drafted"] >= s["accepted"] >= 0
        if drafter == "oracle":
            assert s["acceptance_rate"] > 0.9 and s["steps"] <= N // (draft_length + 1) + 2
        if drafter == "oracle-mixed" and draft_length > 1:
            assert 0 < s["acceptance_rate"] < 1
    e.close()


@pytest.mark.parametrize("draft_length", [1, 3])
def test_the_placed_runtime_verifies_losslessly(tiny_dir, prompts, plain32, draft_length, monkeypatch):
    """float32, the served path (module docstring). Where the fused decode runs (it ran for plain decode
    too), every verify block takes it and the tokens and every step's logits are plain decode's to the
    bit. Elsewhere the greedy tokens are plain decode's where they part the reference's top-2 margin was
    inside 20x the runtime's tolerance (compared up to there); the median step's logits within 1e-5."""
    fused, blocks = [], []
    step = transformer.Model._fused_step

    def spy(self, segs, fw):
        ok = step(self, segs, fw)
        if segs[-1].b > 1:
            blocks.append(segs[-1].b)
            fused.append(ok)
        return ok
    monkeypatch.setattr(transformer.Model, "_fused_step", spy)
    e = Engine(tiny_dir, Plan(dspark=True, draft_length=draft_length))
    diffs, exact = [], plain32[0].fused
    for prompt, ref in zip(prompts, plain32):
        out = e.generate(prompt, N, keep_logits=True)
        assert out.dspark["steps"] > 0 and out.dspark["accepted"] > 0
        if exact:
            assert out.tokens == ref.tokens
            assert len(out.logits) == len(ref.logits) == N and all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
            continue
        for k, (a, b) in enumerate(zip(out.logits, ref.logits)):
            diffs.append((a - b).abs().max().item())
            if out.tokens[k] != ref.tokens[k]:
                top = torch.topk(b, 2).values
                assert float(top[0] - top[1]) <= 20 * TOL, (len(prompt), k)
                break
    e.close()
    assert blocks and draft_length + 1 in blocks          # the verify blocks (and the prompts) seen
    if exact:                                              # every verify block fused (the prompts are not)
        assert all(ok for b, ok in zip(blocks, fused) if b <= draft_length + 1)
    else:
        assert len(diffs) >= N and sorted(diffs)[len(diffs) // 2] < 1e-5, diffs


def test_speculative_sampling_keeps_the_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    V = torch.log(p).repeat(2, 1)
    gen = torch.Generator().manual_seed(0)
    n, counts, accepted = 20000, torch.zeros(4), 0
    for _ in range(n):
        y = int(torch.multinomial(q, 1, generator=gen))
        a, z = verify_drafts(V, [y], [q], 1.0, gen)
        first = y if a == 1 else z
        counts[first] += 1
        accepted += a
    assert (counts / n - p.float()).abs().max() < 0.015          # ~4 sigma at n = 20000
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.015   # acceptance = sum min(p, q)
    # q == p: every draft accepted, whatever the draws; q close to p but not equal: some rejected
    same, _ = zip(*(verify_drafts(V, [int(torch.multinomial(p, 1, generator=gen))], [p], 1.0, gen) for _ in range(500)))
    assert sum(same) == 500
    near = torch.tensor([0.45, 0.35, 0.15, 0.05], dtype=torch.float64)
    close, _ = zip(*(verify_drafts(V, [int(torch.multinomial(near, 1, generator=gen))], [near], 1.0, gen) for _ in range(2000)))
    assert 2000 * 0.9 < sum(close) < 2000                         # acceptance = sum min(p, q) = 0.95


def test_the_distilled_drafter_is_neither_useless_nor_perfect(tiny_dir, prompts, plain):
    """The make-time distillation (synth EMBED_STD + distill.py) gives first-draft acceptance well
    inside (0, 1) on fresh prompts; a verify batch reads the union of its tokens' experts."""
    e = Engine(tiny_dir, Plan(dspark=True, draft_length=1))
    L, K = e.cfg.num_hidden_layers, e.cfg.num_experts_per_tok
    drafted = accepted = 0
    for prompt, ref in zip(prompts, plain):
        before = e.experts.experts_read
        out = e.generate(prompt, N)
        assert out.tokens == ref.tokens
        drafted += out.dspark["drafted"]
        accepted += out.dspark["accepted"]
        calls = L * (1 + out.dspark["steps"])                 # the prefill, then one verify pass per step
        union = (e.experts.experts_read - before) / calls
        assert K <= union <= min(e.cfg.n_routed_experts, len(prompt) * K)
    e.close()
    assert 0.08 < accepted / drafted < 0.7, accepted / drafted


@pytest.mark.parametrize("n,d", [(60, 24), (24, 60)])        # the d x d form (tiny) and the n x n form (mini)
@pytest.mark.parametrize("prior", [False, True])
def test_the_drafter_fit_is_the_ridge_solution_in_either_form(n, d, prior):
    from runtime.checkpoint.distill import _ridge
    g = torch.Generator().manual_seed(n + d)
    H = 8
    X, Y = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, H, generator=g, dtype=torch.float64)
    lam = 0.1
    W = _ridge(X, Y, lam, prior)
    # reference: least squares on the stacked system [X; sqrt(l) I] W^T = [Y; sqrt(l) W0^T], W0 as documented
    W0 = torch.zeros(H, d, dtype=torch.float64)
    if prior:
        E = X[:, :H]
        W0[:, :H] = float((E * Y).sum() / (E * E).sum()) * torch.eye(H, dtype=torch.float64)
    s = (lam * float(X.pow(2).mean()) * n) ** 0.5
    A = torch.cat([X, s * torch.eye(d, dtype=torch.float64)])
    B = torch.cat([Y, s * W0.T])
    ref = torch.linalg.lstsq(A, B).solution.T
    assert torch.allclose(W, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("prompt_len", [1, 3, 4])
def test_a_short_prompt_is_attended_as_with_dspark_off(tiny_dir, prompt_len, monkeypatch):
    """A prompt of no more tokens than a verify block (draft_length + 1) is still a prompt: it takes the
    block path DSpark on or off (only verify blocks take the fused rows), so its logits and the greedy
    tokens after it are DSpark off's to the bit where the fused path runs (else within the margin rule's
    float noise)."""
    fused_multi = []
    step = transformer.Model._fused_step

    def spy(self, segs, fw):
        ok = step(self, segs, fw)
        if ok and segs[-1].b > 1 and segs[0].st.pos == 0:     # a prompt of several tokens on the fused rows
            fused_multi.append(segs[-1].b)
        return ok
    monkeypatch.setattr(transformer.Model, "_fused_step", spy)
    prompt = [7, 11, 13, 17][:prompt_len]
    outs = []
    for plan in (Plan(), Plan(dspark=True, draft_length=3)):
        e = Engine(tiny_dir, plan)
        outs.append(e.generate(prompt, 12, keep_logits=True))
        fused = e.model.fused is not None and e.model.fused.layers is not None
        e.close()
    assert not fused_multi                                 # no prompt of several tokens took the verify rows
    off, on = outs
    if fused:
        assert on.tokens == off.tokens and all(torch.equal(a, b) for a, b in zip(on.logits, off.logits))
    else:
        assert (on.logits[0] - off.logits[0]).abs().max() < TOL
