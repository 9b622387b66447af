"""A wheel built from the repository works as well as the clone: every native kernel source is in
it, and the kernels load from the installed copy (outside an editable install a missing source
used to fall back to the slow reference paths without a word)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "structkv" / "ops" / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the tracked package (the build writes nothing into the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT / "structkv", src / "structkv", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"pip wheel failed: {done.stderr[-2000:]}")
    (built,) = (tmp / "dist").glob("structkv-*.whl")
    return built


def test_the_wheel_holds_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".c", ".cpp", ".h"))
    assert sources, "no kernel sources found in the checkout"
    missing = [s for s in sources if f"structkv/ops/csrc/{s}" not in names]
    assert not missing, f"the wheel lacks {missing}"


def test_the_native_kernels_load_from_the_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = ("import structkv, structkv.ops.cpu_decode as d, structkv.ops.tiled_linear as t; "
             "print(structkv.__file__); print(d.available(), d.unavailable_reason()); "
             "print(t.loaded(), t.unavailable_reason())")
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(Path.home())}
    env.update({k: os.environ[k] for k in ("STRUCTKV_CACHE", "CXX", "CC") if k in os.environ})
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    where, decode, tiled = out.stdout.strip().splitlines()[-3:]
    assert where.startswith(str(target)), f"imported {where}, not the installed wheel"
    assert decode.startswith("True"), f"the decode attention kernel did not load from the wheel: {decode}"
    assert tiled.startswith("True"), f"the tiled kernels did not load from the wheel: {tiled}"
