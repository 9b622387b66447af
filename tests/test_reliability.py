"""Regression tests for the reliability issue: resume keeps every record, bad input is one clear
error at the boundary, nothing generates silent garbage. Each test failed before its fix."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_tiny_gemma_gguf

import structkv
from structkv import methods
from structkv.cli import main
from structkv.harness.eval import runner
from structkv.util.files import write_text_atomic

pytest.importorskip("wonderwords", reason="RULER word lists: pip install 'structkv[eval]'")
ARGS = ["--methods", "full,snapkv", "--kv-budget", "0.3", "--lengths", "1024", "--tasks", "niah_single_1",
        "--samples", "3", "--eager", "--quiet"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return structkv.load(tiny_dir("llama"))


@pytest.fixture(scope="module")
def finished(byte_model_dir, tmp_path_factory):
    """A finished eval folder (6 predictions) to damage in each test."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS]) == 0
    return out


def _copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# ------------------------------------------------------------------ 1. resume loses nothing


@pytest.mark.parametrize("damage", ["cut", "nul_tail", "hand_cut_whole_line_kept"])
def test_resume_after_a_broken_last_line_keeps_every_record(finished, byte_model_dir, tmp_path, capsys, damage):
    out = _copy(finished, tmp_path)
    path = out / "predictions.jsonl"
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    if damage == "cut":  # disk full: a partial last line
        path.write_text("".join(lines[:-1]) + lines[-1][:466 % len(lines[-1])])
    elif damage == "nul_tail":  # power loss: the last record never reached the disk, NULs did
        path.write_bytes("".join(lines[:-1]).encode() + b"\x00" * 300)
    else:  # a whole record without its newline
        path.write_text(text.rstrip("\n"))
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS]) == 0
    records = _lines(path)  # every line parses
    expected = {r["key"] for r in _lines(finished / "predictions.jsonl")}
    assert len(records) == 6 and {r["key"] for r in records} == expected
    if damage != "hand_cut_whole_line_kept":
        assert "incomplete last line" in capsys.readouterr().err


def test_unreadable_middle_lines_are_skipped_and_reported(finished, byte_model_dir, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    path = out / "predictions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "[1, 2]", "not json", '{"no_key": 1}', *lines[2:]]) + "\n")
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS]) == 0
    assert "skipped 3 unreadable line(s)" in capsys.readouterr().err
    assert {r["key"] for r in _lines_ok(path)} == {r["key"] for r in _lines(finished / "predictions.jsonl")}


def _lines_ok(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "key" in rec:
            out.append(rec)
    return out


def test_result_files_are_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    target.write_text("old")

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_text_atomic(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


# ------------------------------------------------------------------ 2. --report checks settings


def test_report_refuses_other_settings_and_can_write_nothing(finished, byte_model_dir, tmp_path, capsys, monkeypatch):
    out = _copy(finished, tmp_path)
    summary = (out / "summary.md").read_text()
    base = ["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS, "--report"]
    assert main([*base, "--struct-budget", "0.5"]) == 2
    assert "other settings" in capsys.readouterr().err and (out / "summary.md").read_text() == summary
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == out else real_access(p, mode, **k))
    assert main(base) == 2  # a read-only folder (root ignores chmod, so os.access says it)
    assert "add --no-write" in capsys.readouterr().err
    assert main([*base, "--no-write"]) == 0
    assert "| snapkv | 0.3 |" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


# ------------------------------------------------------------------ 3. compress once, ask many


def test_state_path_checks_positions_and_model(llama, tiny_dir):
    limit = llama.config.max_position_embeddings  # 256
    context = torch.randint(3, 96, (limit - 12,)).tolist()
    state = structkv.prefill(llama, context, methods.get("snapkv", kv_budget=0.5), room=64)
    ok = structkv.generate(llama, [5, 6, 7, 8, 9], state=state, max_new_tokens=8, compile=False, stop_at_eos=False)
    assert len(ok.token_ids) == 8  # 244 + 5 + 8 - 1 = 256 positions: fits exactly
    with pytest.raises(ValueError, match="exceed the model's 256 positions"):
        structkv.generate(llama, [5, 6, 7, 8, 9], state=state, max_new_tokens=9, compile=False)
    other = structkv.load(tiny_dir("llama"))
    with pytest.raises(ValueError, match="made by another model"):
        structkv.generate(other, [5, 6], state=state, max_new_tokens=2, compile=False)


# ------------------------------------------------------------------ 4. degenerate options via the CLI


def test_eval_window_zero_is_refused(byte_model_dir, tmp_path, capsys):
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "w"), *ARGS,
                 "--window", "0"]) == 2
    assert "window must be an int >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------ 5. GGUF first-load race


