"""The batched reader's engines (io_uring, kernel AIO, pread threads) read the same bytes: unaligned
requests, requests longer than a piece, the end of the file, many files; a forced engine the kernel
refuses is an error naming why; a bad engine name is refused."""

import numpy as np
import pytest

import runtime.io_reader as io_reader
from hostinfo import o_direct_refusal
from runtime.aio import AioContext
from runtime.uring import UringContext
from runtime.io_reader import BatchedReader


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("io")
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((3 << 20, 123_457)):
        p = d / f"f{i}.bin"
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append(p)
    return out


def _requests(files, seed):
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(300):
        p = files[int(rng.integers(0, len(files)))]
        size = p.stat().st_size
        n = int(rng.choice([1, 17, 4096, 5000, 70_000, (1 << 20) + 3]))
        n = min(n, size)
        reqs.append((str(p), int(rng.integers(0, size - n + 1)), n))
    reqs.append((str(files[1]), files[1].stat().st_size - 9, 9))      # the file's last bytes
    return reqs


OPEN = {"uring": UringContext.open, "aio": AioContext.open}


def _skip_unless_available(engine, path):
    """Skip (saying why) where this host has no O_DIRECT or the kernel refuses the asynchronous engine."""
    if engine in OPEN:
        if o_direct_refusal(path):
            pytest.skip(f"no O_DIRECT here: {o_direct_refusal(path)}")
        ctx, why = OPEN[engine](1)
        if ctx is None:
            pytest.skip(f"the kernel refuses {engine} here: {why}")
        ctx.close()


@pytest.mark.parametrize("engine", ["uring", "aio", "threads", "auto"])
@pytest.mark.parametrize("depth", [1, 8, 64])
def test_every_engine_reads_the_right_bytes(files, engine, depth):
    _skip_unless_available(engine, files[0])
    data = {str(p): p.read_bytes() for p in files}
    r = BatchedReader(depth=depth, engine=engine)
    reqs = _requests(files, depth)
    got = r.read(reqs, latencies=(lat := []))
    for (p, o, n), a in zip(reqs, got):
        assert bytes(a) == data[p][o:o + n], (p, o, n)
    assert len(lat) >= len(reqs) and min(lat) >= 0
    if engine != "auto":
        assert r.engine_used == engine
    r.close()


def test_a_forced_engine_the_kernel_refuses_names_why(files, monkeypatch):
    if o_direct_refusal(files[0]):
        pytest.skip(f"no O_DIRECT here: {o_direct_refusal(files[0])}")
    monkeypatch.setattr(io_reader.AioContext, "open", classmethod(lambda cls, depth: (None, "io_setup refused (1: seccomp)")))
    monkeypatch.setattr(io_reader.UringContext, "open", classmethod(lambda cls, depth: (None, "io_uring_setup refused (1: seccomp)")))
    r = BatchedReader(depth=4, engine="aio")
    with pytest.raises(OSError, match="engine 'aio' is unavailable: aio: io_setup refused"):
        r.read([(str(files[0]), 0, 10)])
    auto = BatchedReader(depth=4)                                       # auto: threads, and says why
    assert bytes(auto.read([(str(files[0]), 5, 10)])[0]) == files[0].read_bytes()[5:15]
    assert auto.engine_used == "threads" and "uring: io_uring_setup refused" in auto.aio_refusal and "aio: io_setup" in auto.aio_refusal
    r.close()
    auto.close()


def test_an_unknown_engine_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="engine 'spdk' .* must be one of"):
        BatchedReader(engine="spdk")
    monkeypatch.setenv("DSV41_IO_ENGINE", "bogus")
    with pytest.raises(ValueError, match=r"DSV41_IO_ENGINE"):
        BatchedReader()


def test_an_engine_that_fails_mid_read_hands_over_to_threads(files, monkeypatch):
    """A ring that breaks during a read is closed; that read and the next are served by the threads."""
    if o_direct_refusal(files[0]):
        pytest.skip(f"no O_DIRECT here: {o_direct_refusal(files[0])}")
    def broken(self, *a):
        raise OSError(5, "io_uring_enter failed")
    monkeypatch.setattr(io_reader.UringContext, "read", broken)
    monkeypatch.setattr(io_reader.AioContext, "read", broken)
    r = BatchedReader(depth=4)
    data = files[0].read_bytes()
    assert bytes(r.read([(str(files[0]), 100, 9000)])[0]) == data[100:9100]
    assert r.engine_used == "threads" and "failed during a read" in r.aio_refusal
    assert bytes(r.read([(str(files[0]), 7, 3)])[0]) == data[7:10]
    r.close()


@pytest.mark.parametrize("engine", ["uring", "aio", "threads"])
def test_block_reads_and_the_probes_discarding_reads(files, engine):
    """read_blocks puts block k of the list at k * BLOCK; a discarding read (the IOPS probe's) reads the
    same blocks into a ring of 2 x depth blocks, counts them, returns nothing, and takes whole blocks only."""
    _skip_unless_available(engine, files[0])
    B = io_reader.BLOCK
    data = files[0].read_bytes()
    blocks = np.random.default_rng(5).integers(0, len(data) // B, 500)
    r = BatchedReader(depth=8, engine=engine)
    got = r.read_blocks(str(files[0]), blocks, latencies=(lat := []))
    assert all(bytes(got[k * B:(k + 1) * B]) == data[b * B:(b + 1) * B] for k, b in enumerate(blocks))
    before = r.requests
    assert r.read_blocks(str(files[0]), blocks, reuse=True, latencies=lat, discard=True) is None
    assert r.requests - before == len(blocks) and len(lat) == 2 * len(blocks)
    with pytest.raises(ValueError, match="whole aligned blocks"):
        r._read_arrays({str(files[0]): r._fd(str(files[0]))}, np.array([r._fd(str(files[0]))]), np.array([0]),
                       np.array([100]), None, True, ring=16)
    r.close()
