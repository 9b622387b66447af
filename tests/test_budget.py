"""One budget at every door: `Budget` parses "0.1" as a ratio and "512" as a token count once, and
`methods.build` makes every method from it for the library, the command line, eval and bench
(the server: tests/test_serve.py)."""
import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.cli import main
from structkv.harness import bench
from structkv.methods import Budget


@given(ratio=st.floats(1e-6, 1.0), lengths=st.lists(st.integers(1, 10_000), min_size=1, max_size=4))
def test_a_ratio_keeps_its_floor_share_and_at_least_one_token(ratio, lengths):
    kept = Budget.parse(repr(ratio)).tokens(torch.tensor(lengths))
    assert kept == [min(n, max(1, int(n * ratio))) for n in lengths]
    assert all(1 <= k <= n for k, n in zip(kept, lengths))


@given(count=st.integers(1, 100_000), lengths=st.lists(st.integers(1, 10_000), min_size=1, max_size=4))
def test_a_count_keeps_that_many_tokens_or_the_whole_row(count, lengths):
    budget = Budget.parse(str(count))
    assert budget.value == count and not budget.is_ratio and str(budget) == str(count)
    assert budget.tokens(lengths) == [min(count, n) for n in lengths]


@given(value=st.one_of(st.floats(1e-6, 1.0), st.integers(1, 10**6)))
def test_a_budget_prints_as_it_parses_back(value):
    """Labels (eval's "+recall1.0") are read back as budgets: a ratio of 1.0 must not become one token."""
    assert Budget.parse(str(Budget(value))).value == value
    assert type(Budget.parse(str(Budget(value))).value) is type(value)


@pytest.mark.parametrize("text, value", [("0.1", 0.1), (" 0.25 ", 0.25), ("1.0", 1.0), ("1", 1), ("512", 512),
                                         (0.2, 0.2), (64, 64), (Budget(0.5), 0.5)])
def test_parse_tells_ratios_from_counts_by_spelling(text, value):
    parsed = Budget.parse(text)
    assert parsed.value == value and type(parsed.value) is type(value)


@pytest.mark.parametrize("bad, message", [
    ("512.0", "write it as an integer (512)"), (1.5, "ratio must be in (0, 1]"), ("0", "positive token count"),
    ("-3", "positive token count"), ("nan", "ratio must be in (0, 1]"), ("inf", "ratio must be in (0, 1]"),
    ("ten", "not a number"), (True, "must be a ratio"), (None, "must be a ratio"), (0.0, "ratio must be in (0, 1]"),
])
def test_bad_budgets_name_the_problem_and_the_fix(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Budget.parse(bad, "kv_budget")


def test_build_is_the_one_door_for_every_method():
    for name in methods.names():
        made = methods.build(name, kv="0.2", struct="0.3")
        if name == "full":
            assert made == methods.get("full")
            continue
        assert made.kv_budget == 0.2 and made.name == name
        if methods.has_struct_budget(name):
            assert made.struct_budget == 0.3
    counted = methods.build("structkv", kv="512", struct="1024")
    assert (counted.kv_budget, counted.struct_budget) == (512, 1024)
    assert methods.build("snapkv", kv=64, struct=0.5) == methods.get("snapkv", kv_budget=64)  # no struct budget
    assert methods.build("structkv_coupled", kv=0.3).struct_budget == 0.3


@pytest.mark.parametrize("old", ["r_struct", "tsp_rate"])
def test_old_names_of_the_structural_budget_are_refused_with_the_new_one(old):
    with pytest.raises(ValueError, match=f"'{old}' is now called 'struct_budget'"):
        methods.get("structkv", **{old: 0.2})


def test_command_line_doors_take_token_counts(byte_model_dir, tmp_path, capsys, monkeypatch):
    """generate (--kv-budget 512 as documented), eval and bench all take a count."""
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    model = structkv.load(byte_model_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    assert main(["generate", "--model", str(byte_model_dir), "--max-new-tokens", "6", "--method", "structkv",
                 "--kv-budget", "40", "--struct-budget", "100", prompt]) == 0
    out = capsys.readouterr().out
    want = structkv.generate(model, prompt, max_new_tokens=6, compile=False,
                             method=methods.get("structkv", kv_budget=40, struct_budget=100))
    assert out == want.text + "\n"
    assert main(["generate", "--model", str(byte_model_dir), "--method", "snapkv", "--kv-budget", "512.0", "x"]) == 2
    assert "write it as an integer (512)" in capsys.readouterr().err
    out_dir = tmp_path / "eval"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out_dir), "--methods", "snapkv",
                 "--kv-budget", "64,0.2", "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1",
                 "--max-new-tokens", "4", "--eager", "--quiet"]) == 0
    labels = {json.loads(line)["label"] for line in (out_dir / "predictions.jsonl").read_text().splitlines()}
    assert labels == {"snapkv@64", "snapkv@0.2"}
    cfg = bench.BenchConfig(model=str(byte_model_dir), methods=["snapkv"], lengths=[256], kv_budget="64",
                            struct_budget="128")
    assert (cfg.kv_budget, cfg.struct_budget) == (64, 128)
    assert bench.make_method(cfg, "fastkv") == methods.get("fastkv", kv_budget=64, struct_budget=128)


def test_renamed_option_is_refused_with_its_new_name(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--r-struct", "0.2", "x"])
    assert "--r-struct is now --struct-budget" in capsys.readouterr().err
