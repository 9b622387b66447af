"""LongBench v1 (English tasks) from local jsonl files, with the official prompts and lengths.

A task file is `<dir>/<task>.jsonl` (official LongBench format: context, input, answers,
all_classes, ...); `dir` is a LongBench folder holding `config/`, the full files and/or a
`subset/` folder. By default that folder is the one bundled with the package (config and the
187-record MiniLongBench subset of the 16 English tasks, `structkv/harness/eval/data/SOURCES.md`), and the
full task files come from the Hub's THUDM/LongBench `data.zip`, cached under
`$STRUCTKV_CACHE/longbench`; `--data DIR` / `$STRUCTKV_DATA` replace both with `DIR/longbench`.
Prompts use `config/dataset2prompt.json` and generation lengths
`config/dataset2maxlen.json`; prompts longer than the budget are cut in the middle, as
LongBench's pred.py does (first half + last half of the tokens). Prompts are plain text, as for
base models; `structkv eval --chat` puts them in the model's chat template, except the tasks of
`PLAIN_UNDER_CHAT`, which LongBench's pred.py leaves plain for chat models too.
"""
from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

from ...util.fetch import cache_root, hub_file, locked
from ...util.files import write_atomic
from .metrics import LONGBENCH_METRIC
from .sources import data_dir

TASKS = list(LONGBENCH_METRIC)
# Few-shot tasks (their examples read as a text to continue, the answer in the examples' format) and
# code completion: LongBench's pred.py does not wrap these in a chat model's template.
PLAIN_UNDER_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
BUNDLED = Path(__file__).resolve().parent / "data" / "longbench"
HUB_REPO = "THUDM/LongBench"
OFFLINE_HINT = ("The bundled subset (187 records over all 16 English tasks) needs no network: run without "
                "--longbench-full (subset=True). Or put the official <task>.jsonl files and config/ in DIR/longbench/ "
                "and pass --data DIR.")


def longbench_dir(root=None) -> Path:
    """`root` itself when it is a LongBench folder, else `<data dir>/longbench`."""
    if root is not None and (Path(root) / "config" / "dataset2prompt.json").exists():
        return Path(root)
    folder = data_dir(root)
    if folder is None:
        return BUNDLED
    path = folder / "longbench"
    if not (path / "config" / "dataset2prompt.json").exists():
        raise FileNotFoundError(
            f"LongBench config not found under {path}: expected config/dataset2prompt.json and dataset2maxlen.json "
            "from github.com/THUDM/LongBench (LongBench/config/), next to the task jsonl files")
    return path


def task_file(task: str, root=None, subset: bool = True) -> Path:
    """The jsonl for `task`: `subset/<task>.jsonl` when asked for and present, else `<task>.jsonl`."""
    if task not in LONGBENCH_METRIC:
        raise ValueError(f"unknown LongBench task {task!r}; English tasks: {', '.join(TASKS)}")
    base = longbench_dir(root)
    if base == BUNDLED:
        return base / "subset" / f"{task}.jsonl" if subset else full_task_file(task)
    candidates = ([base / "subset" / f"{task}.jsonl"] if subset else []) + [base / f"{task}.jsonl"]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(f"no data for LongBench task {task!r}: looked for {', '.join(map(str, candidates))}. "
                            "The official files are data.zip of THUDM/LongBench on the Hugging Face Hub")


def full_task_file(task: str) -> Path:
    """The official full `<task>.jsonl` from the Hub's THUDM/LongBench data.zip, extracted once
    into `$STRUCTKV_CACHE/longbench/` (offline: a ConnectionError naming the bundled subset)."""
    target = cache_root() / "longbench" / f"{task}.jsonl"
    if target.exists():
        return target
    archive = hub_file(HUB_REPO, "data.zip", repo_type="dataset", offline_hint=OFFLINE_HINT)
    with locked(target.parent / ".lock"), zipfile.ZipFile(archive) as z:
        if not target.exists():
            members = [n for n in z.namelist() if Path(n).name == f"{task}.jsonl"]
            if not members:
                raise ValueError(f"{archive} has no {task}.jsonl: not LongBench v1's data.zip")
            with z.open(min(members, key=len)) as src:  # data/<task>.jsonl
                write_atomic(src, target)
    return target


def load(task: str, tokenizer, max_length: int, *, root=None, subset: bool = True,
         samples: int | None = None, split_question: bool = False, first: int = 0) -> list[dict]:
    """Records `first` .. `first + samples - 1` of `task` (all from `first` when samples is None),
    with the rendered, middle-truncated prompt (`input_ids`) and gold answers.

    `split_question`: `input_ids` is the prompt up to the end of the context and `question_ids`
    what the template puts after it (the question and instructions; no template puts the input
    before the context), for query-agnostic runs; only the context part is middle-truncated."""
    if max_length < 64:
        raise ValueError(f"max_length must be at least 64 tokens, got {max_length}")
    base = longbench_dir(root)
    templates = json.loads((base / "config" / "dataset2prompt.json").read_text())
    max_new = json.loads((base / "config" / "dataset2maxlen.json").read_text())
    path = task_file(task, root, subset)
    records = []
    with path.open() as f:
        for index, line in enumerate(f):
            if samples is not None and index >= first + samples:
                break
            if index < first:
                continue
            row = json.loads(line)
            head, _, tail = templates[task].partition("{context}")
            if split_question:
                ids = tokenizer.encode(head.format(input=row["input"]) + row["context"])
                question = tokenizer.encode(tail.format(input=row["input"]), add_bos=False)
            else:
                ids, question = tokenizer.encode(templates[task].format(context=row["context"], input=row["input"])), []
            room = max_length - len(question)
            if room < 32:
                raise ValueError(f"{task} record {index}: its question alone takes {len(question)} of the "
                                 f"{max_length} tokens; use a longer length")
            truncated = len(ids) > room
            if truncated:  # keep the head (with BOS) and the tail, where the question is
                half = room // 2
                ids = ids[:half] + ids[len(ids) - (room - half):]
            classes = row.get("all_classes") or []
            if isinstance(classes, str):  # the MiniLongBench subset stores the list as its repr
                classes = ast.literal_eval(classes)
            records.append({"index": index, "task": task, "input_ids": ids, "outputs": list(row["answers"]),
                            **({"question_ids": question} if split_question else {}),
                            "all_classes": classes, "length": len(ids) + len(question), "truncated": truncated,
                            "max_new_tokens": int(max_new[task]), "metric": LONGBENCH_METRIC[task]})
    if not records:
        raise ValueError(f"{path} holds no records" + (f" from index {first}" if first else ""))
    return records