def test_concurrent_first_loads_of_a_gguf_all_succeed(tmp_path):
    pytest.importorskip("gguf")
    path = write_tiny_gemma_gguf(tmp_path / "tiny.gguf")
    code = ("import structkv; m = structkv.load(%r); "
            "print(structkv.generate(m, 'ab ab', max_new_tokens=4, compile=False).token_ids)" % str(path))
    env = {**os.environ, "STRUCTKV_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(8)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in outs if err]
    assert len({out for out, _ in outs}) == 1
    folders = [p.name for p in (tmp_path / "cache").iterdir() if p.name != "kernels"]
    assert len(folders) == 1 and not folders[0].startswith(".")  # one converted copy, no leftovers
    if (tmp_path / "cache" / "kernels").exists():  # the CPU decode kernel, built by 8 processes at once
        assert [p.suffix for p in (tmp_path / "cache" / "kernels").iterdir()] == [".so"]  # one build, no temp files


# ------------------------------------------------------------------ 6. bad files, one error each


def _folder(tiny_dir, tmp_path, **config_changes):
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in config_changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": ...}, "'num_hidden_layers' is missing"),
    ({"hidden_size": "64"}, "'hidden_size' must be a positive integer"),
    ({"intermediate_size": 11.5}, "'intermediate_size' must be a positive integer"),
    ({"rope_scaling": "linear", "rope_parameters": None}, "'rope_scaling' must be an object"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a finite number > 0"),
    ({"rope_theta": 0, "rope_parameters": None}, "'rope_theta' must be a finite number > 0"),
    ({"max_position_embeddings": 0}, "'max_position_embeddings' must be a positive integer"),
    ({"eos_token_id": "eos"}, "'eos_token_id' must be a token id"),
])
def test_bad_config_fields_are_named(tiny_dir, tmp_path, change, message):
    folder = _folder(tiny_dir, tmp_path, **change)
    with pytest.raises(ValueError, match=message) as e:
        structkv.load(folder)
    assert str(folder / "config.json") in str(e.value)


def test_config_that_is_not_an_object(tiny_dir, tmp_path):
    folder = _folder(tiny_dir, tmp_path)
    (folder / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object, got a list"):
        structkv.load(folder)


def test_rope_theta_zero_in_v5_parameters(tiny_dir, tmp_path):
    folder = _folder(tiny_dir, tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 0.0})
    with pytest.raises(ValueError, match="'rope_theta' must be a finite number > 0"):
        structkv.load(folder)


