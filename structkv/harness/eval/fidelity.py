"""Fidelity: how far each method's compressed cache moves the model from the full cache, measured
on a few prompts with little noise (`structkv eval fidelity`).

Per prompt (RULER samples: needles in essays and in repeated text, variable tracking, word
counts, QA over documents; and LongBench records named by `--tasks`: QA over stories, papers and
Wikipedia, summaries, code), the full cache's greedy continuation of K tokens (default 64) and the
gold answer are teacher-forced through every method's compressed cache, all methods' caches
stacked into one batch (`StackedKVCache`, the same prefill pass for all: `compress_shared`):
- KL(full || method), mean over the K continuation positions (nats);
- top-1 agreement: how often the method's argmax is the full cache's token;
- gold NLL: mean negative log-likelihood of the gold answer's tokens (its first 64) after the
  prompt (the full cache's row gives the reference).
With `--question-after-compression` only the context is compressed; the question is appended
uncompressed to every cache (the full one too) before the continuation and the gold answer, whose
tokens alone are scored: the compress-once-ask-many setting.
A task score flips on one token; these move smoothly, so 20-40 prompts separate methods whose
RULER accuracies are within noise. Per method: means with bootstrap 95 % intervals over prompts,
and paired differences against FastKV and SnapKV at the same KV budget (resampling prompts,
each method's value on the same prompt kept together).

The result folder follows the other evals: `records.jsonl` (one line per prompt and method,
appended as it finishes; a rerun resumes), `config.json`, `metrics.json`, `summary.md`,
`fidelity.png`.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from ...util.files import write_text_atomic
from .. import mean
from .result_folder import check_settings, open_output, read_predictions
from .runner import Progress, build_samples, chat_scope, make_method, method_runs

BOOTSTRAP = 2000
GOLD_TOKENS = 64  # gold NLL over at most the answer's first 64 tokens (summaries: (R, S, V) logits fit)
PAIRED_WITH = ("fastkv", "snapkv")


def answer_ids(tokenizer, sample: dict) -> list[int]:
    """The gold answer as the model would write it after the prompt (first gold string, with a
    leading space as RULER's answers follow the answer prefix)."""
    return tokenizer.encode(" " + sample["outputs"][0].strip(), add_bos=False)[:GOLD_TOKENS]


@torch.inference_mode()
def measure(model, ids: list[int], methods: list, continuation: int, gold: list[int], compile=False,
            question: list[int] | None = None) -> list[dict]:
    """{kl, top1, gold_nll} per method for one prompt (the full cache's own row is the reference);
    `question`: appended uncompressed after the compressed `ids` before what is scored."""
    from ...methods import Full
    from ...models.kv_cache import StackedKVCache
    from ...runtime.compress import compress_shared
    from ...text.prompts import encode_batch

    tokens, positions, _ = encode_batch(model, [ids])
    question = list(question or [])
    room = len(question) + continuation + len(gold) + 1
    rows = compress_shared(model, tokens, positions, [Full(), *methods], room=room, compile=compile)
    reference, states = rows[0], rows[1:]  # the full cache's lane shares the pass with the methods
    cont = _decode(model, reference, continuation, question)  # the full cache's own continuation
    outs = []
    for seq in (cont, gold):
        seq = question + seq  # teacher-forced; only the part after the question is scored
        cache = StackedKVCache([s.cache for s in rows])
        R = len(rows)
        first = torch.cat([s.logits for s in rows])[:, None]  # (R, 1, V): the token after the prompt
        if len(seq) > 1:
            pos = torch.cat([s.next_positions for s in rows]) + torch.arange(len(seq) - 1)  # (R, S-1)
            rest = model.extend(torch.tensor([seq[:-1]]).expand(R, -1), pos, cache, every=True)  # (R, S-1, V)
            first = torch.cat([first, rest], 1)
        outs.append(first[:, len(question):])  # (R, S, V) logits of the scored tokens
    logits, gold_logits = outs
    logp = torch.log_softmax(logits.float(), -1)  # (R, K, V)
    target = torch.tensor(cont)
    kl = (logp[0].exp() * (logp[0] - logp)).sum(-1).mean(-1)  # (R,)
    top1 = (logp.argmax(-1) == target).float().mean(-1)
    picked = gold_logits.gather(-1, torch.tensor(gold).expand(len(rows), -1)[..., None])[..., 0]  # (R, S)
    nll = (torch.logsumexp(gold_logits.float(), -1) - picked.float()).mean(-1)  # no (R, S, V) log-softmax copy
    stats = [s.stats for s in states]
    return [{"kl": float(kl[r + 1]), "top1": float(top1[r + 1]), "gold_nll": float(nll[r + 1]),
             "full_gold_nll": float(nll[0]), "prefill_fraction": st["prefill_fraction"],
             "pivot_layer": st.get("pivot_layer"), "kv_bytes_kept": st.kv_bytes} for r, st in enumerate(stats)]


def _decode(model, state, steps: int, prefix: list[int] = ()) -> list[int]:
    """Greedy tokens from a state after `prefix` (fed first), without stopping at EOS (the
    continuation has a fixed length)."""
    cache = state.cache.clone()
    logits, pos, out = state.logits, state.next_positions.clone(), []
    if prefix:
        logits = model.extend(torch.tensor([list(prefix)]), pos + torch.arange(len(prefix)), cache)
        pos = pos + len(prefix)
    for _ in range(steps):
        token = logits.argmax(-1)  # (1,)
        out.append(int(token))
        logits = model.extend(token[:, None], pos, cache)
        pos = pos + 1
    return out


def run(cfg, out, model=None, *, progress: bool = True) -> dict:
    """Run (or resume) the fidelity evaluation of `cfg` (an EvalConfig, benchmark "fidelity")."""
    if model is None:
        from ...models import load
        model = load(cfg.model, weights=cfg.weights, kv_dtype=cfg.kv_dtype)
    if model.kv_dtype != cfg.kv_dtype:  # results are labelled with the config's: they must be the model's
        raise ValueError(f"the model's kv_dtype {model.kv_dtype!r} is not the config's {cfg.kv_dtype!r}; "
                         "set one to the other")
    cfg.validate(model.config)
    out = Path(out)
    done = open_output(cfg, out, name="records.jsonl")
    samples = build_samples(cfg, model.tokenizer, progress)
    runs = [r for r in method_runs(cfg) if r[1] != "full"]
    bar = Progress(len(samples), sum(_key(runs[0][0], s) not in done for s in samples), progress)
    with (out / "records.jsonl").open("a") as sink:
        for sample in samples:
            todo = [r for r in runs if _key(r[0], sample) not in done]
            if not todo:
                bar.step(_what(sample), skipped=True)
                continue
            found = measure(model, sample["input_ids"], [make_method(cfg, name, b) for _, name, b in todo],
                            cfg.continuation, answer_ids(model.tokenizer, sample), cfg.compile,
                            sample.get("question_ids"))
            for (label, name, budget), values in zip(todo, found):
                record = {"key": _key(label, sample), "label": label, "method": name, "kv_budget": budget,
                          "task": sample["task"], "index": sample["index"], "length_budget": sample["length_budget"],
                          "prompt_tokens": len(sample["input_ids"]) + len(sample.get("question_ids", [])),
                          **values}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                done[record["key"]] = record
            bar.step(_what(sample))
    bar.close()
    return _report(cfg, out, done)


def report(cfg, out, *, write: bool = True) -> dict:
    out = Path(out)
    if not (out / "records.jsonl").exists():
        raise FileNotFoundError(f"{out} has no records.jsonl; run the fidelity evaluation first")
    check_settings(cfg, out)
    return _report(cfg, out, read_predictions(out / "records.jsonl"), write=write)


def _key(label: str, sample: dict) -> str:
    return f"{label}/{sample['length_budget']}/{sample['task']}/{sample['index']}"


def _what(sample: dict) -> str:
    return f"{sample['task']} n={sample['length_budget']} #{sample['index']}"


def _report(cfg, out: Path, done: dict, *, write: bool = True) -> dict:
    records = list(done.values())
    if not records:
        raise ValueError(f"{out} holds no fidelity records yet")
    result = aggregate(records, seed=cfg.seed)
    if write:
        write_text_atomic(out / "metrics.json", json.dumps(result, indent=2))
        write_text_atomic(out / "summary.md", summary_markdown(result, cfg))
        try:
            result["plots"] = [plot(result, out)]
        except ImportError as e:
            print(f"structkv: plot skipped ({e}); pip install matplotlib", file=sys.stderr)
    return result


def bootstrap(values: list[float], rng: random.Random, n: int = BOOTSTRAP) -> tuple[float, float]:
    """95 % percentile interval of the mean over resampled prompts."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    means = sorted(mean([rng.choice(values) for _ in values]) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def aggregate(records: list[dict], seed: int = 0) -> dict:
    """Per (label, length): means and bootstrap intervals, and paired differences against the
    baselines at the same budget on the prompts both have."""
    rng = random.Random(seed)
    groups: dict[tuple, dict] = {}
    for r in records:
        groups.setdefault((r["label"], r["length_budget"]), {})[(r["task"], r["index"])] = r
    rows = []
    for (label, length), by_prompt in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0])):
        any_rec = next(iter(by_prompt.values()))
        row = {"label": label, "method": any_rec["method"], "kv_budget": any_rec["kv_budget"], "length": length,
               "prompts": len(by_prompt)}
        for metric in ("kl", "top1", "gold_nll"):
            vals = [r[metric] for r in by_prompt.values()]
            row[metric] = mean(vals)
            row[f"{metric}_ci"] = bootstrap(vals, rng)
        for stat in ("prefill_fraction", "kv_bytes_kept", "full_gold_nll"):
            row[stat] = mean([r[stat] for r in by_prompt.values()])
        row["paired"] = {}
        for base in PAIRED_WITH:
            other = groups.get((f"{base}@{any_rec['kv_budget']:g}", length)) if any_rec["kv_budget"] else None
            if other is None or base == row["method"]:
                continue
            common = sorted(set(by_prompt) & set(other))
            diffs = [by_prompt[p]["kl"] - other[p]["kl"] for p in common]
            if diffs:
                lo, hi = bootstrap(diffs, rng)
                row["paired"][base] = {"kl_diff": mean(diffs), "ci": (lo, hi), "prompts": len(diffs),
                                       "wins": sum(d < 0 for d in diffs)}
        rows.append(row)
    return {"rows": rows}


def summary_markdown(result: dict, cfg=None) -> str:
    lines = []
    if cfg is not None:
        chat = ", chat template" + chat_scope(cfg) if cfg.chat else ""
        lines.append(f"# fidelity on {cfg.model}: prompts of {', '.join(cfg.tasks or ['every task'])}, "
                     f"{cfg.samples} per task, seed {cfg.seed}, {cfg.continuation}-token greedy continuation of "
                     f"the full cache{chat}, R_struct {cfg.struct_budget}\n")
    head = ["method", "R_KV", "length", "prompts", "KL(full||m) [95% CI]", "top-1 agree", "gold NLL (full)",
            "KL - fastkv [95% CI] (wins)", "KL - snapkv [95% CI] (wins)", "prefill frac", "KV MiB kept"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        def paired(base):
            p = r["paired"].get(base)
            if p is None:
                return "-"
            return f"{p['kl_diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] ({p['wins']}/{p['prompts']})"
        cells = [r["method"], f"{r['kv_budget']:g}", str(r["length"]), str(r["prompts"]),
                 f"{r['kl']:.3f} [{r['kl_ci'][0]:.3f}, {r['kl_ci'][1]:.3f}]", f"{r['top1']:.3f}",
                 f"{r['gold_nll']:.2f} ({r['full_gold_nll']:.2f})", paired("fastkv"), paired("snapkv"),
                 f"{r['prefill_fraction']:.2f}", f"{r['kv_bytes_kept'] / 2**20:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nKL in nats per continuation token (lower is closer to the full cache); paired differences "
                 "below 0 favour the row's method; wins = prompts where it had the lower KL.")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> str:
    from .. import pyplot

    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.5))
    labels = [f"{r['label']} ({r['length']})" for r in rows]
    ax.errorbar([r["kl"] for r in rows], range(len(rows)), fmt="o",
                xerr=[[r["kl"] - r["kl_ci"][0] for r in rows], [r["kl_ci"][1] - r["kl"] for r in rows]])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set(xlabel="KL(full || method), nats per token, 95% CI", xscale="log")
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=120)
    plt.close(fig)
    return "fidelity.png"
