"""benchmarks/paired_ruler.py and common_subset.py on hand-made result folders: the paired difference
is the difference of task-averaged scores, the common-subset table averages only the prompts every
run has, runs in two folders pair by exact labels, and folders made with other settings are refused
rather than paired."""
import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def paired_ruler():
    return script("paired_ruler")


@pytest.fixture(scope="module")
def common_subset():
    return script("common_subset")


def folder(path: Path, scores: dict[str, dict[tuple[str, int], float]], **config) -> Path:
    """A result folder: label -> {(task, sample): score}, every prompt at 4096 tokens."""
    path.mkdir()
    lines = [json.dumps({"key": f"{label}|{task}|{i}", "label": label, "length_budget": 4096, "task": task,
                         "index": i, "score": s, "prefill_fraction": 1.0})
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


def test_one_prompt_per_task_resamples_across_tasks(paired_ruler, tmp_path, capsys):
    """One prompt per task (a LongBench --samples 1 folder): resampling within tasks has nothing to
    draw from, so the prompts are resampled across tasks and the interval has a width."""
    base = {(t, 0): 0.0 for t in "abcdefgh"}
    mine = base | {("a", 0): 1.0, ("b", 0): 1.0}
    f = folder(tmp_path / "f", {"structkv@0.1": mine, "snapkv@0.1": base})
    rc, out, _ = run(paired_ruler, capsys, f, "--against", "snapkv")
    row = next(line.split(" | ") for line in out.splitlines() if "structkv@" in line)
    diff, interval = row[2].split(" ", 1)
    lo, hi = (float(x) for x in interval.strip("[]").split(", "))
    assert diff == "+25.0" and lo < 25.0 < hi and lo >= 0


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


def test_the_same_prompts_stored_two_ways_pair(paired_ruler, tmp_path, capsys):
    """Folders that differ only in how the model is stored (kv_dtype, weights) pair: that
    difference is what is measured, and the output says so; any other setting still refuses."""
    prompts = [("a", i) for i in range(4)]
    q = folder(tmp_path / "q", {"structkv@0.1": {p: 1.0 for p in prompts}}, kv_dtype="int8")
    f = folder(tmp_path / "f", {"structkv@0.1": {p: float(p[1] > 1) for p in prompts}})
    rc, out, _ = run(paired_ruler, capsys, q, "--method", "structkv@0.1", "--against", "structkv@0.1",
                     "--against-folder", f)
    assert rc == 0 and "comparing storage: {'kv_dtype': ('int8', None)}" in out
    assert "| +50.0 [" in out
    c = folder(tmp_path / "c", {"structkv@0.1": {p: 1.0 for p in prompts}}, kv_dtype="int8", chat=True)
    rc, _, err = run(paired_ruler, capsys, c, "--method", "structkv@0.1", "--against", "structkv@0.1",
                     "--against-folder", f)
    assert rc == 2 and "'chat'" in err and "kv_dtype" not in err


def test_nothing_to_compare_names_the_runs(paired_ruler, tmp_path, capsys):
    f = folder(tmp_path / "f", {"snapkv@0.1": {("a", 0): 1.0}})
    rc, _, err = run(paired_ruler, capsys, f, "--against", "fastkv")
    assert rc == 2 and "snapkv@0.1" in err


def test_common_subset_over_two_folders(common_subset, tmp_path, capsys):
    eq = folder(tmp_path / "eq", {"structkv@0.16": {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 0.0}})
    main = folder(tmp_path / "main", {"snapkv@0.1": {("a", 0): 0.0, ("a", 1): 1.0, ("b", 0): 1.0, ("b", 1): 1.0},
                                      "full": {("a", 0): 1.0}})
    assert common_subset.main([str(eq), str(main), "--labels", "structkv@0.16,snapkv@0.1"]) == 0
    out = capsys.readouterr().out
    assert "Over the 3 prompts every one of 2 runs has." in out  # (b, 1) is not in structkv@0.16
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines() if "@" in line}
    # columns: method, length, a, b, avg, ...: a and b are task means, avg their mean
    assert rows["| structkv@0.16"][2:5] == ["100.0", "0.0", "50.0"]
    assert rows["| snapkv@0.1"][2:5] == ["50.0", "100.0", "75.0"]


def test_common_subset_refuses_what_does_not_pair(common_subset, tmp_path, capsys):
    a = folder(tmp_path / "a", {"snapkv@0.1": {("a", 0): 1.0}}, chat=True)
    b = folder(tmp_path / "b", {"snapkv@0.1": {("a", 0): 0.0}}, chat=True)
    c = folder(tmp_path / "c", {"fastkv@0.1": {("a", 0): 0.0}}, chat=False)
    assert common_subset.main([str(a), str(b)]) == 2
    assert "snapkv@0.1" in capsys.readouterr().err  # the same run in two folders: which one?
    assert common_subset.main([str(a), str(c)]) == 2
    assert "other settings" in capsys.readouterr().err
    assert common_subset.main([str(a), "--labels", "snapkv@0.2"]) == 2
    assert "no run ['snapkv@0.2']" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert common_subset.main([str(a), str(tmp_path / "empty")]) == 2
    assert "no readable config.json" in capsys.readouterr().err
    (a / "predictions.jsonl").unlink()
    assert common_subset.main([str(a)]) == 2
    assert "holds no predictions.jsonl" in capsys.readouterr().err


