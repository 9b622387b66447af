"""The benchmarks `structkv eval` runs, one small class each, in a registry.

A benchmark says what the loop cannot know: its tasks, how many samples a task holds, what data
it reads and how its samples are built (token ids, gold outputs, metric). The loop
(`structkv.harness.eval.runner`) names no benchmark; a new one is a class here and one
`register` line (tests/test_eval_cli.py adds one).
"""
from __future__ import annotations

import sys

DEFAULT_SAMPLES = 10  # generated samples per task (RULER, niah) when not given


class Benchmark:
    """Base: prompts generated per task. `per_depth`: samples repeat at every needle depth;
    `question_after`: its prompts have a question to append after compression; `longbench`:
    some of its prompts are LongBench's (its records, and --chat's scope, matter)."""

    name = ""
    loop = "runner"  # the module under structkv.harness.eval with its run / report / summary_markdown
    records = "predictions.jsonl"  # the file of one line per scored prompt
    per_depth = False
    question_after = True
    longbench = False

    def tasks(self) -> list[str]:
        """Every task a run without --tasks runs."""
        raise NotImplementedError

    def extra_tasks(self) -> list[str]:
        """Tasks run only when named."""
        return []

    def task_samples(self, cfg, task: str) -> int:
        """Samples the run asks of `task` (per length; per depth where `per_depth`)."""
        return cfg.samples or DEFAULT_SAMPLES

    def check_data(self, cfg) -> None:
        """Refuse a --data folder without what this benchmark reads (before anything is written)."""
        _ruler_data(cfg)

    def samples(self, cfg, tokenizer, tasks: list[str], length: int, wrap, progress: bool) -> list[dict]:
        """The samples of `tasks` at `length` tokens; `wrap`: the chat turn's markup (None: plain)."""
        raise NotImplementedError

    def what(self, cfg) -> str:
        """How many samples per task, for the summary's heading."""
        return f"{cfg.samples or DEFAULT_SAMPLES} sample(s)"


class Ruler(Benchmark):
    name = "ruler"

    def tasks(self):
        from .ruler import TASKS
        return list(TASKS)

    def extra_tasks(self):
        from .ruler import EXTRA_TASKS
        return list(EXTRA_TASKS)

    def samples(self, cfg, tokenizer, tasks, length, wrap, progress):
        return ruler_samples(cfg, tokenizer, tasks, length, wrap, progress)


class LongBench(Benchmark):
    name = "longbench"
    longbench = True

    def tasks(self):
        from .longbench import TASKS
        return list(TASKS)

    def task_samples(self, cfg, task):
        return longbench_records(cfg, task)

    def check_data(self, cfg):
        if cfg.data_dir is not None:
            from .longbench import longbench_dir
            longbench_dir(cfg.data_dir)

    def samples(self, cfg, tokenizer, tasks, length, wrap, progress):
        return longbench_samples(cfg, tokenizer, tasks, length, wrap, progress)

    def what(self, cfg):
        return f"up to {cfg.samples} record(s)" if cfg.samples else "every record"


class Fidelity(Ruler):
    """Logit fidelity on RULER's and LongBench's prompts (`structkv.harness.eval.fidelity`)."""

    name = "fidelity"
    loop = "fidelity"
    records = "records.jsonl"
    longbench = True

    def tasks(self):
        from .longbench import TASKS as LONGBENCH
        return super().tasks() + list(LONGBENCH)

    def task_samples(self, cfg, task):
        from .longbench import TASKS as LONGBENCH
        return longbench_records(cfg, task) if task in LONGBENCH else super().task_samples(cfg, task)

    def samples(self, cfg, tokenizer, tasks, length, wrap, progress):
        from .longbench import TASKS as LONGBENCH
        ruler = [t for t in tasks if t not in LONGBENCH]
        longbench = [t for t in tasks if t in LONGBENCH]
        return (ruler_samples(cfg, tokenizer, ruler, length, wrap, progress)
                + longbench_samples(cfg, tokenizer, longbench, length, wrap, progress))


class Niah(Benchmark):
    """Needles at depths of an essay haystack: one task, samples per depth."""

    name = "niah"
    per_depth = True
    question_after = False

    def tasks(self):
        return ["niah"]

    def samples(self, cfg, tokenizer, tasks, length, wrap, progress):
        from .sources import needle_prompt

        markup = sum(map(len, wrap())) if wrap else 0
        out = []
        for depth in cfg.depths:
            building(progress, f"needles at {length} tokens, depth {depth:g}")
            for index in range(cfg.first, cfg.first + self.task_samples(cfg, "niah")):
                needle = needle_prompt(tokenizer, length - 16 - markup, depth, seed=cfg.seed + index,
                                       root=cfg.data_dir)
                ids = needle.prompt_ids
                if wrap:  # the whole prompt (answer prefix included) as one user turn; BOS is the template's
                    ids = split(ids[1:] if ids[:1] == [tokenizer.bos_id] else ids, [], [], wrap, False)
                    ids = ids["input_ids"]
                out.append({"index": index, "task": "niah", "depth": depth, "input_ids": ids,
                            "outputs": [needle.answer], "length": len(ids), "max_new_tokens": 24 if wrap else 12,
                            "metric": "needle", "length_budget": length})
        return out


