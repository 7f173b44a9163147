"""kernels/warm.py: what the warm-up leaves compiled, and how a run tells what it compiled after."""
import numpy as np

from kernels import norms
from kernels.warm import added_since, specializations, warm_up


def test_a_signature_the_warm_up_did_not_compile_is_reported():
    warm_up(1)
    before = specializations()
    assert before["kernels.norms._rope_tables"] >= 1                   # warmed: the runtime's float32 tables
    pos = np.arange(3, dtype=np.int16)                                   # types no caller passes: a new signature
    norms.rope_tables(pos, np.ones(4, np.float32), np.zeros((3, 4)), np.zeros((3, 4)))
    assert added_since(before) == ["kernels.norms._rope_tables"]
    assert added_since(specializations()) == []
