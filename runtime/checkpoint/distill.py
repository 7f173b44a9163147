"""Give a synthetic checkpoint's DSpark drafter a useful, imperfect acceptance (neither ~0 nor ~1).

A random drafter never agrees with a random target, so neither DSpark decision could be exercised.
At make time we run the target over natural text, then:
  1. fit mtp.0.eh_proj by ridge regression so that eh_proj([enorm(embed(x_{p+1})), hnorm(h_t(p)) for
     each target layer t]) ~ the target's final hidden state at p+1 (whose norm and head give the
     target's next-token logits): a linear stand-in for distillation. The ridge strength and its
     prior (zero, or "the next state looks like the current token") are chosen by how often the
     drafter's argmax matches the target's on the held-out last fifth of the text;
  2. shrink the drafter blocks' residual writers (attention wo, expert and shared down projections)
     by 2^-12 through their E8M0/ue8m0 scales, so the blocks barely move the fitted state.
The fit is in float64 from a deterministic run (one torch thread, the fp32 runtime), quantized with
the config's fp8 blocks and written in place over the same byte ranges: same seed, same bytes.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from kernels.formats import quantize_fp8_block
from runtime.checkpoint.reader import Checkpoint

SHRINK_EXP = 12
FIT_TOKENS = {"tiny": 3000, "mini": 1536}


def _write(ck: Checkpoint, name: str, data: np.ndarray) -> None:
    info = ck.infos[name]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.nbytes != info.nbytes:
        raise ValueError(f"distill: {name} is {info.nbytes} B, the new data {raw.nbytes} B")
    with open(info.path, "r+b") as f:
        f.seek(info.begin)
        f.write(raw.tobytes())
        f.flush()
        os.fsync(f.fileno())


LAMBDAS = (0.01, 0.1, 1.0, 10.0, 100.0)        # x mean(X^2) x n: ridge strengths tried


def _ridge(X, Y, lam: float, prior: bool) -> torch.Tensor:
    """Ridge regression Y ~ X W^T [n tokens, d features], shrunk toward W0: zero, or (prior) the scaled
    identity on the token-embedding block, i.e. "the next state looks like the current token". The
    smaller solve of the two equal forms: W0 + R^T X (X^T X + l I_d)^-1 = W0 + R^T (X X^T + l I_n)^-1 X,
    R = Y - X W0^T (d x d on tiny: 256 features, 3000 tokens; n x n on mini: 20480 features)."""
    (n, d), H = X.shape, Y.shape[1]
    W0 = torch.zeros(H, d, dtype=torch.float64)
    if prior:
        E = X[:, :H]
        W0[:, :H] = float((E * Y).sum() / (E * E).sum()) * torch.eye(H, dtype=torch.float64)
    R, lam = Y - X @ W0.T, lam * float(X.pow(2).mean()) * n
    if d < n:
        return W0 + torch.linalg.solve(X.T @ X + lam * torch.eye(d, dtype=torch.float64), X.T @ R).T
    return W0 + torch.linalg.solve(X @ X.T + lam * torch.eye(n, dtype=torch.float64), R).T @ X


def distill_drafter(root, n_tokens: int | None = None) -> dict:
    from tokenizers import Tokenizer

    from runtime.engine import Engine
    from runtime.model.weights import dense_tensor
    from runtime.plan import Plan
    from runtime.workload import make_prompt
    ck = Checkpoint(root)
    cfg = ck.config
    if not cfg.dspark_num_layers:
        return {}
    n = n_tokens or FIT_TOKENS.get(cfg.name, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
        prompt = make_prompt(tok, n, seed=12345)
        eng = Engine(ck, Plan(max_context=n + 8, prefill_chunk=n, cpu_threads=1), device="cpu")   # the same bytes on any host
        st = eng.model.new_state(n + 8)
        with torch.inference_mode():
            eng.model.forward(st, prompt)
        w = eng.model.w
        eps = cfg.rms_norm_eps

        def rms(x, g):
            x = x.double()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.double()
        emb = rms(w["embed.weight"][torch.tensor(prompt[1:])], w["mtp.0.enorm.weight"])
        hs = [rms(st.target_hidden[t][:-1], w["mtp.0.hnorm.weight"]) for t in cfg.dspark_target_layer_ids]
        X = torch.cat([emb] + hs, 1)                                          # [n-1, (1+T) H]
        Y = st.final_hidden[1:].double()
        target = (rms(Y, w["norm.weight"]) @ dense_tensor(w["head.weight"]).T).argmax(-1)   # the target's next tokens
        Y = Y * torch.rsqrt(Y.pow(2).mean(-1, keepdim=True) + eps)            # [n-1, H]: the final norm drops the scale
        head, g = dense_tensor(w["head.weight"]), w["mtp.norm.weight"]

        def agree(W, rows):                                                   # drafts == the target's argmax
            out = rms(X[rows] @ W.T, g)
            return float(((out @ head.T).argmax(-1) == target[rows]).double().mean())
        # choose the ridge strength and prior on the last fifth (held out), then refit on everything
        cut = int(0.8 * len(X))
        fit, held = slice(0, cut), slice(cut, None)
        scores = {(lam, prior): agree(_ridge(X[fit], Y[fit], lam, prior), held)
                  for lam in LAMBDAS for prior in (False, True)}
        (lam, prior), held_out = max(scores.items(), key=lambda kv: kv[1])
        W = _ridge(X, Y, lam, prior)
        eng.close()
        eng.close()
    finally:
        torch.set_num_threads(threads)
    q, s = quantize_fp8_block(W.float(), cfg.fp8_block)
    _write(ck, "mtp.0.eh_proj.weight", q.view(torch.uint8).numpy())
    _write(ck, "mtp.0.eh_proj.scale", s.numpy())
    shrunk = 0
    for name, info in ck.infos.items():
        if name.startswith("mtp.") and (name.endswith("attn.wo.scale") or ".w2.scale" in name):
            sc = np.array(ck.raw(name))
            _write(ck, name, np.maximum(sc.astype(np.int32) - SHRINK_EXP, 1).astype(np.uint8))
            shrunk += 1
    # a report figure, to 4 digits: its last float64 bits vary between runs (BLAS), the written bytes do not
    rel = round(float(((X @ W.T - Y).norm() / Y.norm())), 4)
    return {"fit_tokens": n, "fit_relative_error": rel, "ridge": lam, "embedding_prior": prior,
            "held_out_agreement": held_out, "shrunk_tensors": shrunk}
