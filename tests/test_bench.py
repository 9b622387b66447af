"""`structkv bench` end to end on tiny models: every field, honest prefill fractions, targets' inputs."""
import json

import pytest

import structkv
from structkv.cli import main
from structkv.harness import bench

FIELDS = {"method", "tokens", "prefill_s", "decode_tokens_per_s", "peak_bytes", "peak_total_bytes", "overhead_s",
          "overhead_share",
          "scoring_s", "selection_s", "prefill_fraction", "tokens_per_layer", "pivot_layer", "kv_bytes",
          "kv_bytes_full_layers", "kv_budget_bytes", "kv_vs_budget", "kv_cache_bytes_after_decode"}


def test_bench_cli_writes_json_markdown_and_plots(tiny_dir, tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["bench", "--model", str(tiny_dir("llama")), "--methods", "full,snapkv,structkv", "--lengths", "100,200",
            "--repeats", "2", "--warmup", "1", "--new-tokens", "4", "--eager", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"config", "environment", "device", "model", "rows", "ratios", "scaling"} <= set(result)
    rows = result["rows"]
    assert sorted({r["method"] for r in rows}) == ["full", "snapkv", "structkv", "transformers"]
    for r in rows:
        if r["method"] == "transformers":
            continue
        assert FIELDS <= set(r), FIELDS - set(r)
        for key in ("prefill_s", "decode_tokens_per_s", "peak_bytes"):
            assert set(r[key]) == {"median", "min", "max"} and r[key]["min"] <= r[key]["median"] <= r[key]["max"]
        if r["method"] != "full":  # the compressed cache holds floor(0.1 n) entries, window included
            assert r["kv_vs_budget"] == pytest.approx(1.0, abs=1e-9)
    ratios = {(q["tokens"], q["method"]): q for q in result["ratios"]}
    assert "prefill_speedup_vs_full" in ratios[(200, "structkv")]
    assert "prefill_speedup_vs_transformers" in ratios[(200, "full")]
    assert set(result["scaling"]) >= {"full", "snapkv", "structkv"}
    assert (out / "bench.md").exists() and (out / "latency_vs_length.png").exists()
    assert "| 200 | structkv |" in capsys.readouterr().out


def test_reported_prefill_fraction_matches_the_tokens_layers_processed(tiny_dir):
    """Count the tokens entering each layer's MLP with hooks and compare with what bench reports."""
    model = structkv.load(tiny_dir("qwen3"))
    seen = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: seen.append((i, args[0].shape[1])))
    cfg = bench.BenchConfig(model="tiny", methods=["structkv", "fastkv", "full"], lengths=[200], repeats=1, warmup=0,
                            new_tokens=3, hf=False, compile=False, pivot=0.4)
    result = bench.run(cfg, model=model, progress=False)
    L = model.config.num_layers
    calls = [n for _, n in seen if n > 1]  # prefill calls (decode steps see one token)
    assert len(calls) == 3 * L
    for k, row in enumerate(result["rows"]):
        per_layer = calls[k * L:(k + 1) * L]
        assert row["tokens_per_layer"] == per_layer
        assert row["prefill_fraction"] == pytest.approx(sum(per_layer) / (L * 200))
    assert result["rows"][0]["prefill_fraction"] < 1.0 and result["rows"][2]["prefill_fraction"] == 1.0


def test_random_shape_models_and_bad_input():
    with pytest.raises(ValueError, match="unknown model shape"):
        structkv.load("random:gpt-5")
    with pytest.raises(ValueError, match="unknown method"):
        bench.run(bench.BenchConfig(methods=["nope"]))
    from structkv.models.shapes import SHAPES

    cfg = SHAPES["qwen2.5-0.5b"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (896, 24, 2)


def test_pareto_plot_from_an_eval_folder(byte_model_dir, tmp_path):
    pytest.importorskip("wonderwords")
    ev = tmp_path / "ev"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(ev), "--methods", "full,structkv",
                 "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1", "--eager", "--quiet"]) == 0
    out = tmp_path / "b"
    assert main(["bench", "--model", str(byte_model_dir), "--methods", "full,structkv", "--lengths", "512",
                 "--repeats", "1", "--warmup", "0", "--new-tokens", "3", "--no-hf", "--eager", "--eval", str(ev),
                 "--out", str(out)]) == 0
    assert (out / "pareto.png").stat().st_size > 1000