def test_kept_bytes_planned_against_measured(tiny_dir, tmp_path, capsys):
    """kept_bytes.py recomputes a SnapKV record's kept bytes from its prompt length and flags a
    measured value that disagrees; a propagating method has no planned value."""
    import structkv

    kept_bytes = script("kept_bytes")
    model = structkv.load(str(tiny_dir("llama")))
    cfg, n = model.config, 300
    entries = sum(kept_bytes.planned_kv_entries(structkv.methods.get("snapkv", kv_budget=0.1), cfg, n))
    good = entries * 2 * cfg.head_dim * model.dtype.itemsize
    f = folder(tmp_path / "f", {}, model=str(tiny_dir("llama")))
    lines = [{"key": f"snapkv@0.1|{i}", "label": "snapkv@0.1", "method": "snapkv", "kv_budget": 0.1, "task": "a",
              "index": i, "length_budget": 512, "prompt_tokens": n, "kv_bytes_kept": kept}
             for i, kept in enumerate([good, good + 1])]
    lines.append({"key": "structkv@0.1|0", "label": "structkv@0.1", "method": "structkv", "kv_budget": 0.1,
                  "struct_budget": 0.2, "task": "a", "index": 0, "length_budget": 512, "prompt_tokens": n,
                  "kv_bytes_kept": 1024 * 1024})
    (f / "predictions.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert kept_bytes.main([str(f)]) == 0
    rows = {r.split(" | ")[0]: r.split(" | ") for r in capsys.readouterr().out.splitlines()[2:]}
    assert rows["| snapkv@0.1"][1:] == ["2", f"{(good + 0.5) / 2**20:.2f}", f"{good / 2**20:.2f}", "1 of 2 |"]
    assert rows["| structkv@0.1"][1:] == ["1", "1.00", "-", "- |"]
    (f / "config.json").unlink()  # named, not a traceback, before any model is loaded
    assert kept_bytes.main([str(f)]) == 2
    assert "no readable config.json" in capsys.readouterr().err


def test_dev_sweep_ruler_accuracy_is_an_eval_folder(byte_model_dir, tmp_path, paired_ruler, capsys):
    """structkv_dev.py --metric ruler writes an eval folder of its configurations (labels described
    in configurations.json) that paired_ruler.py reads; an unknown --only label is named."""
    dev = script("structkv_dev")
    out = tmp_path / "dev"
    args = ["--metric", "ruler", "--model", str(byte_model_dir), "--lengths", "1536", "--samples", "2",
            "--tasks", "niah_single_1", "--kv-budget", "0.2", "--eager", "--out", str(out)]
    assert dev.main([*args, "--only", "full,fastkv,fixed15/32+pivotskel+guideS3"]) == 0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted({r["label"] for r in records}) == ["fastkv@0.2", "fixed15/32+pivotskel+guideS3@0.2", "full"]
    assert len(records) == 3 * 2 and all(0 <= r["score"] <= 1 for r in records)
    described = json.loads((out / "configurations.json").read_text())
    assert "beta=3.0" in described["fixed15/32+pivotskel+guideS3@0.2"] and "StructKV(" in described[
        "fixed15/32+pivotskel+guideS3@0.2"]
    assert "| fixed15/32+pivotskel+guideS3 | 0.2 | 1536 |" in (out / "summary.md").read_text()
    capsys.readouterr()
    assert paired_ruler.main([str(out), "--method", "fixed15/32+pivotskel+guideS3", "--against", "fastkv"]) == 0
    assert "fastkv@0.2" in capsys.readouterr().out
    assert dev.main([*args, "--only", "full,fastkv"]) == 0  # a later sweep of fewer labels keeps the others' rows
    assert "| fixed15/32+pivotskel+guideS3 | 0.2 | 1536 |" in (out / "summary.md").read_text()
    assert '"fixed15/32+pivotskel+guideS3@0.2"' in (out / "metrics.json").read_text()
    with pytest.raises(SystemExit):
        dev.main([*args, "--only", "nonesuch"])
    assert "no configuration ['nonesuch']" in capsys.readouterr().err


def test_llama_cpp_side_by_side_alternates_and_reports_ratios(tmp_path, tiny_dir, monkeypatch):
    """The side-by-side script against a stand-in `llama-bench` (prints its JSON): one llama.cpp row
    per length, one structkv row per (weights, method), ratios of the same run in the table."""
    side = script("llama_cpp_side_by_side")
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *'-n 0'*) echo '[{\"avg_ts\": 100.0, \"build_commit\": \"x\"}]';;\n"
                    "*) echo '[{\"avg_ts\": 20.0}]';; esac\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(side, "gguf_path", lambda model: str(gguf))
    out = tmp_path / "out"
    assert side.main(["--llama-bench", str(fake), "--model", str(tiny_dir("llama")), "--lengths", "32,64",
                      "--weights", "fp32,int8", "--methods", "full,snapkv", "--repeats", "1", "--new-tokens", "4",
                      "--kv-budget", "0.5", "--threads", "1", "--eager", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["side"] for r in rows].count("llama.cpp") == 2
    ours = [r for r in rows if r["side"] == "structkv"]
    assert {(r["tokens"], r["weights"], r["method"]) for r in ours} == {
        (n, w, m) for n in (32, 64) for w in ("fp32", "int8") for m in ("full", "snapkv")}
    llama = next(r for r in rows if r["side"] == "llama.cpp" and r["tokens"] == 64)
    assert llama["prefill_s"] == pytest.approx(64 / 100.0) and llama["decode_tokens_per_s"] == 20.0
    text = (out / "table.md").read_text()
    first = next(r for r in ours if r["tokens"] == 64)
    assert f"{llama['prefill_s'] / first['prefill_s']:.2f}x" in text
    assert (out / "speed.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--llama-bench"):
        side.main(["--out", str(tmp_path / "x"), "--llama-bench", str(tmp_path / "missing")])
