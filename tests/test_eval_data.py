"""RULER generator (determinism, sizing, format against RULER's own output) and LongBench loading."""
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from structkv.data import data_dir
from structkv.eval import longbench, ruler
from structkv.eval.text import split_sentences
from structkv.tokenizer import Tokenizer

from conftest import byte_tokenizer_file

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
    path = data_dir() / "ruler" / "reference_sample" / "niah_multikey_3_4096.jsonl"
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


def test_longbench_middle_truncation_keeps_head_and_tail(tok):
    full = longbench.load("qasper", tok, 1_000_000, samples=1)[0]["input_ids"]
    cut = longbench.load("qasper", tok, 1000, samples=1)[0]
    assert cut["truncated"] and cut["length"] == 1000
    assert cut["input_ids"] == full[:500] + full[-500:]


def test_longbench_full_file_and_bad_input(tok, tmp_path):
    assert len(longbench.load("multi_news", tok, 4096, subset=False, samples=3)) == 3  # the full 200-record file
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.load("nope", tok, 4096)
    with pytest.raises(FileNotFoundError, match="THUDM/LongBench"):
        longbench.load("qasper", tok, 4096, root=tmp_path)
