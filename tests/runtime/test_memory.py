"""What the runtime holds is what the plan counts (runtime/budget.py is the one accounting)."""
import torch

from kernels.fp8_dense import Fp8Weight
from runtime.budget import dense_host_bytes, host_bytes
from runtime.engine import Engine
from runtime.plan import Plan


def _held(t) -> int:
    return t.nbytes if isinstance(t, Fp8Weight) else t.element_size() * t.nelement()


def test_dense_weights_are_held_as_fp8_and_counted(tiny_dir):
    e = Engine(tiny_dir, Plan())
    try:
        fp = e.ck.footprint()
        w = e.model.w
        fp8 = [k for k, s in e.ck.infos.items() if s.dtype == "F8_E4M3" and ".engram.embed" not in k and k in w]
        assert fp8 and all(isinstance(w[k], Fp8Weight) for k in fp8)           # no float32 copy of a linear
        assert w["embed.weight"].dtype == torch.bfloat16                       # the table as stored
        held = sum(_held(t) for k, t in w.items() if not k.startswith("mtp."))
        planned = dense_host_bytes(fp) - fp.bytes_by_class["shared_expert"]
        assert abs(held - planned) <= 0.10 * planned, (held, planned)           # norms/biases as float32: the gap
        assert host_bytes(Plan(), fp, dense_on_host=True) >= planned + fp.routed_expert_bytes_total
    finally:
        e.close()