BENCHMARKS: dict[str, Benchmark] = {}


def register(benchmark: Benchmark) -> None:
    """Make `benchmark` runnable as `structkv eval <benchmark.name>`."""
    BENCHMARKS[benchmark.name] = benchmark


for _b in (Ruler(), LongBench(), Niah(), Fidelity()):
    register(_b)


def get(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


# ------------------------------------------------------------------------------ building samples


def ruler_samples(cfg, tokenizer, tasks, length, wrap, progress) -> list[dict]:
    from .ruler import generate

    markup = sum(map(len, wrap())) if wrap else 0  # the chat turn's own tokens come out of the length budget
    out = []
    for task in tasks:
        n = cfg.task_samples(task)
        for start in range(0, n, 10):  # in steps of 10 (samples are independent), to show progress
            building(progress, f"RULER {task} at {length} tokens: {start + 1}-{min(n, start + 10)} of {n}")
            for rec in generate(task, tokenizer, length - markup, min(10, n - start), seed=cfg.seed,
                                data_dir=cfg.data_dir, start=cfg.first + start):
                out.append({**rec, **ruler_ids(rec.pop("input"), rec.pop("question"), rec["answer_prefix"],
                                               tokenizer, wrap, cfg.question_after),
                            "length_budget": length})
    return out


def longbench_samples(cfg, tokenizer, tasks, length, wrap, progress) -> list[dict]:
    from .longbench import PLAIN_UNDER_CHAT, load

    markup = sum(map(len, wrap())) if wrap else 0
    out = []
    for task in tasks:
        building(progress, f"LongBench {task} at {length} tokens")
        turn = wrap if cfg.chat_every_task or task not in PLAIN_UNDER_CHAT else None
        bos = 1 if turn and tokenizer.add_bos and tokenizer.bos_id is not None else 0  # dropped below
        for rec in load(task, tokenizer, length - (markup if turn else 0) + bos, root=cfg.data_dir,
                        subset=not cfg.longbench_full, samples=cfg.samples, split_question=cfg.question_after,
                        first=cfg.first):
            if turn:  # the tokenizer's BOS is the template's business
                ids = rec["input_ids"]
                rec["input_ids"] = ids[1:] if ids[:1] == [tokenizer.bos_id] else ids
            rec.update(split(rec.pop("input_ids"), rec.pop("question_ids", []), [], turn, cfg.question_after))
            out.append({**rec, "length_budget": length})
    return out


def longbench_records(cfg, task: str) -> int:
    """Samples a run asks of a LongBench task: its file has only so many records."""
    from .longbench import task_file

    try:
        with task_file(task, cfg.data_dir, not cfg.longbench_full).open() as f:
            records = sum(1 for line in f if line.strip())
    except FileNotFoundError:  # e.g. --report away from the data: the asked count is all we know
        return cfg.samples or DEFAULT_SAMPLES
    return max(0, min(records - cfg.first, cfg.samples or records))


def _ruler_data(cfg) -> None:
    if cfg.data_dir is None:
        return
    from .sources import data_dir
    folder = data_dir(cfg.data_dir)
    if not (folder / "ruler").is_dir():
        raise FileNotFoundError(f"--data {folder} has no ruler/ folder, which {cfg.benchmark} needs "
                                "(PaulGrahamEssays.json, squad.json, hotpotqa.json)")


def chat_wrapper(tokenizer):
    """() -> (ids before, ids after) the content of one user turn, the assistant's turn opened
    after it (an answer prefix goes after that); content is not re-tokenized (`structkv.text.chat.frame`)."""
    from ...text.chat import frame

    head, tail = frame(tokenizer)
    return lambda: (head, tail)


def ruler_ids(text: str, question: str, prefix: str, tokenizer, wrap, question_after: bool) -> dict:
    """A RULER record's token ids: `input_ids` (what is compressed) and, with `question_after`,
    `question_ids` (the text after the haystack, appended uncompressed)."""
    if wrap:  # the answer prefix follows the opened assistant turn
        text, question = text[: len(text) - len(prefix)], question[: len(question) - len(prefix)]
    bos = not wrap
    if question_after:
        ids = tokenizer.encode(text[: len(text) - len(question)], add_bos=bos)
        asked = tokenizer.encode(question, add_bos=False)
    else:
        ids, asked = tokenizer.encode(text, add_bos=bos), []
    answer = tokenizer.encode(prefix.lstrip(), add_bos=False) if wrap and prefix else []
    return split(ids, asked, answer, wrap, question_after)


def split(context: list[int], question: list[int], answer: list[int], wrap, question_after: bool) -> dict:
    """`input_ids` = the part compressed; `question_ids` (query-agnostic runs only) = the rest,
    with the chat turn's markup around the content when `wrap` is given."""
    head, tail = wrap() if wrap else ([], [])
    before, after = head + context, question + tail + answer
    return {"input_ids": before, "question_ids": after} if question_after else {"input_ids": before + after}


def building(enabled: bool, what: str) -> None:
    """A progress line on stderr (one line rewritten on a terminal)."""
    if enabled:
        tty = sys.stderr.isatty()
        print(("\r" + f"building samples: {what}"[:160].ljust(160)) if tty else f"building samples: {what}",
              end="" if tty else "\n", file=sys.stderr, flush=True)
