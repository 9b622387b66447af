"""Tensor parallelism on CPU: 2 gloo ranks spawned by the test against one process, on tiny random
llama, qwen2, qwen3 and gemma3_text models, for `full` and every method (structkv.harness.tp_check
compares logits, greedy tokens, pivots, tokens per layer, kept columns and each rank's cache)."""
import time

import pytest
from conftest import make_hf_model

from structkv.distributed.sharding import local_config
from structkv.harness import tp_check as check
from structkv.models.config import ModelConfig

ARCHS = ["llama", "qwen2", "qwen3", "gemma3_text"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = []
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"tp_{arch}")
        make_hf_model(arch).save_pretrained(path)
        out.append(path)
    return out


def test_tp2_equals_one_process_for_every_method(folders):
    """Batches with padding; the first model also decodes compiled with the all-reduces in its
    graph (one prefill + one decode graph per rank, as in one process), and with int8 / int4 KV
    entries (each rank its heads' planes of the single-process cache, the same tokens)."""
    assert check.run(folders, world=2, timeout_s=300, compile_decode=True) == []


def test_a_lost_rank_is_an_error_not_a_hang(folders):
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="Connection closed by peer|[Tt]imed? ?out"):
        check.run(folders[:1], world=2, timeout_s=10, fail_rank=1)
    assert time.perf_counter() - t0 < 120


def test_degrees_that_split_a_kv_head_are_refused():
    cfg = ModelConfig.from_hf(make_hf_model("llama").config.to_dict())  # 4 query heads, 2 KV heads
    assert local_config(cfg, 2).num_kv_heads == 1
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads; use one of 1, 2"):
        local_config(cfg, 4)


def test_tp_without_torchrun_says_how_to_launch(folders, monkeypatch):
    import structkv

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        structkv.load(folders[0], tp=2)


def test_cli_generate_under_torchrun_prints_the_single_process_answer(byte_model_dir):
    """`torchrun --nproc-per-node 2 -m structkv.cli generate --tp 2`: rank 0 prints what one process
    prints; the stats line gives this rank's KV and the total over ranks."""
    import os
    import subprocess
    import sys

    args = ["-m", "structkv.cli", "generate", "A test of tensor parallel generation.", "--model", str(byte_model_dir),
            "--method", "structkv", "--kv-budget", "0.5", "--max-new-tokens", "8", "--eager"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args, "--tp", "2"],
                         capture_output=True, text=True, timeout=240, env=env)
    # On failure: the ranks' own lines (the start of stderr: what aborted, and when) and stdout
    # (did rank 0 answer before it ended?), not only torchrun's summary at the end.
    assert one.returncode == 0 and two.returncode == 0, (
        f"stdout: {two.stdout[-500:]!r}\nstderr head: {two.stderr[:2500]}\n...\nstderr tail: {two.stderr[-800:]}")
    assert two.stdout == one.stdout
    assert "tensor parallel over 2 ranks" in two.stderr
