"""`structkv generate` and compile="auto" on a tiny random Llama with a byte tokenizer."""
import io
import sys

import pytest

import structkv
from structkv import methods
from structkv.cli import main
from structkv.runtime.generation import TextStream
from structkv.util import compiling


@pytest.fixture(scope="module")
def byte_model(byte_model_dir):
    return structkv.load(byte_model_dir)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))


def _gen(byte_model_dir, *args, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return main(["generate", "--model", str(byte_model_dir), "--max-new-tokens", "12", *args])


def test_prompt_streams_and_stats_go_to_stderr(byte_model, byte_model_dir, capsys):
    assert _gen(byte_model_dir, "Hello there") == 0
    out, err = capsys.readouterr()
    expected = structkv.generate(byte_model, "Hello there", max_new_tokens=12, compile=False)
    assert out == expected.text + "\n"  # streamed text is the whole text, once
    assert "prefill" in err and "KV" in err and "tok/s" in err and "eager" in err and "method full" in err
    assert _gen(byte_model_dir, "Hello there", "--no-stream") == 0
    assert capsys.readouterr().out == expected.text + "\n"


def test_prompt_from_file_or_stdin(byte_model, byte_model_dir, tmp_path, capsys, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text("A document about cats.")
    expected = structkv.generate(byte_model, "A document about cats.", max_new_tokens=12, compile=False).text + "\n"
    assert _gen(byte_model_dir, "-f", str(doc)) == 0
    assert capsys.readouterr().out == expected
    assert _gen(byte_model_dir, stdin="A document about cats.", monkeypatch=monkeypatch) == 0
    assert capsys.readouterr().out == expected
    assert _gen(byte_model_dir, "-f", "-", stdin="A document about cats.", monkeypatch=monkeypatch) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("args, message", [
    (["Hi", "-f", "x.txt"], "either as an argument or with -f"),
    (["-f", "/nonexistent/doc.txt"], "cannot read the prompt file"),
    (["   "], "the prompt is empty"),
    (["Hi", "--method", "magic"], "unknown method 'magic'"),
    (["Hi", "--method", "snapkv", "--kv-budget", "-1"], "kv_budget"),
])
def test_bad_input_is_one_clear_line(byte_model_dir, capsys, args, message):
    assert _gen(byte_model_dir, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_method_and_budgets_reach_the_compression(byte_model, byte_model_dir, capsys):
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    assert _gen(byte_model_dir, prompt, "--method", "structkv", "--kv-budget", "0.2", "--struct-budget", "0.5") == 0
    out, err = capsys.readouterr()
    method = methods.get("structkv", kv_budget=0.2, struct_budget=0.5)
    expected = structkv.generate(byte_model, prompt, max_new_tokens=12, compile=False, method=method)
    assert out == expected.text + "\n"
    assert "method structkv" in err and "prefill fraction" in err and "pivot layer" in err


def test_questions_answer_from_one_compressed_state(byte_model, byte_model_dir, capsys, monkeypatch):
    context = "Notes: the meeting is on Tuesday in room 4. " * 10
    questions = ["\nQ: When is the meeting?\nA:", "\nQ: Which room?\nA:"]
    calls = []
    real = structkv.prefill
    monkeypatch.setattr(structkv, "prefill", lambda *a, **k: calls.append(a) or real(*a, **k))
    argv = [context, "--method", "snapkv", "--kv-budget", "0.3"] + [x for q in questions for x in ("-q", q)]
    assert _gen(byte_model_dir, *argv) == 0
    out, err = capsys.readouterr()
    assert len(calls) == 1  # compressed once
    state = real(byte_model, context, methods.get("snapkv", kv_budget=0.3), room=64,
                 archive=methods.CONTEXT_ARCHIVE)  # the CLI's default: recall from an int4 archive
    answers = [structkv.generate(byte_model, q, state=state, max_new_tokens=12, compile=False).text for q in questions]
    for q, a in zip(questions, answers):
        assert f"Q: {q.strip()}\nA:{a}\n" in out
    assert err.count("structkv: method") == 2


def test_questions_recall_from_an_archive_file(byte_model, byte_model_dir, capsys, tmp_path):
    """--archive / --recall / --archive-dir reach the compression: each answer is the library's
    with the same archive and budget, read from a file in the folder, which is removed after the
    last question (such files used to pile up: no later call can find them)."""
    context = "Notes: the meeting is on Tuesday in room 4. " * 10
    question = "\nQ: Which room?\nA:"
    argv = [context, "--method", "snapkv", "--kv-budget", "0.2", "-q", question, "--archive", "int8",
            "--recall", "16", "--archive-dir", str(tmp_path / "archives")]
    assert _gen(byte_model_dir, *argv) == 0
    out, err = capsys.readouterr()
    state = structkv.prefill(byte_model, context, methods.get("snapkv", kv_budget=0.2), room=64, archive="int8",
                             recall=16)
    expected = structkv.generate(byte_model, question, state=state, max_new_tokens=12, compile=False)
    assert out == expected.text + "\n"
    assert "recalled" in err and "int8 archive" in err and str(tmp_path / "archives") in err  # read from the file
    assert list((tmp_path / "archives").iterdir()) == []
    assert _gen(byte_model_dir, context, "--archive", "int4") == 2  # without a question: refused
    assert "serve questions" in capsys.readouterr().err


def test_questions_without_a_method_get_the_context_default_at_its_own_budget(byte_model, byte_model_dir, monkeypatch,
                                                                             capsys):
    """-q without --method compresses with the model kind's `context_default` (KeyDiff on this dense
    model) at its own budget (10 % of the entries), which --kv-budget still overrides, and keeps an int4 archive the
    questions recall from (`--archive none`: no archive; `full` never archives)."""
    seen = []
    real = structkv.prefill
    monkeypatch.setattr(structkv, "prefill", lambda m, c, method, **k: seen.append((method, k["archive"]))
                        or real(m, c, method, **k))
    context = "Notes: the meeting is on Tuesday in room 4. " * 10
    assert _gen(byte_model_dir, context, "-q", "\nQ: When?\nA:") == 0
    assert _gen(byte_model_dir, context, "-q", "\nQ: When?\nA:", "--kv-budget", "0.2") == 0
    assert _gen(byte_model_dir, context, "-q", "\nQ: When?\nA:", "--archive", "none") == 0
    assert _gen(byte_model_dir, context, "-q", "\nQ: When?\nA:", "--method", "full") == 0
    capsys.readouterr()
    default = methods.context_default(byte_model.config)[0]
    assert default == "keydiff"
    assert [(m.name, m.kv_budget, a) for m, a in seen[:3]] == [
        (default, 0.1, "int4"), (default, 0.2, "int4"), (default, 0.1, None)]
    assert (seen[3][0].name, seen[3][1]) == ("full", None)
    assert _gen(byte_model_dir, context, "-q", "\nQ: When?\nA:", "--archive", "none", "--recall", "8") == 2
    assert "need an archive" in capsys.readouterr().err


def test_threads_and_int8_kv_entries(byte_model, byte_model_dir, capsys):
    """--threads sets torch's thread count for the call; --kv-dtype int8 stores the entries as int8
    and answers like the float cache on this model."""
    import torch

    before = torch.get_num_threads()
    try:
        assert _gen(byte_model_dir, "Hello there", "--threads", "1", "--kv-dtype", "int8", "--no-stream") == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert out == structkv.generate(byte_model, "Hello there", max_new_tokens=12, compile=False).text + "\n"


def test_a_kv_bound_while_generating(byte_model, byte_model_dir, capsys):
    from structkv.modules import DecodeBound

    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    args = ("--max-new-tokens", "60", "--max-kv-tokens", "64", "--decode-evict", "recent", "--no-stream")
    assert main(["generate", "--model", str(byte_model_dir), prompt, *args]) == 0
    out, err = capsys.readouterr()
    expected = structkv.generate(byte_model, prompt, max_new_tokens=60, compile=False,
                                 max_kv_tokens=DecodeBound(64, "recent"))
    assert out == expected.text + "\n"
    assert "KV bound 64 per layer (recent): peak 64 entries" in err
    assert _gen(byte_model_dir, "Hi", "--decode-evict", "window") == 2
    assert "give --max-kv-tokens N with it" in capsys.readouterr().err


def test_generate_and_serve_wait_passively_unless_told(byte_model_dir, monkeypatch, capsys, tmp_path):
    """OMP_WAIT_POLICY=PASSIVE for the commands that share the machine (set before torch would
    read it in a fresh process); an explicit setting wins; eval keeps OpenMP's default."""
    import os

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _gen(byte_model_dir, "Hi", "--no-stream") == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _gen(byte_model_dir, "Hi", "--no-stream") == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert main(["eval", "ruler", "--model", str(byte_model_dir), "--out", str(tmp_path / "e"), "--samples", "1",
                 "--first", "-1"]) == 2  # parsed (the policy step ran), then refused
    assert "OMP_WAIT_POLICY" not in os.environ
    capsys.readouterr()


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for option in ("--file", "--question", "--method", "--kv-budget", "--struct-budget", "--compile", "--no-stream",
                   "--max-new-tokens", "--temperature", "--seed", "--threads", "--kv-dtype", "--max-kv-tokens",
                   "--decode-evict", "examples:"):
        assert option in text


def test_text_stream_holds_back_partial_characters(byte_model):
    tok = byte_model.tokenizer
    ids = tok.encode("é!", add_bos=False)  # "é" is two byte tokens
    assert len(ids) == 3
    sink = io.StringIO()
    stream = TextStream(tok, sink)
    stream([ids[0]])
    assert sink.getvalue() == ""  # half a character is not shown
    stream([ids[1]])
    stream([None])  # a stopped row adds nothing
    stream([ids[2]])
    assert sink.getvalue() == "é!"
    stream([ids[0]])  # ends inside a character: finish() shows what the text decodes to
    stream.finish()
    assert sink.getvalue() == tok.decode(ids + [ids[0]])


def test_auto_compile_runs_eager_until_it_pays(byte_model, monkeypatch):
    auto = structkv.generate(byte_model, "Hello", max_new_tokens=8, compile="auto")
    eager = structkv.generate(byte_model, "Hello", max_new_tokens=8, compile=False)
    assert auto.token_ids == eager.token_ids and auto.stats["compiled_parts"] == []
    assert not compiling.should_compile_decode(byte_model, 100)
    assert compiling.should_compile_decode(byte_model, compiling.DECODE_TOKENS_COLD)
    assert not compiling.is_warm(byte_model)
    monkeypatch.setattr(compiling, "DECODE_TOKENS_COLD", 4)  # make compiling "pay" for 8 tokens
    comp = structkv.generate(byte_model, "Hello", max_new_tokens=8, compile="auto")
    assert comp.token_ids == eager.token_ids and comp.stats["compiled_parts"] == ["decode"]  # never the prefill
    assert compiling.is_warm(byte_model)  # later processes use the warm threshold
    assert compiling.should_compile_decode(byte_model, compiling.DECODE_TOKENS_WARM)


def test_auto_compile_thresholds_are_per_device_kind():
    """The CPU's break-even (thousands of tokens) is not a GPU's: there an eager step is launch-bound,
    so compile="auto" compiles the decode step from the first token (it used to decode eagerly)."""
    import types

    import torch

    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert compiling.should_compile_decode(gpu, 1)


def test_inductor_cache_goes_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compiling.use_persistent_cache() == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiling.use_persistent_cache() == str(tmp_path / "mine")  # the caller's choice wins


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_generate_refuses_a_seed_out_of_range_before_loading(seed, capsys):
    """--seed -1 was accepted and 2**64 gave torch's 'Overflow when unpacking long long'."""
    from structkv.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hello", "--seed", seed])
    assert "seed in 0..2**64-1" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["1e-300", "1e-45"])
def test_a_tiny_temperature_generates_greedily_without_a_traceback(byte_model_dir, capsys, temperature):
    """`--temperature 1e-300` printed a traceback (logits / t overflowed float32, multinomial raised);
    it now decodes as its limit, greedy: the same text as --temperature 0."""
    from structkv.cli import main

    assert main(["generate", "--model", str(byte_model_dir), "--max-new-tokens", "6", "--temperature", temperature,
                 "--seed", "1", "hello"]) == 0
    tiny = capsys.readouterr().out
    assert main(["generate", "--model", str(byte_model_dir), "--max-new-tokens", "6", "hello"]) == 0
    assert tiny == capsys.readouterr().out
