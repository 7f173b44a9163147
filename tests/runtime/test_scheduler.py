"""Continuous batching (runtime/scheduler.py): sequences sharing forward passes decode as they would
alone, the step's token budget interleaves prefill with decode, admission counts every sequence's
memory, and a batched step reads the union of its sequences' experts once."""
import pytest
import torch

from runtime import budget
from runtime.budget import DoesNotFit, check_plan
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.plan import Plan, PlanError
from runtime.scheduler import Scheduler, Sequence

TOL = 1.5e-3                     # the runtime's tolerance (tests/runtime/test_runtime.py)
BATCH = Plan(max_num_seqs=3, max_batched_tokens=24, prefill_chunk=16, cpu_threads=1, max_context=256)


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return Checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def tiny_footprint(ck):
    return ck.footprint()


def _prompt(ck, n, seed):
    """Natural text of n tokens, as the runtime tests use. With random ids one sequence's logits moved
    by 2e-2 between its batched and its alone run at a step with no near-tie in its logits (a rounding-
    level difference between two chunkings crossing a discontinuity, such as the indexer's top-k)."""
    from tokenizers import Tokenizer

    from runtime.workload import make_prompt
    return make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), n, seed=seed)


def alone(ck, plan, prompt, n):
    e = Engine(ck, plan.replace(max_num_seqs=1))
    try:
        return e.generate(prompt, n, keep_logits=True)
    finally:
        e.close()


def run(sched, arrivals, cancel_at=None):
    """Drive the scheduler: arrivals = {step: [Sequence]}; cancel_at = (step, Sequence). -> steps run."""
    step = 0
    while sched.busy or any(k >= step for k in arrivals):
        for s in arrivals.get(step, []):
            sched.add(s)
        if cancel_at and cancel_at[0] == step:
            sched.cancel(cancel_at[1])
        sched.step()
        step += 1
    return step


@pytest.fixture(params=["shipped", "width-invariant"])
def widths(request, monkeypatch):
    """shipped: the linears as they run (a pass of >= 16 tokens takes the tile path of the FP8 and BF16
    kernels, a narrower one the GEMV: the same token sums in another order depending on how many tokens
    share its pass). width-invariant: every linear on its GEMV, whose output per token does not depend
    on the pass's width; then sharing passes leaves float32 rounding only (`_matches_alone`)."""
    if request.param == "width-invariant":
        import kernels.bf16_dense
        import kernels.fp8_dense
        monkeypatch.setattr(kernels.fp8_dense, "TILE_MIN_TOKENS", 1 << 30)
        monkeypatch.setattr(kernels.bf16_dense, "TILE_MIN_TOKENS", 1 << 30)
    return request.param


def test_each_sequence_decodes_as_it_would_alone(ck, widths):
    """Mixed prompt lengths, arrivals at different steps, one cancelled mid-way: each finished
    sequence decodes as it does alone (`_matches_alone`)."""
    lens, outs = (5, 40, 23, 9, 61), (12, 6, 16, 9, 4)
    seqs = [Sequence(_prompt(ck, n, seed), m, keep_logits=[]) for seed, (n, m) in enumerate(zip(lens, outs))]
    e = Engine(ck, BATCH)
    try:
        run(Scheduler(e), {0: seqs[:2], 1: seqs[2:3], 3: seqs[3:]}, cancel_at=(5, seqs[3]))
    finally:
        e.close()
    assert seqs[3].finished and len(seqs[3].tokens) < seqs[3].max_tokens          # cancelled: dropped early
    _matches_alone(ck, BATCH, [s for s in seqs if s is not seqs[3]], invariant=widths == "width-invariant")


def _matches_alone(ck, plan, seqs, invariant: bool):
    """invariant (the linears width-invariant): every step's token equals its run alone and its logits
    lie within 1e-5 (1.1e-6 seen, 0.0 in the DSpark case; decode attention runs each sequence over
    its own rows, so the gap is not attention's). Else (the linears as shipped) the greedy tokens match
    up to the first step whose top-2 margin is inside 20x the runtime's tolerance, and every step's
    logits lie within 2e-2: a chunk that crosses the 16-token tile width in one run and not the other
    sums some tokens in another order (~1e-7 relative), and where that puts a value on a rounding
    midpoint of a quantizer it moves one code: an expert input's int8 code moves a step's logits by up
    to ~1e-2 (1.1e-2 seen), a cached FP4 latent's by ~1e-5-1e-4 (8e-5 seen); no margin predicts either
    (tests/runtime/test_dspark.py)."""
    diffs = []
    for s in seqs:
        ref = alone(ck, plan, s.prompt, s.max_tokens)
        assert len(s.tokens) == len(ref.tokens)
        if invariant:
            assert s.tokens == ref.tokens
            diffs += [float((a.double() - b.double()).abs().max()) for a, b in zip(s.keep_logits, ref.logits)]
            continue
        for k, (a, b) in enumerate(zip(s.keep_logits, ref.logits)):
            diffs.append(float((a.double() - b.double()).abs().max()))
            top = torch.topk(b, 2).values
            if float(top[0] - top[1]) <= 20 * TOL:
                break
            assert s.tokens[k] == ref.tokens[k], (len(s.prompt), k)
    assert len(diffs) >= len(seqs) and max(diffs) < (1e-5 if invariant else 2e-2), diffs


