"""A live dsv41-serve process on loopback over the tiny checkpoint, with a profile made for this host."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from autotune.fingerprint import fingerprint
from runtime.checkpoint.reader import Checkpoint
from runtime.plan import Plan

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "5090-epyc.json"


def host_profile(ck_dir, path, **plan_kw) -> Path:
    """The shipped profile's measurements under this host's fingerprint, with a plan for `ck_dir`."""
    ck = Checkpoint(ck_dir)
    d = json.loads(SHIPPED.read_text())
    d["host"] = fingerprint(ck.root, ck.footprint().geometry_hash)
    d["plan"] = Plan(geometry_hash=ck.footprint().geometry_hash, **plan_kw).to_dict()
    path.write_text(json.dumps(d))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tiny_dir, tmp_path_factory):
    prof = host_profile(tiny_dir, tmp_path_factory.mktemp("serve") / "host.json", max_context=512)
    port = free_port()
    log = open(prof.with_suffix(".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.serve", "--profile", str(prof), "--checkpoint", str(tiny_dir),
                             "--port", str(port), "--max-queue", "1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"dsv41-serve did not come up: {prof.with_suffix('.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
