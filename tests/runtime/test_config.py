import json

import pytest

from runtime.config import PRESETS, ConfigError, ModelConfig, load_config


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_roundtrip(name, tmp_path):
    cfg = ModelConfig.preset(name)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg.to_hf_dict()))
    back = ModelConfig.from_json(p)
    assert back.to_dict() == cfg.to_dict()
    assert back.geometry_hash() == cfg.geometry_hash()


def test_v41_figures_from_the_seeds():
    c = ModelConfig.preset("deepseek-v4.1-flash")
    assert (c.num_hidden_layers, c.num_encoder_layers, c.hidden_size, c.moe_intermediate_size) == (40, 20, 5120, 2304)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (384, 1, 6)
    assert c.kv_source_layers == [2, 8, 14, 20] and c.index_source_layers == [2, 8, 14, 20, 24, 28, 32, 36]
    assert c.compress_ratios[2:20] == [2] * 18 and c.compress_ratios[20:] == [1] * 20
    assert c.fp8_block == (32, 32) and c.engram_slots == 24 and c.engram_row_bytes == 264
    assert c.expert_bytes == 18_800_640
    assert c.kv_bytes_per_token == 890
    # indexer n_blocks: context / ratio, V4.1's ratio-1 layers score every position
    assert c.n_blocks(65536, 24) == 65536 and c.n_blocks(65536, 2) == 32768
    assert [c.layer_mode(i) for i in (0, 2, 3, 24)] == ["window", "full", "reuse", "reindex"]


def test_v4_flash_preset():
    c = ModelConfig.preset("deepseek-v4-flash")
    assert c.fp8_block == (128, 128) and not c.engram_layer_ids
    assert c.expert_bytes == 13_369_344 and c.num_hidden_layers == 43 and c.n_hash_layers == 3
    assert c.n_blocks(4096, 0) == 1024


def test_mini_keeps_real_expert_geometry_and_is_memory_bound():
    c = ModelConfig.preset("mini")
    assert c.expert_bytes == ModelConfig.preset("deepseek-v4.1-flash").expert_bytes
    bank = c.expert_bytes * c.n_routed_experts * c.num_hidden_layers
    assert bank >= 4 * 300 * 2**20                                   # >= 4x this machine's 300 MiB L3
    assert sum(c.engram_num_embeddings) * c.engram_row_bytes >= 2**30  # Engram >= 1 GiB on disk


def test_tiny_window_and_topk_are_exercised():
    c = ModelConfig.preset("tiny")
    assert c.window_size < 40 and c.index_topk < 40 // max(c.compress_ratios)


def _raw(name="tiny"):
    return ModelConfig.preset(name).to_hf_dict()


def test_both_spellings_of_kv_source_layers():
    raw = _raw()
    raw["text_config"]["kv_source_layer_ids"] = raw["text_config"].pop("kv_source_layers")
    assert ModelConfig.from_dict(raw).kv_source_layers == ModelConfig.preset("tiny").kv_source_layers
    raw["text_config"]["kv_source_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="kv_source_layer_ids.*kv_source_layers.*disagree"):
        ModelConfig.from_dict(raw)


def test_top_level_keys_accepted():
    raw = _raw()
    text = raw.pop("text_config")
    raw.update(text)
    assert ModelConfig.from_dict(raw).hidden_size == 64


def test_no_engram_no_drafter_is_valid():
    raw = _raw()
    for k in ("engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
        raw["text_config"][k] = []
    raw["text_config"]["dspark_num_layers"] = 0
    c = ModelConfig.from_dict(raw)
    assert c.engram_slots == 0 and c.dspark_num_layers == 0


def test_missing_key_named(tmp_path):
    raw = _raw()
    del raw["text_config"]["hidden_size"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config.json: key 'text_config.hidden_size' is missing"):
        ModelConfig.from_json(p)


@pytest.mark.parametrize("key,value,msg", [
    ("hidden_size", "64", "must be an integer"),
    ("num_experts_per_tok", 99, "exceeds n_routed_experts"),
    ("compress_ratios", [1, 2], "one per layer"),
    ("kv_source_layers", [2, 1], "sorted distinct"),
    ("hidden_size", 48, "multiple of 32"),
])
def test_bad_values_named(key, value, msg):
    raw = _raw()
    raw["text_config"][key] = value
    with pytest.raises(ConfigError, match=rf"'.*{key}'.*{msg}|{key}.*{msg}"):
        ModelConfig.from_dict(raw)


def test_bad_block_size_type():
    raw = _raw()
    raw["quantization_config"]["weight_block_size"] = "32"
    with pytest.raises(ConfigError, match="quantization_config.weight_block_size"):
        ModelConfig.from_dict(raw)


def test_load_config_forms(tmp_path, tiny_dir):
    assert load_config("tiny").name == "tiny"
    assert load_config(tiny_dir).name == "tiny"
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
