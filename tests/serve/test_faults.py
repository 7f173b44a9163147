"""Fault injection on the Engram NVMe path: a read error reaches the request that issued it, named
(file, offset), and the server stays up and serves the next request."""
import errno
import shutil

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

import runtime.io_reader as io_reader
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.engram_store import EngramReadError, EngramStore
from runtime.plan import Plan
from runtime.serve.app import create_app
from runtime.serve.chat import ChatTemplate


@pytest.fixture
def ck_copy(tiny_dir, tmp_path):
    d = tmp_path / "tiny"
    shutil.copytree(tiny_dir, d)
    return d


def _rows(ck):
    cfg = ck.config
    layer = cfg.engram_layer_ids[0]
    rows = np.array([[cfg.engram_num_embeddings[0] - 1, 3]])     # the last row: at the end of its table
    return layer, rows


def _eio(monkeypatch):
    """Every read fails: the compiled batch (threads) and the io_uring / kernel AIO batches report errors, the slow
    path's preadv raises EIO."""
    def failing_batch(fds, base, offs, dests, sizes, got, ns, timed, ts):
        got[:] = -1

    def failing_aio(self, fds, base, offs, dests, sizes, got, ns, timed):
        got[:] = -errno.EIO
    monkeypatch.setattr(io_reader.AioContext, "read", failing_aio)
    monkeypatch.setattr(io_reader.UringContext, "read", failing_aio)

    def eio(*a):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(io_reader, "_pread_batch", failing_batch)
    monkeypatch.setattr(io_reader.BatchedReader, "_read_one", staticmethod(eio))


def test_a_truncated_table_fails_the_read_naming_file_and_offset(ck_copy):
    ck = Checkpoint(ck_copy)
    store = EngramStore(ck, "nvme_direct", depth=2)
    layer, rows = _rows(ck)
    shard = ck.shard_of(f"layers.{layer}.engram.embed.weight")
    assert store.rows(layer, rows).shape[:2] == (1, 2)              # fine before
    with open(shard, "r+b") as f:                                    # truncated after load
        f.truncate(ck.infos[f"layers.{layer}.engram.embed.weight"].begin + 4096)
    store.prefetch({layer: rows})
    with pytest.raises(EngramReadError, match=rf"layer {layer}: {shard.name}: reading \d+ B at offset \d+: the file ends"):
        store.rows(layer, rows)
    store.close()


def test_an_eio_reaches_the_request_and_a_late_read_never_lands_in_the_next_one(ck_copy, monkeypatch):
    ck = Checkpoint(ck_copy)
    store = EngramStore(ck, "nvme_direct", depth=2)
    layer, rows = _rows(ck)
    with monkeypatch.context() as m:
        _eio(m)
        store.prefetch({layer: rows})
        with pytest.raises(EngramReadError, match=r"Input/output error") as e:
            store.rows(layer, rows)
        assert ck.shard_of(f"layers.{layer}.engram.embed.weight").name in str(e.value)
    other = rows - 1                                                 # the next request reads other rows
    assert store.rows(layer, other).shape == (1, 2, ck.config.engram_head_dim)
    store.close()


def test_the_server_answers_the_failed_request_with_the_reason_and_serves_the_next(ck_copy, monkeypatch):
    engine = Engine(ck_copy, Plan(engram_placement="nvme_direct", max_context=256))
    tok = Tokenizer.from_file(str(ck_copy / "tokenizer.json"))
    app = create_app(engine, tok, ChatTemplate(), "tiny", {})
    body = {"model": "tiny", "prompt": "a fault on the way", "max_tokens": 3}
    try:
        with TestClient(app) as client:
            with monkeypatch.context() as m:
                _eio(m)
                r = client.post("/v1/completions", json=body)
            assert r.status_code == 500
            err = r.json()["error"]
            assert "EngramReadError" in err["message"] and "offset" in err["message"] and "Input/output error" in err["message"]
            assert client.get("/health").status_code == 200
            ok = client.post("/v1/completions", json=body)
            done = ok.json()                   # served to its end: all 3 tokens, or the model's own stop
            assert ok.status_code == 200 and (done["usage"]["completion_tokens"] == 3 or done["choices"][0]["finish_reason"] == "stop")
            assert done["usage"]["completion_tokens"] >= 1
    finally:
        engine.close()
