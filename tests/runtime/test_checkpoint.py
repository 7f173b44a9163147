import hashlib
import json
import math
import shutil
import struct
import time

import pytest
import torch

from kernels.formats import dequantize_fp8_block, dequantize_mxfp4
from runtime.checkpoint.layout import tensor_specs
from runtime.checkpoint.reader import INDEX, Checkpoint
from runtime.checkpoint.safetensors_io import CheckpointError, read_header
from runtime.checkpoint.synth import make_checkpoint
from runtime.cli.checkpoint import main
from runtime.config import ModelConfig


def _digest(d):
    """file name -> sha256 of its bytes: a mismatch names the file."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_dir):
    again = make_checkpoint(ModelConfig.preset("tiny"), tmp_path / "a", seed=0)
    other = make_checkpoint(ModelConfig.preset("tiny"), tmp_path / "b", seed=1)
    assert _digest(again) == _digest(tiny_dir)
    shards = [n for n in _digest(tiny_dir) if n.endswith(".safetensors")]
    assert all(_digest(other)[n] != _digest(tiny_dir)[n] for n in shards)


def test_layout_of_the_tiny_checkpoint(tiny_dir):
    ck = Checkpoint(tiny_dir)
    cfg = ck.config
    assert cfg.engram_compressed_vocab_size and cfg.engram_compressed_vocab_size < cfg.vocab_size
    assert set(ck.infos) == {s.name for s in tensor_specs(cfg)}
    # Engram tables alone in the last shards, one shard per Engram layer
    last = ck.shards[-len(cfg.engram_layer_ids):]
    engram = {n for n, i in ck.infos.items() if ".engram." in n}
    assert {ck.infos[n].path.name for n in engram} == set(last)
    assert all(".engram." in n for n, i in ck.infos.items() if i.path.name in last)
    # each expert's three weights and three scales are separate tensors
    e = "layers.3.ffn.experts.5"
    assert all(f"{e}.{w}.{k}" in ck.infos for w in ("w1", "w2", "w3") for k in ("weight", "scale"))
    assert ck.infos[f"{e}.w1.weight"].dtype == "F4" and ck.infos[f"{e}.w1.scale"].dtype == "F8_E8M0"
    assert ck.infos["layers.1.attn.wq_a.weight"].dtype == "F8_E4M3"


def test_weights_have_the_stated_statistics(tiny_dir):
    ck = Checkpoint(tiny_dir)
    cfg = ck.config
    w1 = dequantize_mxfp4(ck.tensor("layers.2.ffn.experts.0.w1.weight"), ck.tensor("layers.2.ffn.experts.0.w1.scale"))
    assert w1.shape == (cfg.moe_intermediate_size, cfg.hidden_size)
    assert 0.5 < w1.pow(2).mean().sqrt().item() * math.sqrt(cfg.hidden_size) < 2.5
    wq = dequantize_fp8_block(ck.tensor("layers.2.attn.wq_a.weight"), ck.tensor("layers.2.attn.wq_a.scale"), cfg.fp8_block)
    assert abs(wq.std().item() * math.sqrt(cfg.hidden_size) - 1) < 0.2
    assert ck.tensor("embed.weight").dtype == torch.bfloat16


def test_inspect_json_and_table(tiny_dir, capsys):
    assert main(["inspect", str(tiny_dir), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cfg = ModelConfig.preset("tiny")
    assert d["expert_bytes"] == cfg.expert_bytes
    assert d["routed_bytes_per_decode_token"] == cfg.num_experts_per_tok * cfg.num_hidden_layers * cfg.expert_bytes
    assert d["bytes_by_class"]["routed_experts"] == d["routed_expert_bytes_total"]
    assert main(["inspect", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "per layer" in out


def test_full_size_skeleton_reproduces_the_reference(full_skeleton, capsys):
    assert sum(p.stat().st_blocks for p in full_skeleton.iterdir()) * 512 < 200e6   # sparse: near-zero disk
    t0 = time.perf_counter()
    for p in full_skeleton.glob("*.safetensors"):
        read_header(p)
    # headers only: reading the 510 GB of sparse zeros would take minutes; 10 s leaves a slow CI room
    assert time.perf_counter() - t0 < 10.0
    assert main(["inspect", str(full_skeleton), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_shards"] == 48
    assert d["expert_bytes"] == 18_800_640
    assert round(d["routed_expert_bytes_total"] / 1e9, 1) == 288.8
    assert round(d["engram_bytes_total"] / 1e9, 1) == 202.8
    assert round(d["routed_bytes_per_decode_token"] / 1e9, 2) == 4.51
    assert d["engram_bytes_per_token"] == 12_672
    assert round(d["encoder_pass_bytes"] / 1e9, 1) == 144.4
    assert round(d["full_pass_bytes"] / 1e9, 1) == 288.8
    assert d["n_routed_expert_tensors"] == 92_160
    assert d["kv_bytes_per_token"] == 890
    for key in ("bytes_by_class", "kv_bytes_per_token"):
        assert key in d


# ---------------------------------------------------------------- bad input
@pytest.fixture
def broken(tiny_dir, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    return d


def _shard(d, k=0):
    return sorted(d.glob("*.safetensors"))[k]


def _rewrite_header(path, mutate):
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    mutate(h)
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n:])


def _expect(d, capsys, *needles):
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for s in needles:
        assert s in err, err
    return err


def test_truncated_shard(broken, capsys):
    p = _shard(broken)
    p.write_bytes(p.read_bytes()[:-100])
    _expect(broken, capsys, p.name, "runs past the data", "truncated")


def test_tiny_file(broken, capsys):
    p = _shard(broken)
    p.write_bytes(b"\x01\x02")
    _expect(broken, capsys, p.name, "truncated shard")


def test_header_length_past_end(broken, capsys):
    p = _shard(broken)
    b = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(b) * 2) + b[8:])
    _expect(broken, capsys, p.name, "header length")


def test_header_not_json(broken, capsys):
    p = _shard(broken)
    b = bytearray(p.read_bytes())
    b[8:12] = b"{{{{"
    p.write_bytes(bytes(b))
    _expect(broken, capsys, p.name, "not valid JSON")


def test_unknown_dtype(broken, capsys):
    p = _shard(broken)
    _rewrite_header(p, lambda h: h["embed.weight"].update(dtype="Q7"))
    _expect(broken, capsys, p.name, "embed.weight", "unknown dtype 'Q7'")


def test_overlapping_ranges(broken, capsys):
    p = _shard(broken)

    def overlap(h):
        a, b = h["layers.0.attn_norm.weight"], h["layers.0.attn.wq_a.weight"]
        a["data_offsets"] = b["data_offsets"][:1] + [b["data_offsets"][0] + a["data_offsets"][1] - a["data_offsets"][0]]
    _rewrite_header(p, overlap)
    _expect(broken, capsys, p.name, "overlap", "layers.0.attn_norm.weight")


def test_shard_in_index_absent(broken, capsys):
    p = _shard(broken, 1)
    p.unlink()
    _expect(broken, capsys, INDEX, p.name, "absent")


def test_config_key_missing_and_wrong_type(broken, capsys):
    cfgp = broken / "config.json"
    raw = json.loads(cfgp.read_text())
    del raw["text_config"]["n_routed_experts"]
    cfgp.write_text(json.dumps(raw))
    _expect(broken, capsys, "config.json", "text_config.n_routed_experts", "missing")
    raw["text_config"]["n_routed_experts"] = 16.5
    cfgp.write_text(json.dumps(raw))
    _expect(broken, capsys, "config.json", "text_config.n_routed_experts", "integer")


def test_block_size_mismatch_is_named(tiny_dir, tmp_path, capsys):
    # a checkpoint written with 16x16 blocks, read with the 32x32 config (and the reverse)
    other = ModelConfig.preset("tiny").replace(weight_block_size=[16, 16])
    d = make_checkpoint(other, tmp_path / "b16")
    with pytest.raises(CheckpointError, match=r"16x16 block layout.*weight_block_size \[32, 32\]"):
        Checkpoint(d, config=ModelConfig.preset("tiny"))
    with pytest.raises(CheckpointError, match=r"32x32 block layout.*weight_block_size \[16, 16\]"):
        Checkpoint(tiny_dir, config=other)


def test_missing_and_extra_tensors(broken):
    idx = json.loads((broken / INDEX).read_text())
    victim = "layers.0.ffn.experts.1.w2.scale"
    shard = idx["weight_map"].pop(victim)
    _rewrite_header(broken / shard, lambda h: h.pop(victim))
    (broken / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=f"'{victim}' is missing"):
        Checkpoint(broken)


def test_an_extra_tensor_is_named(broken):
    idx = json.loads((broken / INDEX).read_text())
    shard = idx["weight_map"]["embed.weight"]
    stray = "layers.0.ffn.experts.999.w1.weight"

    def add(h):                                              # 8 new bytes at the end, a name the layout lacks
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        h[stray] = {"dtype": "U8", "shape": [8], "data_offsets": [end, end + 8]}
    _rewrite_header(broken / shard, add)
    with open(broken / shard, "ab") as f:
        f.write(bytes(8))
    idx["weight_map"][stray] = shard
    (broken / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=f"{shard}: tensor '{stray}' is not part of the layout"):
        Checkpoint(broken)


def test_index_points_at_wrong_shard(broken):
    idx = json.loads((broken / INDEX).read_text())
    idx["weight_map"]["embed.weight"] = sorted(set(idx["weight_map"].values()))[-1]
    (broken / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="embed.weight"):
        Checkpoint(broken)


def test_a_reordered_checkpoint_computes_the_same_experts_from_the_nvme_tier(tiny_dir, tmp_path):
    """A valid checkpoint may store an expert's tensors in any order: swap w1.weight and w2.weight (bytes
    and offsets, same size) in the shard; the NVMe tier must slice by each tensor's own header offsets."""
    from runtime.experts import PlacedExperts, ReferenceExperts
    from runtime.plan import Plan
    d = tmp_path / "reordered"
    shutil.copytree(tiny_dir, d)
    layer, e = 3, 15                                      # the last expert: on the NVMe tier below
    a, b = f"layers.{layer}.ffn.experts.{e}.w1.weight", f"layers.{layer}.ffn.experts.{e}.w2.weight"
    shard = d / json.loads((d / INDEX).read_text())["weight_map"][a]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    (a0, a1), (b0, b1) = h[a]["data_offsets"], h[b]["data_offsets"]
    assert a1 - a0 == b1 - b0
    base = 8 + n
    raw[base + a0:base + a1], raw[base + b0:base + b1] = raw[base + b0:base + b1], raw[base + a0:base + a1]
    h[a]["data_offsets"], h[b]["data_offsets"] = [b0, b1], [a0, a1]
    shard.write_bytes(bytes(raw))
    _rewrite_header(shard, lambda hh: hh.update({a: h[a], b: h[b]}))
    ck = Checkpoint(d)
    pe = PlacedExperts(ck, Plan(host_expert_budget_gib=0.0004, cpu_threads=1))
    assert pe.resident[layer] <= e                        # expert 15 is read from the NVMe tier
    ref = ReferenceExperts(ck)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(2, ck.config.hidden_size, generator=g)
    ids, w = torch.tensor([[e], [e]]), torch.ones(2, 1)
    y, r = pe.routed(layer, m, ids, w), ref.routed(layer, m.double(), ids, w.double())
    assert ((y.double() - r).norm() / r.norm()) < 1e-5
    pe.close()
