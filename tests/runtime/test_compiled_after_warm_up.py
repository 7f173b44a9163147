"""runtime/memwatch.py specializations / added_since: a run tells which kernels it compiled after the
warm-up (kernels/warm.py), whose compiler's memory would be in what it measures."""
import numpy as np

from kernels import norms
from kernels.warm import warm_up
from runtime.memwatch import added_since, specializations


def test_a_signature_the_warm_up_did_not_compile_is_reported():
    warm_up(None)
    before = specializations()
    assert before["kernels.norms._rope_tables"] >= 1                   # warmed: the runtime's float32 tables
    pos = np.arange(3, dtype=np.int16)                                   # types no caller passes: a new signature
    norms.rope_tables(pos, np.ones(4, np.float32), np.zeros((3, 4)), np.zeros((3, 4)))
    assert added_since(before) == ["kernels.norms._rope_tables"]
    assert added_since(specializations()) == []
