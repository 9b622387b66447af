"""One evaluation loop for every benchmark: (method, budget) x sample, resumable, with stats.

An output folder holds `config.json` (settings, package versions, git commit), `predictions.jsonl`
(one line per method run on one sample, appended as soon as it finishes: a rerun skips what is
there), `metrics.json`, `summary.md` and the plots. Each prediction is filed under the name the
method reported while it ran (`stats["method"]`), never under the requested label alone, so a
method's scores cannot land in another method's row.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ... import methods as methods_registry
from ...modules.budget import Budget
from ...util.files import write_text_atomic
from .. import mean, median
from . import metrics
from .benchmarks import chat_wrapper
from .config import IDENTITY, EvalConfig  # noqa: F401 (EvalConfig: imported from here by the tools)
from .result_folder import check_settings, open_output, read_predictions, sample_key


def method_runs(cfg: EvalConfig, configs: dict | None = None) -> list[tuple[str, str, float | None]]:
    """(label, method name, KV budget): `full` once, every other method once per budget; or, given
    `configs` (label -> method instance), one run per configuration under its own label."""
    if configs is not None:
        return [(label, m.name, getattr(m, "kv_budget", None)) for label, m in configs.items()]
    runs = []
    for name in cfg.methods:
        if name == "full":
            runs.append(("full", "full", None))
        else:
            runs += [(f"{name}@{Budget(b)}", name, b) for b in cfg.kv_budgets]
            if not methods_registry.restarts(methods_registry.METHODS[name].cls):  # GemFilter: no archive
                # labels spell budgets as they parse back ("+recall1.0": every entry, "+recall1": one)
                runs += [(f"{name}@{Budget(b)}+recall{Budget(r)}", name, b) for b in cfg.kv_budgets for r in cfg.recall]
    return runs


def recall_of(label: str):
    """The recall budget a run's label asks for ("snapkv@0.1+recall0.05" -> 0.05), or None."""
    if "+recall" not in label:
        return None
    return Budget.parse(label.rsplit("+recall", 1)[1], "recall").value


def make_method(cfg: EvalConfig, name: str, kv_budget: float | None):
    window = {"window": cfg.window} if cfg.window is not None and methods_registry.takes(name, "window") else {}
    return methods_registry.build(name, kv=kv_budget, struct=cfg.struct_budget, **window)


# ------------------------------------------------------------------------------ samples


def build_samples(cfg: EvalConfig, tokenizer, progress: bool = False) -> list[dict]:
    """Every sample of the run, each with `input_ids`, gold `outputs`, `metric` and its key fields.
    With `progress`, a line on stderr says what is being built (a large run takes minutes here)."""
    tasks = cfg.tasks or cfg.all_tasks()
    wrap = chat_wrapper(tokenizer) if cfg.chat else None
    out = []
    for length in cfg.lengths:
        out += cfg.bench.samples(cfg, tokenizer, tasks, length, wrap, progress)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return out


def chat_scope(cfg: EvalConfig) -> str:
    """What --chat wraps, for headings, where LongBench tasks are in the run."""
    if not cfg.bench.longbench:
        return ""
    return " (every task)" if cfg.chat_every_task else " (LongBench's few-shot and code tasks plain, as its pred.py)"


def score(sample: dict, prediction: str) -> float:
    """The sample's metric in [0, 1]."""
    metric = sample["metric"]
    if metric == "string_match_all":
        return metrics.string_match_all(_printable(prediction), sample["outputs"])
    if metric == "string_match_part":
        return metrics.string_match_part(_printable(prediction), sample["outputs"])
    if metric == "needle":
        return float(sample["outputs"][0] in prediction.replace(",", ""))
    return metrics.longbench_score(sample["task"], prediction, sample["outputs"], sample.get("all_classes"))


def _printable(text: str) -> str:
    return "".join(ch for ch in text if ch.isprintable() or ch in "\n\t").strip()


