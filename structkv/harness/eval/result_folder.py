"""The result folder, the project's product: `config.json` (settings, versions, commit, command),
`predictions.jsonl` (one line per method run on one sample, appended as soon as it finishes; a
rerun skips what is there, a torn last line is repaired, unreadable lines are redone),
`metrics.json`, `summary.md`. Read and written here for eval, fidelity, the leaderboard and the
tools; a folder made with other settings (`IDENTITY`) is refused, never mixed."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from ...util.files import write_text_atomic
from .. import environment
from .config import IDENTITY, EvalConfig


def sample_key(label: str, sample: dict) -> str:
    depth = f"/d{sample['depth']:g}" if "depth" in sample else ""
    return f"{label}/{sample['length_budget']}/{sample['task']}{depth}/{sample['index']}"


def read_predictions(path: Path, *, quiet: bool = False) -> dict[str, dict]:
    """Finished predictions by key. Lines that are not JSON objects with a "key" (a line cut by
    an interrupted write, a NUL-filled tail after a power loss, a hand edit) are skipped, so those
    samples are redone, and reported on stderr."""
    done, bad = {}, []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.strip("\x00"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                done[rec["key"]] = rec
            else:
                bad.append(number)
    if bad and not quiet:
        print(f"structkv: skipped {len(bad)} unreadable line(s) of {path} (line {', '.join(map(str, bad[:10]))}"
              f"{', ...' if len(bad) > 10 else ''}); their samples are run again", file=sys.stderr)
    return done


def repair_tail(path: Path) -> None:
    """Make the file end with a newline before appending: a last line without one is either a
    whole record (kept, newline added) or the cut end of an interrupted write (removed; its
    sample is redone). Without this the next record would be glued onto the broken line."""
    with path.open("rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            whole = isinstance(json.loads(data[start:].decode("utf-8")), dict)
        except (UnicodeDecodeError, json.JSONDecodeError):
            whole = False
        if whole:
            f.write(b"\n")
        else:
            f.truncate(start)
            print(f"structkv: removed an incomplete last line of {path} ({len(data) - start} bytes, an interrupted "
                  "write); its sample is run again", file=sys.stderr)


def stored_config(folder: Path) -> dict:
    """The settings a finished folder was made with (`config.json`'s "config")."""
    try:
        return json.loads((folder / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{folder} has no readable config.json: not a finished `structkv eval` folder") from None


def identity(config: dict) -> dict:
    """The identity settings of a stored config (a key older folders lack counts as its default)."""
    defaults = {f.name: f.default for f in fields(EvalConfig)}
    return {k: config.get(k, defaults.get(k)) for k in IDENTITY}


def check_settings(cfg: EvalConfig, out: Path) -> None:
    """Refuse a folder whose results were made with other settings (they would mean something else)."""
    conf_path = out / "config.json"
    if not conf_path.exists():
        return
    try:
        old = json.loads(conf_path.read_text())["config"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"{conf_path} is unreadable, so the settings of the results in {out} are unknown; "
                         "restore it or choose another --out folder") from None
    old = identity(old)
    clash = {k: (old[k], getattr(cfg, k)) for k in IDENTITY if old[k] != getattr(cfg, k)}
    if clash:
        raise ValueError(f"{out} holds results made with other settings {clash}; choose another --out folder")


def open_output(cfg: EvalConfig, out: Path, name: str = "predictions.jsonl") -> dict[str, dict]:
    """Create or reopen the folder; returns the finished records of file `name` by key."""
    check_settings(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    pred_path = out / name
    if pred_path.exists():
        repair_tail(pred_path)
    done = read_predictions(pred_path) if pred_path.exists() else {}
    write_text_atomic(out / "config.json", json.dumps({"config": asdict(cfg), "environment": environment(),
                                                       "command": " ".join(sys.argv)}, indent=2))
    return done
