"""Shared fixtures, once per test session: a tiny checkpoint, a full-size skeleton, a quick end-to-end
tune of this host, a live dsv41-serve process on loopback, and `start_cases` (a module's subprocess
cases run two at a time)."""
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from autotune.cli import main as tune_main
from hostinfo.fingerprint import fingerprint
from runtime.checkpoint.reader import Checkpoint
from runtime.checkpoint.synth import make_checkpoint
from runtime.config import ModelConfig
from runtime.plan import Plan

SHIPPED = Path(__file__).resolve().parents[1] / "profiles" / "5090-epyc.json"


LANES = 2            # subprocess cases at a time (start_cases)


@contextlib.contextmanager
def _start_cases(request, jobs: dict, case_of=lambda item: item.callspec.id):
    """Start a module's cases at once, LANES at a time, in the order given (longest first): jobs {case
    id: (function, *args)} -> {case id: future of its result}, only the cases this session selected
    (`case_of`: the case id of a test that uses the calling fixture). Each case is one process, most
    of it single-threaded (numba compiling a forced SIMD path's kernels cold, Optuna, a server), so on
    a 2-core CI machine two take about the time of one; a case that calls pytest.skip skips the test
    that awaits it."""
    wanted = {case_of(item) for item in request.session.items
              if item.module is request.module and request.fixturename in item.fixturenames}
    with ThreadPoolExecutor(LANES) as pool:
        yield {k: pool.submit(*job) for k, job in jobs.items() if k in wanted}


@pytest.fixture(scope="session")
def start_cases():
    return _start_cases


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_checkpoint(ModelConfig.preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def full_skeleton(tmp_path_factory):
    return make_checkpoint(ModelConfig.preset("deepseek-v4.1-flash"), tmp_path_factory.mktemp("full"), skeleton=True)


@pytest.fixture(scope="session")
def quick_profile(tiny_dir, tmp_path_factory):
    """`dsv41-tune profile --quick` on tiny: this host's measurements (no plan yet)."""
    out = tmp_path_factory.mktemp("prof") / "host.json"
    assert tune_main(["profile", "--checkpoint", str(tiny_dir), "--quick", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def tuned(tiny_dir, quick_profile, tmp_path_factory):
    """dsv41-tune end to end (quick) on tiny: this host's profile with plan, predictions and validation.
    It starts from quick_profile's file, as a user's tune after `dsv41-tune profile` does (a fresh
    profile is reused: one profile of this host per test session)."""
    d = tmp_path_factory.mktemp("tune")
    out = d / "host.json"
    shutil.copy(quick_profile, out)
    assert tune_main(["--checkpoint", str(tiny_dir), "--quick", "--out", str(out), "--prompt-tokens", "96",
                      "--max-tokens", "12", "--storage", f"sqlite:///{d / 'studies.db'}"]) == 0
    return out


def _host_profile(ck_dir, path, **plan_kw) -> Path:
    """The shipped profile's measurements under this host's fingerprint, with a plan for `ck_dir`."""
    ck = Checkpoint(ck_dir)
    d = json.loads(SHIPPED.read_text())
    d["host"] = fingerprint(ck.root, ck.footprint().geometry_hash)
    d["plan"] = Plan(geometry_hash=ck.footprint().geometry_hash, **plan_kw).to_dict()
    path.write_text(json.dumps(d))
    return path


@pytest.fixture(scope="session")
def shipped():
    return SHIPPED


@pytest.fixture(scope="session")
def host_profile():
    return _host_profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint, profile, *extra) -> tuple[subprocess.Popen, str, object]:
    """dsv41-serve on a free loopback port, up and healthy. -> (process, url, log file)."""
    port = free_port()
    log = open(profile.with_suffix(".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.serve", "--profile", str(profile), "--checkpoint", str(checkpoint),
                             "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"dsv41-serve did not come up: {profile.with_suffix('.log').read_text()[-2000:]}")
        time.sleep(0.5)


def stop_server(proc, log) -> None:
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="session")
def server(tiny_dir, tmp_path_factory):
    prof = _host_profile(tiny_dir, tmp_path_factory.mktemp("serve") / "host.json", max_context=512)
    proc, url, log = start_server(tiny_dir, prof, "--max-queue", "2")
    yield url
    stop_server(proc, log)
