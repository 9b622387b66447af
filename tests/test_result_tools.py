"""benchmarks/paired_ruler.py on hand-made result folders: the paired difference is the difference of
task-averaged scores, runs in two folders pair by exact labels, and folders made with other settings
are refused rather than paired."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_ruler.py"


@pytest.fixture(scope="module")
def paired_ruler():
    spec = importlib.util.spec_from_file_location("paired_ruler", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def folder(path: Path, scores: dict[str, dict[tuple[str, int], float]], **config) -> Path:
    """A result folder: label -> {(task, sample): score}, every prompt at 4096 tokens."""
    path.mkdir()
    lines = [json.dumps({"key": f"{label}|{task}|{i}", "label": label, "length_budget": 4096, "task": task,
                         "index": i, "score": s})
             for label, by in scores.items() for (task, i), s in by.items()]
    (path / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    (path / "config.json").write_text(json.dumps({"config": {"benchmark": "ruler", "model": "m", **config}}))
    return path


def run(paired_ruler, capsys, *argv) -> tuple[int, str, str]:
    rc = paired_ruler.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_difference_is_of_task_averages(paired_ruler, tmp_path, capsys):
    # task a: 4 prompts, the method wins one (+25 on a); task b: 2 prompts, equal -> (25 + 0) / 2
    base = {("a", i): 0.0 for i in range(4)} | {("b", i): 1.0 for i in range(2)}
    mine = base | {("a", 0): 1.0}
    f = folder(tmp_path / "f", {"structkv@0.1": mine, "fastkv@0.1": base, "fastkv@0.2": base})
    rc, out, _ = run(paired_ruler, capsys, f, "--against", "fastkv")
    assert rc == 0
    rows = [line.split(" | ") for line in out.splitlines() if "structkv@" in line]
    assert [(r[1], r[-1]) for r in rows] == [("structkv@0.1 - fastkv@0.1", "6 |")]  # no structkv@0.2 to pair
    diff, interval = rows[0][2].split(" ", 1)
    lo, hi = (float(x) for x in interval.strip("[]").split(", "))
    # resampling task a's 4 prompts gives 0-4 wins: the interval lies in [0, 50] and holds the estimate
    assert diff == "+12.5" and 0 <= lo <= 12.5 <= hi <= 50


def test_identical_runs_differ_by_exactly_zero(paired_ruler, tmp_path, capsys):
    by = {("a", i): float(i % 2) for i in range(10)}
    f = folder(tmp_path / "f", {"structkv@0.2": by, "snapkv@0.2": by})
    rc, out, _ = run(paired_ruler, capsys, f, "--against", "snapkv")
    assert rc == 0 and "| +0.0 [+0.0, +0.0] | 10 |" in out


def test_exact_labels_across_folders(paired_ruler, tmp_path, capsys):
    prompts = [("a", i) for i in range(5)]
    eq = folder(tmp_path / "eq", {"structkv@0.16": {p: 1.0 for p in prompts}})
    main = folder(tmp_path / "main", {"pyramidkv@0.1": {p: 0.0 for p in prompts[:4]}, "snapkv@0.1": {}})
    rc, out, _ = run(paired_ruler, capsys, eq, "--method", "structkv@0.16", "--against", "pyramidkv@0.1,h2o@0.1",
                     "--against-folder", main)
    assert rc == 0
    assert out.splitlines()[2:] == ["| 0.16 | structkv@0.16 - pyramidkv@0.1 | +100.0 [+100.0, +100.0] | 4 |"]


def test_folders_with_other_settings_are_refused(paired_ruler, tmp_path, capsys):
    a = folder(tmp_path / "a", {"structkv@0.16": {("a", 0): 1.0}}, chat=True)
    b = folder(tmp_path / "b", {"snapkv@0.1": {("a", 0): 1.0}}, chat=False)
    rc, out, err = run(paired_ruler, capsys, a, "--method", "structkv@0.16", "--against", "snapkv@0.1",
                       "--against-folder", b)
    assert rc == 2 and out == ""
    assert "other settings" in err and "'chat': (True, False)" in err


def test_nothing_to_compare_names_the_runs(paired_ruler, tmp_path, capsys):
    f = folder(tmp_path / "f", {"snapkv@0.1": {("a", 0): 1.0}})
    rc, _, err = run(paired_ruler, capsys, f, "--against", "fastkv")
    assert rc == 2 and "snapkv@0.1" in err
