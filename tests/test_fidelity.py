"""`structkv eval fidelity`: KL to the full cache, top-1 agreement and gold NLL, resumable, with
bootstrap intervals and paired differences."""
import json
import random

import pytest

from structkv import methods
from structkv.cli import main
from structkv.harness.eval import fidelity

pytest.importorskip("wonderwords", reason="RULER word lists: pip install 'structkv[eval]'")


def test_fidelity_run_resume_and_identity(byte_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "fid"
    argv = ["eval", "fidelity", "--model", str(byte_model_dir), "--out", str(out), "--methods",
            "full,snapkv,fastkv,structkv", "--kv-budget", "0.2,1.0", "--struct-budget", "1.0", "--lengths", "1024",
            "--tasks", "niah_single_1", "--samples", "2", "--continuation", "8", "--eager", "--quiet"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 2  # (3 methods x 2 budgets) x 2 prompts; full is the reference
    for r in records:
        assert r["kl"] >= -1e-6 and 0 <= r["top1"] <= 1 and r["gold_nll"] > 0
        if r["kv_budget"] == 1.0:  # nothing dropped: the full cache's own distributions
            assert r["kl"] == pytest.approx(0, abs=1e-5) and r["top1"] == 1.0
            assert r["gold_nll"] == pytest.approx(r["full_gold_nll"], abs=1e-4)
    summary = (out / "summary.md").read_text()
    assert "KL(full||m) [95% CI]" in summary and "KL - fastkv" in summary and (out / "fidelity.png").exists()
    assert json.loads((out / "config.json").read_text())["config"]["continuation"] == 8
    calls = []
    real = fidelity.measure
    monkeypatch.setattr(fidelity, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(argv) == 0 and not calls  # resumed: nothing recomputed
    assert main([*argv[:-4], "--continuation", "9", "--eager", "--quiet"]) == 2  # other settings refused


def test_measure_orders_methods_by_what_they_drop(byte_model_dir):
    """A method keeping more of the cache is closer to the full one (on average over prompts)."""
    import structkv
    from structkv.harness.eval.runner import EvalConfig, build_samples

    model = structkv.load(byte_model_dir)
    cfg = EvalConfig(benchmark="fidelity", tasks=["niah_single_1"], samples=2, lengths=[768])
    kl = {0.05: 0.0, 0.5: 0.0}
    for sample in build_samples(cfg, model.tokenizer):
        found = fidelity.measure(model, sample["input_ids"], [methods.SnapKV(kv_budget=b) for b in kl], 8,
                                 fidelity.answer_ids(model.tokenizer, sample))
        for b, f in zip(kl, found):
            kl[b] += f["kl"]
    assert kl[0.5] < kl[0.05]


def test_question_after_compression_scores_only_after_the_question(byte_model_dir):
    """Query-agnostic fidelity: the full cache's row is the same prompt either way (its gold NLL
    equals the query-aware run's), budget 1 is the full cache, and a small budget moves away."""
    import structkv
    from structkv.harness.eval.runner import EvalConfig, build_samples

    model = structkv.load(byte_model_dir)
    after = EvalConfig(benchmark="fidelity", tasks=["niah_single_1"], samples=1, lengths=[768], question_after=True)
    inside = EvalConfig(benchmark="fidelity", tasks=["niah_single_1"], samples=1, lengths=[768])
    (a,), (b,) = build_samples(after, model.tokenizer), build_samples(inside, model.tokenizer)
    assert a["input_ids"] + a["question_ids"] == b["input_ids"]
    gold = fidelity.answer_ids(model.tokenizer, a)
    got = fidelity.measure(model, a["input_ids"], [methods.SnapKV(kv_budget=1.0), methods.SnapKV(kv_budget=0.05)], 8,
                           gold, question=a["question_ids"])
    ref = fidelity.measure(model, b["input_ids"], [methods.SnapKV(kv_budget=1.0)], 8, gold)
    assert got[0]["full_gold_nll"] == pytest.approx(ref[0]["full_gold_nll"], abs=1e-4)
    assert got[0]["kl"] == pytest.approx(0, abs=1e-5) and got[0]["top1"] == 1.0
    assert got[1]["kl"] > 1e-4


def test_paired_bootstrap():
    rng = random.Random(0)
    recs = []
    for i in range(30):
        base = rng.random()
        for label, method, delta in (("fastkv@0.1", "fastkv", 0.0), ("structkv@0.1", "structkv", -0.1)):
            recs.append({"label": label, "method": method, "kv_budget": 0.1, "length_budget": 2048, "task": "t",
                         "index": i, "kl": base + delta, "top1": 1.0, "gold_nll": 1.0, "full_gold_nll": 1.0,
                         "prefill_fraction": 0.6, "kv_bytes_kept": 1})
    rows = {r["label"]: r for r in fidelity.aggregate(recs)["rows"]}
    paired = rows["structkv@0.1"]["paired"]["fastkv"]
    assert paired["kl_diff"] == pytest.approx(-0.1) and paired["ci"][1] < 0 and paired["wins"] == 30
    lo, hi = rows["fastkv@0.1"]["kl_ci"]
    assert lo < rows["fastkv@0.1"]["kl"] < hi


def test_fidelity_on_longbench_records(byte_model_dir, tmp_path):
    """LongBench tasks named in --tasks are measured on their (middle-truncated) records."""
    out = tmp_path / "lb"
    argv = ["eval", "fidelity", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full,snapkv",
            "--kv-budget", "0.3", "--lengths", "900", "--tasks", "trec,niah_single_1", "--samples", "1",
            "--continuation", "4", "--eager", "--quiet"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in records) == ["niah_single_1", "trec"]
    assert all(r["prompt_tokens"] <= 900 and r["kl"] >= -1e-6 for r in records)
