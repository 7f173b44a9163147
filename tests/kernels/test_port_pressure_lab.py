"""The port-pressure lab's parsing (kernels/lab/port_pressure.py): the loop it hands llvm-mca and the
figures it reads back. llvm-mca itself is not needed here."""
import shutil

import pytest

from kernels.lab.port_pressure import MCA, hot_loop, mnemonic, pressure

ASM = """\
f:
\tmovq\t%rdi, %rax
.LBB0_1:
\tvpdpbusd\t%zmm1, %zmm2, %zmm3
\tjne\t.LBB0_1
.LBB0_2:
\t# a comment
\tvpdpbusd\t%zmm1, %zmm2, %zmm3
\tvmulps\t%zmm1, %zmm2, %zmm4
\t{vex}\tvpdpbusd\t%ymm5, %ymm2, %ymm6
\taddq\t$64, %rax
\tjne\t.LBB0_2
\tjmp\t.LBB0_3
.LBB0_3:
\tretq
"""

REPORT = """\
Block RThroughput: 3.0

Resources:
[0]   - Zn4FP0
[1]   - Zn4FP1
[2.0] - Zn4FP45
[2.1] - Zn4FP45

Resource pressure per iteration:
[0]    [1]    [2.0]  [2.1]
2.80   3.20   0.50   0.50

Resource pressure by instruction:
[0]    [1]    [2.0]  [2.1]  Instructions:
0.80   3.20    -      -     vpdpbusd\t%zmm1, %zmm2, %zmm3
2.00    -     0.50   0.50   vmulps\t%zmm1, %zmm2, %zmm4
"""


def test_the_hot_loop_is_the_one_with_the_most_products_without_labels_or_comments():
    body = hot_loop(ASM, "vpdpbusd")
    assert [mnemonic(b.split()) for b in body] == ["vpdpbusd", "vmulps", "vpdpbusd", "addq", "jne"]   # {vex}: AVX-VNNI
    with pytest.raises(SystemExit, match="vpmaddubsw"):
        hot_loop(ASM, "vpmaddubsw")


def test_pressure_gives_one_unit_s_cycles_per_kind_and_each_instruction_s_share():
    total, by_ins, rt = pressure(REPORT)
    assert total == {"Zn4FP0": 2.8, "Zn4FP1": 3.2, "Zn4FP45": 0.5}          # two FP45 units: one unit's cycles
    assert by_ins["vmulps"] == {"Zn4FP0": 2.0, "Zn4FP45": 0.5} and by_ins["vpdpbusd"]["Zn4FP1"] == 3.2
    assert rt == 3.0


@pytest.mark.skipif(not any(shutil.which(m) for m in MCA), reason="llvm-mca not installed (Debian: llvm-19)")
def test_llvm_mca_s_own_report_parses():
    import subprocess
    mca = next(m for m in MCA if shutil.which(m))
    out = subprocess.run([mca, "-mcpu=x86-64-v3", "-iterations=10"], input="vpaddd %ymm1, %ymm2, %ymm3\nvpmaddwd %ymm1, %ymm2, %ymm4\n",
                         capture_output=True, text=True, check=True).stdout
    total, by_ins, rt = pressure(out)
    assert rt > 0 and sum(total.values()) > 0 and set(by_ins) == {"vpaddd", "vpmaddwd"}
