"""The harness: accuracy evaluation (`structkv.harness.eval`, CLI `structkv eval`) and speed and
memory benchmarks (`structkv.harness.bench`, CLI `structkv bench`), apart from the library they
measure (nothing in the library imports them). This module holds what both share: the
environment record of a result, medians and means that skip missing values, the plotting setup.
"""
from __future__ import annotations

import math
import platform
import subprocess
from pathlib import Path


def environment() -> dict:
    """Versions and the git commit, stored with every result."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "threads": torch.get_num_threads()}
    for pkg in ("structkv", "transformers", "tokenizers", "wonderwords"):
        try:
            from importlib.metadata import version
            info[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - optional packages
            info[pkg] = None
    repo = Path(__file__).resolve().parents[2]  # the checkout, when installed from one
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
        info["git_commit"] = commit.stdout.strip() or None
        info["git_dirty"] = bool(dirty.stdout.strip()) if commit.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = info["git_dirty"] = None
    return info


def mean(values):
    """Mean of the values that are numbers (None and NaN skipped), or None."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def median(values):
    """Median of the values that are numbers (None and NaN skipped), or None."""
    values = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