def test_malformed_tokenizer_files(tiny_dir, tmp_path):
    folder = _folder(tiny_dir, tmp_path)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer.json"):
        structkv.load(folder)
    from conftest import byte_tokenizer_file
    byte_tokenizer_file(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        structkv.load(folder)


def test_gguf_missing_key_is_named(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gemma_gguf(tmp_path / "nokey.gguf", drop_key="attention.head_count")
    with pytest.raises(ValueError, match="GGUF metadata key 'gemma3.attention.head_count' is missing") as e:
        structkv.load(path)
    assert str(path) in str(e.value)
    assert structkv.load(write_tiny_gemma_gguf(tmp_path / "ok.gguf")).config.num_layers == 6  # the writer is right


# ------------------------------------------------------------------ 7. broken numbers


def test_non_finite_weights_are_refused(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _folder(tiny_dir, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][3, 5] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' .* NaN or inf"):
        structkv.load(folder)
    assert structkv.load(folder, check_weights=False) is not None  # skippable for trusted checkpoints


def test_non_finite_gguf_weights_are_refused_at_conversion(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    import gguf

    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    real = gguf.GGUFWriter.add_tensor

    def poisoned(self, name, tensor, *a, **k):
        if name == "blk.2.ffn_up.weight":
            tensor = tensor.copy()
            tensor[0, 0] = np.inf
        return real(self, name, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", poisoned)
    path = write_tiny_gemma_gguf(tmp_path / "inf.gguf")
    with pytest.raises(ValueError, match="model.layers.2.mlp.up_proj.weight.* NaN or inf"):
        structkv.load(path)


# ------------------------------------------------------------------ 8. Python API traps


def test_api_traps(llama):
    with pytest.raises(TypeError, match="bytes is ambiguous"):
        structkv.generate(llama, b"\x05\x06\x07", max_new_tokens=2, compile=False)
    for bad in (None, 5, 2.5):
        with pytest.raises(TypeError, match="a prompt must be a str"):
            structkv.generate(llama, bad, max_new_tokens=2, compile=False)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        structkv.generate(llama, [5, 6, 7], max_new_tokens=2, temperature=float("nan"), compile=False)
    with pytest.raises(TypeError, match="method must be a structkv method"):
        structkv.generate(llama, [5, 6, 7], max_new_tokens=2, method=object(), compile=False)
    ids = list(range(5, 25))
    by_name = structkv.generate(llama, ids, method="snapkv", max_new_tokens=4, compile=False, stop_at_eos=False)
    by_object = structkv.generate(llama, ids, method=methods.get("snapkv"), max_new_tokens=4, compile=False,
                                  stop_at_eos=False)
    assert by_name.token_ids == by_object.token_ids and by_name.stats["method"] == "snapkv"
    plain = structkv.generate(llama, ids, max_new_tokens=4, compile=False, stop_at_eos=False).token_ids
    for numpy_ids in ([np.int64(i) for i in ids], np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32)):
        out = structkv.generate(llama, numpy_ids, max_new_tokens=4, compile=False, stop_at_eos=False)
        assert out.token_ids == plain
    with pytest.raises(ValueError, match="1-D integer ids"):
        structkv.generate(llama, np.array(ids, dtype=np.float32), max_new_tokens=2, compile=False)
    with pytest.raises(TypeError, match="model name or path"):
        structkv.load(None)


# ------------------------------------------------------------------ 9. the CLI refuses before any work


def _eval(byte_model_dir, out, *extra):
    return main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(out), *ARGS, *extra])


def test_cli_out_checks(byte_model_dir, tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert _eval(byte_model_dir, a_file) == 2
    assert "is a file" in capsys.readouterr().err
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == tmp_path else real_access(p, mode, **k))
    assert _eval(byte_model_dir, tmp_path / "new" / "run") == 2
    assert "is not writable" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_cli_disk_full_is_one_line(byte_model_dir, tmp_path, capsys, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "write_text_atomic", full)
    assert _eval(byte_model_dir, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err


def test_cli_unwritable_cache(byte_model_dir, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("STRUCTKV_CACHE", str(blocker / "cache"))
    assert _eval(byte_model_dir, tmp_path / "run") == 2
    assert "STRUCTKV_CACHE" in capsys.readouterr().err


def test_cli_bad_threads_data_and_bench_eval(byte_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _eval(byte_model_dir, tmp_path / "t", "--threads", "-1")
    assert e.value.code == 2 and "positive integer" in capsys.readouterr().err
    assert _eval(byte_model_dir, tmp_path / "d", "--data", str(tmp_path / "nowhere")) == 2
    assert "evaluation data not found" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # no config.json left behind
    assert main(["bench", "--model", str(byte_model_dir), "--out", str(tmp_path / "b"), "--eval",
                 str(tmp_path / "missing"), "--no-hf", "--eager"]) == 2
    assert "not an eval result folder" in capsys.readouterr().err


def test_cli_shows_progress_while_building_samples(byte_model_dir, tmp_path, capsys):
    argv = [a for a in ARGS if a != "--quiet"]
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "p"), *argv]) == 0
    err = capsys.readouterr().err
    assert err.index("building samples: RULER niah_single_1 at 1024 tokens: 1-3 of 3") < err.index("[")


def test_too_short_essay_is_refused(byte_model_dir, tmp_path, capsys):
    data = tmp_path / "data"
    (data / "ruler").mkdir(parents=True)
    (data / "ruler" / "PaulGrahamEssays.json").write_text(json.dumps({"text": "Short essay. " * 20}))
    assert main(["eval", "niah", "--model", str(byte_model_dir), "--out", str(tmp_path / "n"), "--data", str(data),
                 "--lengths", "1024", "--samples", "1", "--depths", "0.5", "--eager", "--quiet"]) == 2
    assert "too little text" in capsys.readouterr().err
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "r"), "--data", str(data),
                 "--lengths", "1024", "--tasks", "niah_single_2", "--samples", "1", "--eager", "--quiet"]) == 2
    assert "haystack data ran out" in capsys.readouterr().err


# ------------------------------------------------------------------ 10. what fits is allowed


def test_prompt_plus_new_tokens_that_fit_exactly(llama):
    limit = llama.config.max_position_embeddings
    ids = torch.randint(3, 96, (limit - 6,)).tolist()
    out = structkv.generate(llama, ids, max_new_tokens=7, compile=False, stop_at_eos=False)
    assert len(out.token_ids) == 7  # positions 0..limit-1 are all used
    with pytest.raises(ValueError, match="exceeds the model's"):
        structkv.generate(llama, ids + [5], max_new_tokens=7, compile=False)
    assert math.isfinite(out.stats["prefill_s"])
