"""Soak test: N concurrent streaming clients against a dsv41-serve on loopback for a bounded time.

  python scripts/soak.py --checkpoint DIR --profile P.json [--clients 8] [--duration 180] [--abort-every 5] [--max-num-seqs 8]
  python scripts/soak.py --url http://127.0.0.1:PORT --pid PID ...      (a server you started)

Each client loops until the deadline: a streamed completion of random length (ignore_eos, so it must
return exactly max_tokens); every --abort-every-th request is dropped on purpose after a few chunks
(a client that disconnects). Reported: requests sent, completed, failed (an error or a wrong token
count), lost (no terminal answer), aborted on purpose; the server's resident memory at start, end
and peak (sampled every 2 s) and its growth, overall and past a warm-up (--warmup, 60 s; fails above --max-growth-pct); whether the server is idle afterwards and whether its
own counters agree. Goal: none failed or lost, flat memory. Only loopback URLs are accepted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx
import psutil


async def client(url, deadline, rng, stats, abort_every, lengths):
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as c:
        while time.time() < deadline:
            n = rng.randint(*lengths)
            stats["sent"] += 1
            abort = abort_every and stats["sent"] % abort_every == 0
            body = {"model": stats["model"], "prompt": "The queue holds " * rng.randint(1, 20), "max_tokens": n,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            try:
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["failed"].append(f"HTTP {r.status_code}")
                        continue
                    chunks, usage, done = 0, None, False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            d = json.loads(line[6:])
                            chunks += 1
                            usage = d.get("usage") or usage
                            if "error" in d:
                                stats["failed"].append(d["error"]["message"])
                        if abort and chunks == 3:
                            break
                    if abort:
                        stats["aborted"] += 1
                    elif not done:
                        stats["lost"] += 1
                    elif not usage or usage["completion_tokens"] != n:
                        stats["failed"].append(f"asked {n} tokens, got {usage and usage['completion_tokens']}")
                    else:
                        stats["completed"] += 1
            except httpx.HTTPError as e:
                stats["failed"].append(f"{type(e).__name__}: {e}")


async def sample_rss(proc, deadline, samples):
    """(seconds since start, RSS bytes) every 2 s until the deadline."""
    t0 = time.time()
    while time.time() < deadline:
        samples.append((time.time() - t0, proc.memory_info().rss))
        await asyncio.sleep(2)


def rss_summary(samples, warmup):
    """RSS in MiB: start, end, peak, growth overall and over the RSS once `warmup` seconds have passed
    (the allocator and the kernels' caches settle in the first minute; the goal is flat after it)."""
    rss = [r for _, r in samples]
    warm = next((r for t, r in samples if t >= warmup), rss[len(rss) // 2])
    return {"start": rss[0] / 2**20, "end": rss[-1] / 2**20, "peak": max(rss) / 2**20, "growth": (rss[-1] - rss[0]) / 2**20,
            "warmup_s": warmup, "after_warmup": warm / 2**20, "growth_after_warmup_pct": 100 * (rss[-1] - warm) / warm}


def start_server(args):
    log = tempfile.TemporaryFile()                     # the server's log (a pipe could fill up and stall it)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "runtime.cli.serve", "--profile", args.profile, "--checkpoint", args.checkpoint,
                          "--port", str(port), "--max-queue", str(args.clients)]
                         + (["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []), stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, p
        except httpx.HTTPError:
            time.sleep(0.5)
        if p.poll() is not None:
            break
    p.kill()
    log.seek(0)
    raise SystemExit("soak: the server did not come up:\n" + log.read()[-2000:].decode(errors="replace"))


def metric(url, name):
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def finished_ok(url, model):
    """Requests the server finished normally (stop or length), as its metrics count them."""
    return sum(metric(url, f'dsv41:request_success_total{{finished_reason="{r}",model_name="{model}"}}') for r in ("stop", "length"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--pid", type=int, help="the server's process id (with --url), for its memory")
    ap.add_argument("--checkpoint")
    ap.add_argument("--profile")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=180, help="seconds (the soak stops sending then, and drains)")
    ap.add_argument("--abort-every", type=int, default=5, help="drop every k-th request mid-stream (0: never)")
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, help="sequences the started server batches (default: its plan's)")
    ap.add_argument("--warmup", type=float, default=60, help="seconds after which the RSS is the baseline for growth")
    ap.add_argument("--max-growth-pct", type=float, default=5.0, help="fail when RSS grows more than this past the warm-up")
    args = ap.parse_args()
    own = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("soak: loopback URLs only")
        url, pid = args.url.rstrip("/"), args.pid
    else:
        if not (args.checkpoint and args.profile):
            raise SystemExit("soak: give --checkpoint and --profile (or --url of a loopback server)")
        url, own = start_server(args)
        pid = own.pid
    try:
        proc = psutil.Process(pid) if pid else None
        stats = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "sent": 0, "completed": 0, "failed": [],
                 "lost": 0, "aborted": 0}
        ok0 = finished_ok(url, stats["model"])
        rss, deadline, rng = [], time.time() + args.duration, random.Random(args.seed)

        async def run():
            tasks = [client(url, deadline, random.Random(rng.random()), stats, args.abort_every, (args.min_tokens, args.max_tokens))
                     for _ in range(args.clients)]
            if proc:
                tasks.append(sample_rss(proc, deadline, rss))
            await asyncio.gather(*tasks)
        t0 = time.time()
        asyncio.run(run())
        time.sleep(1)
        health = httpx.get(url + "/health").json()
        server_ok = finished_ok(url, stats["model"]) - ok0
        if proc:
            rss.append((time.time() - t0, proc.memory_info().rss))
        out = {"clients": args.clients, "seconds": round(time.time() - t0, 1), "sent": stats["sent"], "completed": stats["completed"],
               "failed": len(stats["failed"]), "lost": stats["lost"], "aborted_on_purpose": stats["aborted"],
               "failure_reasons": sorted(set(stats["failed"]))[:10], "server_idle_after": health["running"] == 0 and health["queued"] == 0,
               "server_counted_ok": server_ok,
               "rss_mib": rss_summary(rss, args.warmup) if rss else None}
        print(json.dumps(out, indent=1))
        bad = out["failed"] or out["lost"] or not out["server_idle_after"] or out["sent"] != out["completed"] + out["failed"] + out["lost"] + out["aborted_on_purpose"]
        bad = bad or (rss and out["rss_mib"]["growth_after_warmup_pct"] > args.max_growth_pct)
        return 1 if bad else 0
    finally:
        if own:
            own.terminate()
            own.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
