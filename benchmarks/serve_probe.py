"""Probe `structkv serve` the way issue 32 found it failing: a connection flood past the file limit,
and large bodies, against a real `structkv serve` process (its own file limit), in one run.

1. Flood: open `--sockets` idle connections (more than the process's `--nofile` limit) and hold
   them; meanwhile ask /health every second from a fresh connection. Reported: how many /health
   answered, how long the idle sockets stayed open (the server closes them on its own or not),
   and how much the server's log grew.
2. Large bodies: one 15.5 MiB context, then three 8 MiB ones at once; the server's resident
   memory (RSS) before, at its peak (sampled every 50 ms) and after, and what each got back.

    python benchmarks/serve_probe.py --model gemma-3-270m --out research/results/serve_probe_gemma.md
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_up(url: str, timeout: float = 300, proc=None) -> None:
    """Until `url`/health answers; a server process `proc` that exits meanwhile ends the wait."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flood(port: int, n: int, hold_s: float, log: Path) -> dict:
    import httpx

    before = log.stat().st_size
    held, failed = [], 0
    for _ in range(n):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            failed += 1
    health, t0 = [], time.monotonic()
    while time.monotonic() - t0 < hold_s:
        try:
            health.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
        except httpx.HTTPError as e:
            health.append(type(e).__name__)
        time.sleep(1)
    closed = 0
    for s in held:  # a socket the server closed reads b"" (or resets)
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"sockets": n, "connect_failed": failed, "held_s": hold_s, "closed_by_server": closed,
            "health_ok": sum(h == 200 for h in health), "health_asked": len(health),
            "health_other": sorted({str(h) for h in health if h != 200}),
            "log_growth_kib": (log.stat().st_size - before) / 1024}


def big_bodies(port: int, pid: int, model: str) -> dict:
    import httpx

    url = f"http://127.0.0.1:{port}/v1/completions"
    peak, stop = [rss_mib(pid)], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(rss_mib(pid))
            time.sleep(0.05)

    def post(mib: float) -> dict:
        text = ("The quick brown fox jumps over the lazy dog. " * (int(mib * 2**20) // 45 + 1))[: int(mib * 2**20)]
        body = json.dumps({"model": model, "prompt": "Summarise.", "context": text, "max_tokens": 4})
        t = time.perf_counter()
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=300)
        return {"mib": mib, "status": r.status_code, "code": (r.json().get("error") or {}).get("code"),
                "s": round(time.perf_counter() - t, 2)}

    out = {"rss_before_mib": peak[0]}
    threading.Thread(target=sample, daemon=True).start()
    out["one_15_5"] = post(15.5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(8))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["three_8"] = results
    time.sleep(2)
    stop.set()
    out["rss_peak_mib"], out["rss_after_mib"] = max(peak), rss_mib(pid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--nofile", type=int, default=1024, help="the server process's open-file limit")
    p.add_argument("--sockets", type=int, default=1030)
    p.add_argument("--hold", type=float, default=20.0, help="seconds the idle sockets are held")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this client holds the sockets: raise its own
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.sockets + 256)), hard))
    port = free_port()
    log = Path(f"/tmp/structkv_probe_{port}.log")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    code = "import sys; from structkv.cli import main; sys.exit(main(sys.argv[1:]))"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", args.model, "--port", str(port),
                                 "--compile", "never"], stdout=f, stderr=subprocess.STDOUT, preexec_fn=limit)
    try:
        wait_up(f"http://127.0.0.1:{port}")
        report = {"model": args.model, "nofile": args.nofile, "flood": flood(port, args.sockets, args.hold, log),
                  "bodies": big_bodies(port, proc.pid, args.model)}
    finally:
        proc.terminate()
        proc.wait(60)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        command = f"python benchmarks/serve_probe.py {' '.join(sys.argv[1:])}"
        Path(args.out).write_text(f"`{command}`\n\n```json\n{text}\n```\n")
    common = Counter(line[:120] for line in log.read_text().splitlines()).most_common(5)
    print("server log, most frequent lines:", *(f"{n} x {line}" for line, n in common), sep="\n")
    os.remove(log)


if __name__ == "__main__":
    main()