def test_dspark_composes_each_sequences_drafts_verified_in_the_same_step(ck, widths):
    """DSpark with continuous batching: every decoding sequence drafts and is verified in one batched
    pass; greedy output is each sequence's output alone (itself DSpark-verified: lossless)."""
    plan = BATCH.replace(dspark=True, draft_length=2)
    seqs = [Sequence(_prompt(ck, n, 10 + seed), m, keep_logits=[]) for seed, (n, m) in enumerate(((6, 14), (31, 9), (12, 11), (3, 7)))]
    e = Engine(ck, plan)
    try:
        sched = Scheduler(e)
        assert sched.speculative
        widths_seen = []
        sched.model.forward_many = (lambda f: lambda states, toks, *a, **kw: widths_seen.append([len(t) for t in toks]) or f(states, toks, *a, **kw))(
            sched.model.forward_many)
        run(sched, {0: seqs[:2], 2: seqs[2:]})
    finally:
        e.close()
    assert any(sum(w == 3 for w in ws) >= 2 for ws in widths_seen)     # two sequences' verify blocks in one pass
    assert any(sum(ws) >= 16 for ws in widths_seen)                     # and passes past the tile width
    assert sum(s.spec["drafted"] for s in seqs) > 0 and all(s.spec["accepted"] <= s.spec["drafted"] for s in seqs)
    _matches_alone(ck, plan, seqs, invariant=widths == "width-invariant")


def test_the_step_budget_interleaves_a_long_prefill_with_the_streams(ck):
    e = Engine(ck, BATCH)
    try:
        sched = Scheduler(e)
        short = [sched.add(Sequence([7, 8, 9], 40)) for _ in range(2)]
        sched.step()                                                      # both prefilled in one step
        assert all(s.decoding and len(s.tokens) == 1 for s in short)
        long = sched.add(Sequence(list(range(1, 101)), 2))
        steps = 0
        while not long.decoding:
            before = [len(s.tokens) for s in short]
            sched.step()
            steps += 1
            assert [len(s.tokens) for s in short] == [b + 1 for b in before]    # the streams never stall
        assert steps >= 100 // (BATCH.max_batched_tokens - 2)             # its prompt took several steps
    finally:
        e.close()


def test_waiting_requests_wait_and_one_that_can_never_fit_is_refused(ck):
    e = Engine(ck, BATCH.replace(max_num_seqs=2))
    try:
        sched = Scheduler(e)
        for _ in range(3):
            sched.add(Sequence([5, 6], 3))
        sched.step()
        assert len(sched.running) == 2 and len(sched.waiting) == 1
        with pytest.raises(DoesNotFit, match="max_context 256"):
            sched.add(Sequence([1] * 200, 100))
        while sched.busy:
            sched.step()
    finally:
        e.close()


def test_memory_counts_every_sequence_and_admission_refuses_too_many(tiny_footprint):
    fp, one = tiny_footprint, BATCH.replace(max_num_seqs=1)
    kv = budget.kv_state_bytes(fp, 256, 0)
    assert budget.kv_states_bytes(BATCH, fp) == 3 * kv
    assert budget.host_bytes(BATCH, fp, True) - budget.host_bytes(one, fp, True) >= 2 * kv
    wide = BATCH.replace(max_batched_tokens=64)
    assert budget.step_tokens(wide) == 64 and budget.transient_bytes(wide, fp) > budget.transient_bytes(BATCH, fp)
    need = budget.host_bytes(BATCH, fp, True)
    check_plan(BATCH, fp, available=need)
    with pytest.raises(DoesNotFit):
        check_plan(BATCH.replace(max_num_seqs=4), fp, available=need)
    spec = BATCH.replace(dspark=True, draft_length=3)                 # each sequence verifies 1 + 3 tokens a step
    assert budget.step_tokens(spec.replace(max_batched_tokens=0, prefill_chunk=8)) == 3 * 4
    with pytest.raises(PlanError, match="max_num_seqs"):
        Plan(max_num_seqs=0)


def test_a_batched_step_reads_the_union_of_its_sequences_experts_once(ck):
    e = Engine(ck, BATCH.replace(max_num_seqs=4))
    try:
        sched = Scheduler(e)
        for p in ([3, 4], [9, 10, 11], [100], [42, 43]):
            sched.add(Sequence(p, 8))
        sched.step()
        e.experts.experts_read = 0
        sched.step()                                                      # one decode token for each of 4
        union = e.experts.experts_read
        per_layer = ck.config.num_experts_per_tok * ck.config.num_hidden_layers
        assert per_layer < union < 4 * per_layer     # more than one token's, fewer than four separate reads
    finally:
        e.close()
