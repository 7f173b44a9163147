"""One host-matrix case, run in its own process so the host overrides in its environment hold from the
first import: `dsv41-tune --quick` on a checkpoint (profile -> search -> validation), then one request
through the served API (the app `dsv41-serve` builds, driven in process). Prints one JSON line.

  python tests/hostinfo/host_case.py CHECKPOINT OUT_DIR
"""
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

import hostinfo
from autotune.cli import main as tune_main
from runtime.cli.serve import build_app
from runtime.profile import load_profile


def main(ck: str, out_dir: str) -> None:
    out = Path(out_dir) / "host.json"
    rc = tune_main(["--checkpoint", ck, "--quick", "--out", str(out), "--prompt-tokens", "24", "--max-tokens", "4",
                    "--storage", f"sqlite:///{Path(out_dir) / 'studies.db'}"])
    if rc != 0:
        sys.exit(f"dsv41-tune exited {rc}")
    prof = load_profile(out)
    args = SimpleNamespace(profile=str(out), checkpoint=ck, force=False, chat_template=None, served_model_name=None,
                           max_queue=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app, engine, plan, name = build_app(args)
    try:
        with TestClient(app) as client:
            # greedy: the same tokens whatever plan the tune picked (exact knobs); the API's default samples at
            # temperature 1 with a fresh seed, and a sample that began with EOS gave an empty text (a CI flake)
            r = client.post("/v1/completions", json={"model": name, "prompt": "the host shape", "max_tokens": 3,
                                                     "temperature": 0})
            info = client.get("/dsv41/info").json()
    finally:
        engine.close()
    print(json.dumps({"facts": hostinfo.facts().to_dict(), "status": r.status_code, "completion": r.json(),
                      "plan": prof["plan"], "measurements": prof["measurements"], "host": prof["host"],
                      "info_io": {"profile": info.get("profile_nvme_io_path"), "live": info.get("nvme_io_paths")},
                      "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
