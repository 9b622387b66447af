"""Files: writes that leave a file whole or absent, and JSON reads that name what is wrong.

A write goes beside the final name, then is renamed into place: a crash (or a full disk) during
the write leaves the old file, or none, never half of one (os.replace is atomic within a folder).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tempfile
from pathlib import Path


def write_atomic(src, dest: Path, *, sha256: str | None = None, what: str = "") -> None:
    """Copy the readable binary file object `src` to `dest`; with `sha256`, keep the bytes only
    when their digest matches (else ValueError, and nothing is left behind)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(f"{what or dest.name} has sha256 {digest.hexdigest()}, expected {sha256}: the download "
                             "is corrupt or the source was replaced; nothing was kept")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(dest: Path, text: str) -> None:
    """`dest.write_text(text)` that a crash cannot leave half-written."""
    write_atomic(io.BytesIO(text.encode("utf-8")), dest)


def read_json(path: Path):
    """A JSON file, gzip-compressed when its name ends in .gz."""
    with (gzip.open(path, "rt") if Path(path).suffix == ".gz" else open(path)) as f:
        return json.load(f)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; a ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data
