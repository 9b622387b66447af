"""A method defined here, in the test, runs end to end: one small class and one registry line are
all a new method needs (generate, eval and bench find it by name)."""
import json
from dataclasses import dataclass

import pytest
import torch

import structkv
from structkv import methods
from structkv.cli import main
from structkv.methods import Method


@dataclass
class KeyNorm(Method):
    """Keep, per KV head, the keys with the smallest L2 norm (the idea of kvpress' KnormPress)."""

    kv_budget: float | int = 0.2
    window: int = 4
    name = "keynorm"
    compresses_kv = True

    def kv_scores(self, view):
        return -view.k.float().norm(dim=-1)  # (B, Hkv, n): small norm = keep


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "keynorm", methods.registry.Entry(KeyNorm))
    return "keynorm"


def test_new_method_through_generate(registered, tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    ids = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    out = structkv.generate(model, ids, method=registered, max_new_tokens=4, compile=False, stop_at_eos=False)
    assert out.stats["method"] == "keynorm" and len(out.token_ids) == 4
    state = structkv.prefill(model, ids, methods.get("keynorm", kv_budget=0.25), room=4)
    kv_heads = model.config.num_kv_heads
    assert state.stats.kv_entries_per_layer == [30 * kv_heads] * model.config.num_layers  # floor(0.25 * 120)
    layer = state.cache.layers[1]
    k_all = structkv.compress(model, torch.tensor([ids]), torch.arange(120)[None], methods.Full()).cache.layers[1]
    norms = k_all.k[0, 0, :120].norm(dim=-1)
    kept = layer.pos[0, 0][layer.pos[0, 0] >= 0]
    outside = kept[kept < 116]  # the window (last 4) is kept regardless
    assert set(outside.tolist()) == set(norms[:116].argsort()[:26].tolist())


def test_new_method_through_eval_and_bench(registered, byte_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), "--methods", "full,keynorm",
                 "--kv-budget", "0.3", "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "1", "--eager",
                 "--quiet"]) == 0
    labels = {json.loads(line)["label"] for line in (out / "predictions.jsonl").read_text().splitlines()}
    assert labels == {"full", "keynorm@0.3"}
    assert main(["bench", "--model", str(byte_model_dir), "--methods", "full,keynorm", "--lengths", "256",
                 "--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--no-hf", "--eager",
                 "--out", str(tmp_path / "bench")]) == 0
    rows = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"full", "keynorm"}
