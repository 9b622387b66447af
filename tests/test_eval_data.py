"""RULER generator (determinism, sizing, format against RULER's own output) and LongBench loading."""
import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import byte_tokenizer_file

from structkv.harness.eval import longbench, ruler
from structkv.harness.eval.text import split_sentences
from structkv.text.tokenizer import Tokenizer

pytest.importorskip("wonderwords", reason="RULER word lists: pip install 'structkv[eval]'")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = byte_tokenizer_file(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return Tokenizer.from_file(path, bos_id=256, eos_ids=(257,))


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_every_task_fits_its_budget_and_holds_its_answers(tok, task):
    length = 8192 if task == "qa_2" else 2048  # a HotpotQA question brings its 10 paragraphs (~6K bytes)
    recs = ruler.generate(task, tok, length, 2)
    spec = ruler.TASKS[task]
    for i, r in enumerate(recs):
        assert set(r) >= {"index", "input", "outputs", "length"}  # RULER's fields
        assert r["index"] == i and r["task"] == task and r["metric"] == spec.metric
        assert r["length"] == len(tok.encode(r["input"]))
        assert r["length"] + spec.max_new_tokens <= length
        fill = 0.6 if spec.kind == "qa" else 0.85  # qa grows by whole documents (~800 byte tokens here)
        assert r["length"] + spec.max_new_tokens > fill * length, "the haystack should fill the budget"
        assert r["input"].endswith(r["answer_prefix"])
        body = r["input"][: -len(r["answer_prefix"])]
        if spec.kind in ("niah", "vt", "qa"):
            for gold in r["outputs"]:
                if spec.kind == "qa" and gold in ("yes", "no"):  # HotpotQA comparison questions
                    continue
                assert gold in body, f"{task}: gold {gold!r} is not in the prompt"
        if spec.kind == "cwe":
            listed = Counter(re.findall(r"\d+\. (\S+)", body.split("\nBelow is")[-1]))
            repeats = 30 if length >= 4096 else 6  # RULER lowers the repeats below 4K tokens
            assert all(listed[w] == repeats for w in r["outputs"]) and len(r["outputs"]) == 10
            assert max(c for w, c in listed.items() if w not in r["outputs"]) < repeats
        if spec.kind == "fwe":
            counts = Counter(body.split())
            top = [w for w, _ in counts.most_common() if re.fullmatch(r"[a-z]{6}", w)][:3]
            assert top == r["outputs"]


def test_generation_is_deterministic_and_seeded(tok):
    a = ruler.generate("niah_multikey_1", tok, 1024, 3, seed=7)
    b = ruler.generate("niah_multikey_1", tok, 1024, 3, seed=7)
    c = ruler.generate("niah_multikey_1", tok, 1024, 3, seed=8)
    assert a == b
    assert [r["outputs"] for r in a] != [r["outputs"] for r in c]
    assert ruler.generate("niah_multikey_1", tok, 1024, 2, seed=7, start=1) == a[1:]  # samples are independent


def test_niah_multikey_3_matches_rulers_reference_file(tok):
    """Same template text, needle lines, question and answer placement as RULER's own 4096 output."""
    path = Path(__file__).parent / "data" / "ruler_niah_multikey_3_4096_first.jsonl"  # see data/SOURCES.md
    reference = json.loads(path.open().readline())
    ours = ruler.generate("niah_multikey_3", tok, 4096, 1)[0]
    assert set(reference) <= set(ours)

    def shape(text):
        lines = UUID.sub("U", text).split("\n")
        return lines[0], sorted(set(lines[1:-1])), lines[-1]

    assert shape(ours["input"]) == shape(reference["input"])
    for rec, golds in ((reference, reference["outputs"]), (ours, ours["outputs"])):
        question = rec["input"].split("\n")[-1]
        assert all(g not in question for g in golds)
        assert all(rec["input"].count(f"is: {g}.") == 1 for g in golds)


def test_singular_and_plural_templates(tok):
    single = ruler.generate("niah_single_2", tok, 1024, 1)[0]["input"]
    assert single.startswith("A special magic number is hidden within the following text.")
    assert "What is the special magic number for" in single and single.endswith("mentioned in the provided text is")
    multi = ruler.generate("niah_multiquery", tok, 2048, 1)[0]
    assert multi["input"].startswith("Some special magic numbers are hidden")
    assert ", and " in multi["input"].split("\n")[-1] and len(multi["outputs"]) == 4


def test_bad_ruler_input(tok):
    with pytest.raises(ValueError, match="unknown RULER task 'niah'"):
        ruler.generate("niah", tok, 4096, 1)
    with pytest.raises(ValueError, match="at least 256"):
        ruler.generate("vt", tok, 100, 1)
    with pytest.raises(FileNotFoundError, match="PaulGrahamEssays.json"):
        ruler.generate("niah_single_2", tok, 1024, 1, data_dir=Path(__file__).parent)


def test_sentence_splitter():
    text = "Dr. Smith went to Washington. He arrived at 5 p.m. on Monday! Was it late? \"Yes.\" The U.S. agreed."
    assert split_sentences(text) == [
        "Dr. Smith went to Washington.", "He arrived at 5 p.m. on Monday!", "Was it late?", "\"Yes.\"",
        "The U.S. agreed."]


@pytest.mark.parametrize("task", longbench.TASKS)
def test_longbench_subset_prompts(tok, task):
    templates = json.loads((longbench.longbench_dir() / "config" / "dataset2prompt.json").read_text())
    recs = longbench.load(task, tok, 10**7, samples=2)
    raw = [json.loads(line) for line in longbench.task_file(task).open()][:2]
    for rec, row in zip(recs, raw):
        assert rec["input_ids"] == tok.encode(templates[task].format(context=row["context"], input=row["input"]))
        assert rec["outputs"] == row["answers"] and not rec["truncated"]
    if task == "trec":
        assert isinstance(recs[0]["all_classes"], list) and len(recs[0]["all_classes"]) > 10


def test_a_development_split_starts_at_first(tok, tmp_path):
    """`first`: LongBench records and RULER samples from that index on, the same prompts the default
    run builds there, under their own indices (so a dev folder never shares a prompt key with the
    confirmation run), and a folder refuses the other split."""
    from structkv.harness.eval import result_folder, runner

    dev = longbench.load("trec", tok, 10**7, samples=2, first=2)
    assert [r["index"] for r in dev] == [2, 3]
    assert dev == longbench.load("trec", tok, 10**7, samples=4)[2:]
    common = dict(model="x", tasks=["niah_single_1"], lengths=[1024], samples=1)
    one = runner.build_samples(runner.EvalConfig("ruler", first=1, **common), tok)
    two = runner.build_samples(runner.EvalConfig("ruler", **{**common, "samples": 2}), tok)
    assert one == two[1:] and one[0]["index"] == 1
    assert runner.EvalConfig("longbench", tasks=["trec"], samples=50, first=6).task_samples("trec") == 2
    with pytest.raises(ValueError, match="first needs samples"):
        runner.EvalConfig("ruler", first=2).validate()
    runner.write_text_atomic(tmp_path / "config.json", json.dumps({"config": {"benchmark": "ruler", "model": "x"}}))
    with pytest.raises(ValueError, match="other settings.*first"):
        result_folder.check_settings(runner.EvalConfig("ruler", model="x", first=2, samples=1), tmp_path)


def test_longbench_middle_truncation_keeps_head_and_tail(tok):
    full = longbench.load("qasper", tok, 1_000_000, samples=1)[0]["input_ids"]
    cut = longbench.load("qasper", tok, 1000, samples=1)[0]
    assert cut["truncated"] and cut["length"] == 1000
    assert cut["input_ids"] == full[:500] + full[-500:]


def test_longbench_full_file_from_the_hub_archive(tok, tmp_path, monkeypatch):
    """The full task file is extracted once from LongBench's data.zip (here a local stand-in for the
    Hub download) into the cache; later loads need no archive."""
    import zipfile

    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    rows = [line for line in longbench.task_file("multi_news").open()]
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/multi_news.jsonl", "".join(rows))
        z.writestr("data/multi_news_e.jsonl", rows[0])
    calls = []
    monkeypatch.setattr(longbench, "hub_file", lambda *a, **k: calls.append(a) or archive)
    assert len(longbench.load("multi_news", tok, 4096, subset=False, samples=3)) == 3
    assert longbench.task_file("multi_news", subset=False) == tmp_path / "cache" / "longbench" / "multi_news.jsonl"
    assert calls == [("THUDM/LongBench", "data.zip")]  # fetched once, then read from the cache
    assert longbench.task_file("multi_news", subset=False).read_text() == "".join(rows)


def test_longbench_full_offline_fails_fast_naming_the_subset(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable.*bundled subset"):
        longbench.task_file("qasper", subset=False)
    assert time.monotonic() - start < 10


def test_data_override_folder(tok, tmp_path, monkeypatch):
    """--data / STRUCTKV_DATA replace the fetched and bundled data (a .gz copy also serves)."""
    import gzip
    import shutil

    (tmp_path / "ruler").mkdir()
    essays = {"text": "Alpha beta gamma. " * 4000}
    with gzip.open(tmp_path / "ruler" / "PaulGrahamEssays.json.gz", "wt") as f:
        json.dump(essays, f)
    rec = ruler.generate("niah_single_2", tok, 1024, 1, data_dir=tmp_path)[0]
    assert "Alpha beta gamma." in rec["input"]
    shutil.copytree(longbench.BUNDLED, tmp_path / "longbench")
    monkeypatch.setenv("STRUCTKV_DATA", str(tmp_path))
    assert longbench.task_file("qasper") == tmp_path / "longbench" / "subset" / "qasper.jsonl"
    with pytest.raises(FileNotFoundError, match="ruler/squad.json"):
        ruler.generate("qa_1", tok, 1024, 1)


def test_longbench_bad_input(tok, tmp_path):
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.load("nope", tok, 4096)
    with pytest.raises(FileNotFoundError, match="THUDM/LongBench"):
        longbench.load("qasper", tok, 4096, root=tmp_path)
