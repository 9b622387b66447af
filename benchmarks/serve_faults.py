"""Load and faults against a live `structkv serve` (loopback only, bounded in count and time): bad
input, one request's sampling beside another's, archives changed under the server, a one-client
flood, clients that leave mid-body. Prints one table: each check, its target, what was measured.

    python benchmarks/serve_faults.py --model gemma-3-270m --out research/results/serve_faults_gemma.md

The phases are functions of a server URL (`bad_input`, `isolation`, `archive_faults`, `flood`,
`leavers`), so tests/test_serve_faults.py runs the fast ones against an in-process server.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BIG = "9" * 400  # an integer no float holds
FLOOD_ADDRESS = "127.0.0.2"  # the flooding client's source address (Linux routes all of 127/8 to loopback)


def bad_requests(model: str) -> list[tuple[str, str, dict | str]]:
    """(label, path, body) of requests a server must refuse with a 4xx naming the problem. The
    field checks go to /v1/completions (every model has one; a model without a chat template
    refuses every chat request for that reason alone)."""
    chat, done = "/v1/chat/completions", "/v1/completions"
    base = {"model": model, "prompt": "Hi", "max_tokens": 4}
    msgs = {"model": model, "max_tokens": 4}
    raw = '{"model": "%s", "prompt": "x", %s}'  # numbers no JSON encoder writes
    return [
        ("not JSON", done, "{not json"),
        ("JSON array", done, "[1, 2]"),
        ("no prompt", done, {"model": model}),
        ("no messages", chat, {"model": model}),
        ("empty messages", chat, {**msgs, "messages": []}),
        ("unknown role", chat, {**msgs, "messages": [{"role": "wizard", "content": "x"}]}),
        ("content not text", chat, {**msgs, "messages": [{"role": "user", "content": 5}]}),
        ("unknown model", done, {**base, "model": "nope"}),
        ("method empty", done, {**base, "method": ""}),
        ("unknown method", done, {**base, "method": "magic"}),
        ("kv_budget 0", done, {**base, "kv_budget": 0}),
        ("kv_budget 2.5", done, {**base, "kv_budget": 2.5}),
        ("struct_budget with snapkv", done, {**base, "method": "snapkv", "struct_budget": 0.2}),
        ("max_tokens 0", done, {**base, "max_tokens": 0}),
        ("max_tokens 400 digits", done, raw % (model, '"max_tokens": ' + BIG)),
        ("max_tokens past the limit", done, {**base, "max_tokens": 10**9}),
        ("temperature -1", done, {**base, "temperature": -1}),
        ("temperature 400 digits", done, raw % (model, '"temperature": ' + BIG)),
        ("top_p 400 digits", done, raw % (model, '"top_p": ' + BIG)),
        ("top_p 0", done, {**base, "top_p": 0}),
        ("top_k -3", done, {**base, "top_k": -3}),
        ("seed -1", done, {**base, "seed": -1}),
        ("seed 2**64", done, {**base, "seed": 2**64}),
        ("max_kv_tokens 3", done, {**base, "max_kv_tokens": 3}),
        ("nested 10000 deep", done, "[" * 10000 + "]" * 10000),
        ("lone surrogate", done, '{"model": "%s", "prompt": "\\ud800"}' % model),
        ("stream not a bool", done, {**base, "stream": "yes"}),
        ("1000 stop strings", done, {**base, "stop": ["x"] * 1000}),
        ("empty context", done, {**base, "context": "  "}),
        ("unknown path", "/v1/nothing", {}),
    ]


def bad_input(url: str, model: str, headers: dict) -> dict:
    """Every bad request once: the statuses; none may be 5xx."""
    statuses = {}
    for label, path, body in bad_requests(model):
        data = body if isinstance(body, str) else json.dumps(body)
        try:
            r = httpx.post(url + path, content=data, headers={"content-type": "application/json", **headers},
                           timeout=60)
            statuses[label] = r.status_code
        except httpx.HTTPError as e:
            statuses[label] = type(e).__name__
    return {"requests": len(statuses), "5xx": sorted(k for k, v in statuses.items() if not (
        isinstance(v, int) and v < 500)), "statuses": statuses}


def _complete(url, model, headers, prompt, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            **extra}  # greedy unless `extra` says otherwise (the API's default temperature is 1)
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)


ODD_SAMPLING = {"t1e-300": {"temperature": 1e-300}, "t1e-45": {"temperature": 1e-45}, "t2": {"temperature": 2.0},
                "p1e-30": {"temperature": 1.0, "top_p": 1e-30}}


def _together(url, model, headers, rows: dict) -> dict:
    """Send the requests `rows` (name -> sampling) at once; name -> (status, answer)."""
    out = {}

    def ask(name, extra):
        r = _complete(url, model, headers, "Three colours of the rainbow are", **extra)
        out[name] = (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200])

    threads = [threading.Thread(target=ask, args=item) for item in rows.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def isolation(url: str, model: str, headers: dict) -> dict:
    """A greedy request beside four greedy ones, then beside requests at temperatures 1e-300 /
    1e-45 / 2 and top_p 1e-30: nothing may fail and the greedy answer must be the same (a batch of
    the same size both times: a batch's size may change float rounding, its sampling must not)."""
    plain = _together(url, model, headers, {"greedy": {}, **{f"g{i}": {} for i in range(4)}})
    odd = _together(url, model, headers, {"greedy": {}, **ODD_SAMPLING})
    return {"failed": sorted(k for k, (s, _) in odd.items() if s != 200),
            "greedy_changed": odd["greedy"][1] != plain["greedy"][1],
            "greedy_answers_beside_greedy": sorted({a for _, a in plain.values()}),
            "greedy_answer_beside_odd": odd["greedy"][1]}


def archive_faults(url: str, model: str, headers: dict, folder: Path, facts: int = 200) -> dict:
    """A context compressed once (its archive written to `folder`), then its file truncated,
    overwritten and deleted under the server, asking the same question after each: every answer must
    be the first one (recomputed, never read from changed bytes) and none a 5xx."""
    context = " ".join(f"Fact {i}: the code of box {i} is {1000 + 7 * i}." for i in range(facts))  # 200: ~4K tokens

    def ask():
        body = {"model": model, "prompt": f"What is the code of box {facts // 2}?", "context": context, "max_tokens": 8,
                "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=600)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200])

    first = ask()
    files = sorted(folder.glob("*.safetensors"))
    results = {"first": first[0], "archive_files": len(files), "first_answer": first[1][:200]}
    for fault in ("truncated", "overwritten", "deleted"):
        for f in sorted(folder.glob("*.safetensors")):
            if fault == "truncated":
                with open(f, "r+b") as h:
                    h.truncate(f.stat().st_size // 2)
            elif fault == "overwritten":
                with open(f, "r+b") as h:
                    h.seek(f.stat().st_size - 4096)
                    h.write(b"\x7f" * 4096)
            else:
                f.unlink()
        got = ask()
        results[fault] = got[0]
        results[f"{fault}_same_answer"] = got == first
    results["wrong_answers"] = sum(not results[f"{k}_same_answer"] for k in ("truncated", "overwritten", "deleted"))
    results["wrong_answers"] += first[0] != 200 or not files  # no archive written: nothing was checked
    results["5xx"] = sum(results[k] >= 500 for k in ("first", "truncated", "overwritten", "deleted"))
    return results


def flood(url: str, seconds: float, sockets: int) -> dict:
    """One client (its own address) keeps `sockets` idle connections open, reopening each one the
    server closes, for `seconds`; /health is asked every 0.2 s by another client: the share
    answered within 1 s."""
    host, port = url.split("//")[1].split(":")
    stop, held = threading.Event(), []

    def connect():  # from another loopback address: one client, not the prober's own
        s = socket.socket()
        s.settimeout(1)
        s.bind((FLOOD_ADDRESS, 0))
        s.connect((host, int(port)))
        return s

    def attacker():
        while not stop.is_set():
            held[:] = [s for s in held if not _closed(s)]
            while len(held) < sockets and not stop.is_set():
                try:
                    held.append(connect())
                except OSError:
                    break
            time.sleep(0.01)

    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    time.sleep(1.0)
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            ok = httpx.get(url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        times.append(time.perf_counter() - t0 if ok else float("inf"))
        time.sleep(0.2)
    stop.set()
    t.join(5)
    for s in held:
        s.close()
    fast = sum(x <= 1.0 for x in times)
    return {"probes": len(times), "within_1s": fast, "share": fast / max(len(times), 1)}


def _closed(s) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def leavers(url: str, count: int) -> list[socket.socket]:
    """`count` clients that send a request head and half its body, then leave."""
    host, port = url.split("//")[1].split(":")
    for _ in range(count):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n" + b'{"model": "x", "messages": [')
        s.close()
    time.sleep(1.0)


def _serve(model: str, port: int, folder: Path, log: Path) -> subprocess.Popen:
    code = "import sys; from structkv.cli import main; sys.exit(main(sys.argv[1:]))"
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-c", code, "serve", "--model", model, "--port", str(port),
                                 "--no-auth", "--compile", "never", "--archive-dir", str(folder),
                                 "--max-connections", "16", "--threads", "2"], stdout=f, stderr=subprocess.STDOUT)


def table(r: dict) -> str:
    rows = [
        ("bad requests answered 5xx", "0", f"{len(r['bad']['5xx'])} of {r['bad']['requests']}"),
        ("sampling beside a greedy row: failures / greedy answer changed", "0 / no",
         f"{len(r['isolation']['failed'])} / {'yes' if r['isolation']['greedy_changed'] else 'no'}"),
        ("archive truncated, overwritten, deleted: wrong answers", "0", str(r["archive"]["wrong_answers"])),
        ("archive faults answered 5xx", "0", str(r["archive"]["5xx"])),
        ("/health within 1 s while one client floods", ">= 95 %",
         f"{100 * r['flood']['share']:.0f} % of {r['flood']['probes']}"),
        ("log growth per client leaving mid-body", "bounded (one line at most)",
         f"{r['leavers']['log_bytes_per_client']:.0f} bytes"),
        ("server process deaths", "0", str(r["deaths"])),
    ]
    return "\n".join(["| check | target | measured |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--flood-seconds", type=float, default=20.0)
    p.add_argument("--flood-sockets", type=int, default=100)
    p.add_argument("--leavers", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from serve_probe import free_port, wait_up  # its neighbour in benchmarks/ (the script's own folder)

    port, folder = free_port(), Path(tempfile.mkdtemp(prefix="structkv_faults_"))
    url, log = f"http://127.0.0.1:{port}", folder.parent / f"{folder.name}.log"
    proc = _serve(args.model, port, folder, log)
    try:
        wait_up(url, timeout=600, proc=proc)
        report = {"model": args.model, "bad": bad_input(url, args.model, {}),
                  "isolation": isolation(url, args.model, {}),
                  "archive": archive_faults(url, args.model, {}, folder),
                  "flood": flood(url, args.flood_seconds, args.flood_sockets)}
        before = log.stat().st_size
        leavers(url, args.leavers)
        grown = log.stat().st_size - before
        report["leavers"] = {"clients": args.leavers, "log_bytes_per_client": grown / args.leavers}
        report["deaths"] = int(proc.poll() is not None)
    finally:
        proc.terminate()
        proc.wait(60)
    out = table(report)
    print(out)
    print(json.dumps(report, indent=1))
    if args.out:
        command = f"python benchmarks/serve_faults.py {' '.join(sys.argv[1:])}"
        Path(args.out).write_text(f"`{command}`\n\n{out}\n\n```json\n{json.dumps(report, indent=1)}\n```\n")


if __name__ == "__main__":
    main()