# ------------------------------------------------------------------------------ running


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, todo: int | None = None, enabled: bool = True):
        """`todo`: the steps that compute (the others were done before); the time left is
        estimated from those alone."""
        self.total, self.todo, self.enabled = total, total if todo is None else todo, enabled
        self.t0 = time.perf_counter()
        self.count = self.computed = 0
        self.tty = sys.stderr.isatty()

    def step(self, what: str, skipped: bool = False) -> None:
        self.count += 1
        self.computed += not skipped
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        left = f"~{elapsed / self.computed * (self.todo - self.computed) / 60:.1f} min left" if self.computed else "..."
        width = 24
        bar = "#" * int(width * self.count / self.total)
        line = (f"[{bar:<{width}}] {self.count}/{self.total} {what}{' (done before)' if skipped else ''} "
                f"{elapsed / 60:.1f} min, {left}")
        print(("\r" + line[:160].ljust(160)) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def close(self):
        if self.enabled and self.tty:
            print(file=sys.stderr)


def run(cfg: EvalConfig, out: str | os.PathLike, model=None, *, progress: bool = True,
        configs: dict | None = None, report_labels=None) -> dict:
    """Run (or resume) the evaluation into `out`; returns the metrics (also written as files).

    configs: label -> method instance, run instead of the registry's `cfg.methods` x `cfg.kv_budgets`
    (a development sweep over one method's options, benchmarks/structkv_dev.py); each label names
    its run in the records and tables ("name@budget" reads as a method at a budget).
    report_labels: the labels the metrics and tables cover (default: this run's), e.g. every label
    a development folder holds, so a sweep continued with fewer labels keeps the others' rows.
    """
    if model is None:
        from ...models import load
        model = load(cfg.model, weights=cfg.weights, kv_dtype=cfg.kv_dtype)
    if model.kv_dtype != cfg.kv_dtype:  # results are labelled with the config's: they must be the model's
        raise ValueError(f"the model's kv_dtype {model.kv_dtype!r} is not the config's {cfg.kv_dtype!r}; "
                         "set one to the other")
    cfg.validate(model.config)
    if model.tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer; evaluation needs one (tokenizer.json in its folder)")
    out = Path(out)
    done = open_output(cfg, out)
    samples = build_samples(cfg, model.tokenizer, progress)
    runs = method_runs(cfg, configs)

    def method(label, name, budget):
        return configs[label] if configs is not None else make_method(cfg, name, budget)

    to_compute = sum(sample_key(label, sample) not in done for label, _, _ in runs for sample in samples)
    bar = Progress(len(runs) * len(samples), to_compute, progress)
    with (out / "predictions.jsonl").open("a") as sink:
        def file(label, name, budget, sample, result, graphs, **extra):
            s = result.stats
            if s.get("method") != name:
                raise RuntimeError(f"asked for method {name!r} but the run reported {s.get('method')!r}")
            record = {
                "key": sample_key(label, sample), "method": s["method"], "label": label, "kv_budget": budget,
                "struct_budget": cfg.struct_budget if methods_registry.has_struct_budget(name) else None,
                "length_budget": sample["length_budget"], "task": sample["task"], "index": sample["index"],
                "depth": sample.get("depth"),
                "prompt_tokens": len(sample["input_ids"]) + len(sample.get("question_ids", [])),
                "prediction": result.text, "outputs": sample["outputs"], "score": score(sample, result.text),
                "prefill_s": s["prefill_s"], "decode_tokens_per_s": s["decode_tokens_per_s"],
                "new_tokens": s["new_tokens"], "kv_cache_bytes": s["kv_cache_bytes"],
                "kv_bytes_kept": s["kv_bytes_kept"],
                "prefill_fraction": s.get("prefill_fraction", 1.0), "pivot_layer": s.get("pivot_layer"),
                "compiled": _graphs_compiled() != graphs,  # this call's times include compilation
                **({"question_s": s["question_s"]} if s.get("question_s") is not None else {}),
                **extra,
            }
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            done[record["key"]] = record
            bar.step(_what(label, sample))

        if cfg.shared:
            room = _question_room(samples)
            last = None  # (context, labels, states): the state a query-agnostic context's next question reuses
            for sample in samples:
                todo = []
                for label, name, budget in runs:
                    if sample_key(label, sample) in done:
                        bar.step(_what(label, sample), skipped=True)
                    else:
                        todo.append((label, name, budget, method(label, name, budget)))
                if not todo:
                    continue
                graphs = _graphs_compiled()
                question, context = sample.get("question_ids"), tuple(sample["input_ids"])
                labels = tuple(t[0] for t in todo)
                reused = question is not None and last is not None and last[:2] == (context, labels)
                recalls = [recall_of(t[0]) for t in todo]
                if not reused:  # compressed once per context: its other questions reuse the states
                    states = _compress_all(model, sample["input_ids"], [t[3] for t in todo],
                                           _cap(cfg, sample) + room.get(context, 0), cfg.compile,
                                           cfg.archive if any(r is not None for r in recalls) else None, recalls)
                    last = (context, labels, states)
                results = _answer(model, last[2], _cap(cfg, sample), cfg.compile, question,
                                  [r or 0 for r in recalls])  # states made now or reused
                for (label, name, budget, _), result in zip(todo, results):
                    s = result.stats
                    file(label, name, budget, sample, result, graphs, decode_tokens_per_s=None, shared=True,
                         decode_rows=s["decode_rows"], decode_s=s["decode_s"], state_reused=reused,
                         **{k: s[k] for k in RECALL_FIELDS if k in s})
        else:
            for label, name, budget in runs:
                m = method(label, name, budget)
                for sample in samples:
                    if sample_key(label, sample) in done:
                        bar.step(_what(label, sample), skipped=True)
                        continue
                    graphs = _graphs_compiled()
                    result = _run_alone(model, sample, m, _cap(cfg, sample), cfg.compile)
                    file(label, name, budget, sample, result, graphs)
    bar.close()
    return _report(cfg, out, done, configs=configs, labels=report_labels)


def report(cfg: EvalConfig, out: str | os.PathLike, *, write: bool = True, configs: dict | None = None) -> dict:
    """Rebuild metrics.json, summary.md and the plots from the predictions so far, computing
    nothing (e.g. while a long run is still going, or after it was stopped). The settings must be
    the folder's own, as for a rerun. `write=False` only returns (and the CLI prints) the
    metrics, so a read-only folder can be reported on."""
    out = Path(out)
    if not (out / "predictions.jsonl").exists():
        raise FileNotFoundError(f"{out} has no predictions.jsonl; run the evaluation first")
    check_settings(cfg, out)
    if write and not os.access(out, os.W_OK):
        raise PermissionError(f"{out} is not writable; add --no-write to print the report without writing files")
    return _report(cfg, out, read_predictions(out / "predictions.jsonl"), write=write, configs=configs)


def _wanted(cfg: EvalConfig, configs: dict | None = None, labels=None) -> set[str]:
    """The keys of every prediction the run asks for (a task may hold fewer samples than asked),
    for its own labels or for `labels` (every label a development folder holds)."""
    depths = cfg.depths if cfg.bench.per_depth else [None]
    per_task = {task: cfg.task_samples(task) for task in (cfg.tasks or cfg.all_tasks())}  # one file read per task
    if labels is None:
        labels = [label for label, _, _ in method_runs(cfg, configs)]
    return {sample_key(label, {"length_budget": n, "task": task, "index": i,
                               **({"depth": d} if d is not None else {})})
            for label in labels for n in cfg.lengths for task, count in per_task.items()
            for d in depths for i in range(cfg.first, cfg.first + count)}


def _report(cfg: EvalConfig, out: Path, done: dict[str, dict], *, write: bool = True,
            configs: dict | None = None, labels=None) -> dict:
    wanted = _wanted(cfg, configs, labels)
    records = [r for k, r in done.items() if k in wanted]
    if not records:
        raise ValueError(f"{out} holds no predictions for these settings yet")
    result = aggregate(records)
    if not write:
        return result
    write_text_atomic(out / "metrics.json", json.dumps(result, indent=2))
    write_text_atomic(out / "summary.md", summary_markdown(result, cfg))
    try:
        from .plots import plot_all
        result["plots"] = plot_all(result, records, out)
    except ImportError as e:  # matplotlib is in the eval/demo extras
        print(f"structkv: plots skipped ({e}); pip install matplotlib", file=sys.stderr)
    return result


def _what(label: str, sample: dict) -> str:
    return f"{label} {sample['task']} n={sample['length_budget']} #{sample['index']}"


def _cap(cfg: EvalConfig, sample: dict) -> int:
    """New tokens for a sample: the task's own generation length, capped by --max-new-tokens."""
    return sample["max_new_tokens"] if cfg.max_new_tokens is None else min(cfg.max_new_tokens, sample["max_new_tokens"])


def _question_room(samples: list[dict]) -> dict[tuple, int]:
    """Per query-agnostic context, its longest question: the room its compressed states keep, so
    every question asked of the context fits one state."""
    out: dict[tuple, int] = {}
    for sample in samples:
        if sample.get("question_ids") is not None:
            key = tuple(sample["input_ids"])
            out[key] = max(out.get(key, 0), len(sample["question_ids"]))
    return out


# What a recall run adds to its records: the budget, what it recalled and the archive it read.
RECALL_FIELDS = ("recall", "recalled_entries", "kv_bytes_recalled", "archive_bytes", "archive_entries",
                 "archive_bytes_read", "question_s", "recall_kernel")


def _compress_all(model, input_ids: list[int], methods: list, room: int, compile, archive=None,
                  recalls=None) -> list:
    """One prefill pass of every method over `input_ids` (methods share the layers before their
    propagation), each state with `room` free slots; with `archive`, the states of the runs that
    recall (`recalls`, one per method; None: none) keep their evicted entries."""
    from ...runtime.compress import compress_shared
    from ...text.prompts import encode_batch

    tokens, positions, _ = encode_batch(model, [input_ids])
    recalls = recalls or [None] * len(methods)
    kinds = [archive if r is not None and not methods_registry.restarts(m) else None for m, r in zip(methods, recalls)]
    states = compress_shared(model, tokens, positions, methods, room=room, compile=compile, archive=kinds)
    for state, recall in zip(states, recalls):
        state.recall = recall if state.archive is not None else None
    return states


def _answer(model, states: list, max_new_tokens: int, compile, question=None, recall=None) -> list:
    """One stacked decode of every state, after `question` (appended uncompressed to each, with
    `recall` from the states' archives; the states are not modified, so a context's next question
    can reuse them)."""
    from ...runtime.generation import generate_states

    return generate_states(model, states, max_new_tokens=max_new_tokens, compile=compile, question=question,
                           recall=recall)


def _run_alone(model, sample: dict, method, max_new_tokens: int, compile):
    """One method on one sample: the whole prompt compressed, or (query-agnostic) the context
    compressed and the question appended to it."""
    from ... import prefill
    from ...runtime.generation import generate

    question = sample.get("question_ids")
    if question is None:
        return generate(model, sample["input_ids"], max_new_tokens=max_new_tokens, method=method, compile=compile)
    state = prefill(model, sample["input_ids"], method, room=len(question) + max_new_tokens, compile=compile)
    result = generate(model, question, state=state, max_new_tokens=max_new_tokens, compile=compile)
    # prefill_s: the context's compression, as in the shared mode; the question's extension is question_s
    result.stats = {**result.stats, "question_tokens": len(question)}
    return result


def _graphs_compiled() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# ------------------------------------------------------------------------------ tables


def aggregate(records: list[dict]) -> dict:
    """Scores x100 per (method label, length, task), their average, and speed/memory stats (times:
    medians over the calls that did not compile, when there are any; the rest: means)."""
    rows: dict[str, dict] = {}
    for r in records:
        run = r["label"].split("@")[0] + ("+recall" + r["label"].rsplit("+recall", 1)[1] if "+recall" in r["label"]
                                          else "")
        row = rows.setdefault(f"{r['label']}|{r['length_budget']}", {
            "label": r["label"], "run": run, "method": r["method"], "kv_budget": r["kv_budget"],
            "struct_budget": r["struct_budget"], "length": r["length_budget"], "tasks": {}, "_recs": []})
        if row["method"] != r["method"]:
            raise ValueError(f"label {r['label']!r} holds results of two methods: {row['method']!r} and "
                             f"{r['method']!r}")
        row["tasks"].setdefault(r["task"], []).append(r["score"])
        row["_recs"].append(r)
    table = []
    for row in rows.values():
        recs = row.pop("_recs")
        row["n"] = {t: len(v) for t, v in row["tasks"].items()}
        row["tasks"] = {t: 100 * sum(v) / len(v) for t, v in sorted(row["tasks"].items())}
        row["average"] = sum(row["tasks"].values()) / len(row["tasks"])
        warm = [r for r in recs if not r.get("compiled")] or recs  # times of calls that compiled mislead
        for stat in ("prefill_s", "decode_tokens_per_s"):  # median: one call slowed by the machine moves it little
            row[stat] = median([r[stat] for r in warm])
        row["timed_calls"] = len(warm)
        for stat in ("prefill_fraction", "kv_cache_bytes", "prompt_tokens"):
            row[stat] = mean([r[stat] for r in recs])
        kept = [r["kv_bytes_kept"] for r in recs if r.get("kv_bytes_kept") is not None]  # older folders lack it
        row["kv_bytes_kept"] = mean(kept) if len(kept) == len(recs) else None
        for stat in ("archive_bytes", "kv_bytes_recalled", "question_s"):  # recall runs only
            values = [r[stat] for r in recs if r.get(stat) is not None]
            row[stat] = mean(values) if values else None
        table.append(row)
    table.sort(key=lambda r: (r["length"], r["kv_budget"] or 0, r["label"]))
    return {"rows": table}


def summary_markdown(result: dict, cfg: EvalConfig | None = None) -> str:
    rows = result["rows"]
    tasks = sorted({t for r in rows for t in r["tasks"]})
    recall = any(r.get("archive_bytes") is not None for r in rows)
    # A shared run decodes every method in one stacked batch: no method has a decode speed of its
    # own (`--separate` measures them), so the column is left out rather than shown as "-" everywhere.
    speeds = any(r["decode_tokens_per_s"] is not None for r in rows)
    head = ["method", "R_KV", "length", *tasks, "avg", "samples", "prefill s", "prefill frac", "KV MiB kept",
            "KV MiB alloc", *(["decode tok/s"] if speeds else []),
            *(["archive MiB", "recalled MiB", "question s"] if recall else [])]
    lines = []
    if cfg is not None:
        asked = set(cfg.tasks or cfg.all_tasks())
        per_task = {t: cfg.task_samples(t) * (len(cfg.depths) if cfg.bench.per_depth else 1) for t in asked}
        partial = " (not all scored yet: see the samples column)" if any(
            r["n"] != per_task for r in rows) else ""
        what = cfg.bench.what(cfg)
        chat = ", prompts in the model's chat template" + chat_scope(cfg) if cfg.chat else ""
        if cfg.question_after:
            chat += ", question appended after compression (query-agnostic)"
        lines.append(f"# {cfg.benchmark} on {cfg.model}: {what} per task{partial}, R_struct {cfg.struct_budget}"
                     f"{chat}\n")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], "-" if r["kv_budget"] is None else f"{r['kv_budget']:g}", str(r["length"])]
        cells += [f"{r['tasks'][t]:.1f}" if t in r["tasks"] else "" for t in tasks]
        cells += [f"{r['average']:.1f}", str(sum(r["n"].values())), f"{r['prefill_s']:.2f}",
                  f"{r['prefill_fraction']:.2f}",
                  "-" if r.get("kv_bytes_kept") is None else f"{r['kv_bytes_kept'] / 2**20:.2f}",
                  f"{r['kv_cache_bytes'] / 2**20:.1f}"]
        if speeds:
            cells.append(f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] is not None else "-")
        if recall:
            cells += ["-" if r.get(k) is None else f"{r[k] / d:.{p}f}" for k, d, p in (
                ("archive_bytes", 2**20, 2), ("kv_bytes_recalled", 2**20, 3), ("question_s", 1, 3))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
