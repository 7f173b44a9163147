"""Safetensors shards at the byte level: a strict header reader and a streaming writer.

A shard is: u64 little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}`), then the data; offsets are relative to the
data start. The reader never touches the data: it validates the header against the file size
(truncation, overlaps, ranges past the end, unknown dtypes, byte counts that disagree with the shape)
and raises CheckpointError naming the file and tensor. The writer streams one tensor at a time, so a
shard never has to fit in RAM, and can write header-only sparse files (the full-size skeleton).
"""
from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple
from pathlib import Path

from runtime.checkpoint.layout import DTYPE_BYTES

MAX_HEADER = 1 << 30


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or does not match its config; the message names it."""


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple
    begin: int      # absolute file offset of the first byte
    end: int        # absolute file offset past the last byte
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def nbytes_of(dtype: str, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return int(n * DTYPE_BYTES[dtype])


def read_header(path) -> tuple[dict[str, TensorInfo], dict]:
    """-> ({name: TensorInfo}, metadata). Reads only the header."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path.name}: truncated shard ({size} B, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path.name}: header length {n} B runs past the end of the file ({size} B)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: shard file is missing ({path})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    infos, spans = {}, []
    for name, h in header.items():
        try:
            dtype, shape, (b, e) = h["dtype"], h["shape"], h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: tensor '{name}' has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path.name}: tensor '{name}' has unknown dtype '{dtype}'")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise CheckpointError(f"{path.name}: tensor '{name}' has a bad shape {shape}")
        if not (type(b) is int and type(e) is int and 0 <= b <= e):
            raise CheckpointError(f"{path.name}: tensor '{name}' has bad data_offsets [{b}, {e}]")
        if e > data_len:
            raise CheckpointError(f"{path.name}: tensor '{name}' runs past the data "
                                  f"(ends at {e} B, the data holds {data_len} B): truncated shard?")
        n_el = 1
        for d in shape:
            n_el *= d
        if e - b != int(n_el * DTYPE_BYTES[dtype]):
            raise CheckpointError(f"{path.name}: tensor '{name}' spans {e - b} B but {dtype}{shape} needs "
                                  f"{nbytes_of(dtype, shape)} B")
        infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + b, data_start + e, path)
        spans.append((b, e, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path.name}: tensors '{n0}' and '{n1}' overlap ([{b0}, {e0}) and [{b1}, {e1}))")
    return infos, meta


class ShardWriter:
    """Writes one shard: the header first (all shapes known up front), then each tensor's bytes in
    order via `write(name, buffer)`. `sparse=True` writes the header only and extends the file to its
    full size without data (a skeleton: real headers, near-zero disk)."""

    def __init__(self, path, entries: list[tuple[str, str, tuple]], metadata: dict | None = None, sparse=False):
        self.path, self.sparse = Path(path), sparse
        header, off = {"__metadata__": metadata or {"format": "pt"}}, 0
        self.order = []
        for name, dtype, shape in entries:
            nb = nbytes_of(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nb]}
            self.order.append((name, nb))
            off += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_len, self.next = off, 0
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.total = 8 + len(raw) + off

    def write(self, name: str, chunks) -> None:
        """The next tensor's bytes, as one buffer or an iterable of buffers (streamed)."""
        want, nb = self.order[self.next]
        if name != want:
            raise CheckpointError(f"{self.path.name}: expected tensor '{want}' next, got '{name}'")
        got = 0
        for buf in ([chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) or hasattr(chunks, "__array_interface__") else chunks):
            mv = memoryview(buf).cast("B")
            got += mv.nbytes
            self.f.write(mv)
        if got != nb:
            raise CheckpointError(f"{self.path.name}: tensor '{name}' got {got} B, its header says {nb} B")
        self.next += 1

    def close(self) -> None:
        if self.sparse:
            self.f.truncate(self.total)
        elif self.next != len(self.order):
            raise CheckpointError(f"{self.path.name}: only {self.next} of {len(self.order)} tensors written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)  # a shard appears whole or not at all
