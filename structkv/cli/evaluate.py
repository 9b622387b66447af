"""`structkv demo` (every method on a few RULER tasks with the embedded model) and `structkv eval`."""
from __future__ import annotations

import importlib
import time

from .options import ARCHIVE_KINDS, DATA_HELP, _budget_options, _csv, _positive_int, _weights_option, _writable_folder

DEMO_METHODS = ["full", "streaming_llm", "snapkv", "pyramidkv", "h2o", "gemfilter", "fastkv", "structkv",
                "structkv_paper"]
DEMO_TASKS = ["niah_single_1", "niah_single_2"]  # tasks the 270M model solves with the full cache


def _demo(args) -> int:
    """Every method at one KV budget on a few RULER tasks with the embedded model: the comparison table."""
    import torch

    from structkv.harness.eval.runner import EvalConfig, run, summary_markdown

    _writable_folder(args.out, "--out")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = EvalConfig(benchmark="ruler", model=args.model, methods=DEMO_METHODS, kv_budgets=[args.kv_budget],
                     struct_budget=args.struct_budget, lengths=[args.tokens], tasks=DEMO_TASKS, samples=args.samples,
                     max_new_tokens=24, data_dir=args.data, compile=not args.eager)
    t0 = time.perf_counter()
    result = run(cfg, args.out, progress=True)
    print(f"\nRULER {', '.join(DEMO_TASKS)} at {args.tokens} tokens, {args.samples} samples each, "
          f"R_KV {args.kv_budget}, R_struct {args.struct_budget} ({time.perf_counter() - t0:.0f} s incl. compiles)\n")
    print(summary_markdown(result))
    print("prefill s is a median over calls that did not compile (every method's answer is decoded in one "
          "shared batch, so no method has a decode speed of its own: `structkv eval --separate` measures them); "
          "KV MiB kept counts the "
          "entries the compression kept in every layer (after FastKV's or StructKV's propagation, Gemma 3's "
          "later sliding-window layers hold only the skeleton's tokens of their window), alloc the buffers.")
    print(f"table, predictions and plots in {args.out}/")
    return 0


def _eval(args) -> int:
    import torch

    from structkv.harness.eval.runner import EvalConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_write:
        _writable_folder(args.out, "--out", "add --no-write to print the report only" if args.report
                         else "choose another folder")
    cfg = EvalConfig(benchmark=args.benchmark, model=args.model, methods=args.methods, kv_budgets=args.kv_budget,
                     struct_budget=args.struct_budget, lengths=args.lengths, tasks=args.tasks, samples=args.samples,
                     depths=args.depths, seed=args.seed, first=args.first, max_new_tokens=args.max_new_tokens,
                     window=args.window,
                     longbench_full=args.longbench_full, data_dir=args.data, compile=not args.eager,
                     shared=not args.separate, chat=args.chat, chat_every_task=args.chat_every_task,
                     question_after=args.question_after_compression,
                     continuation=args.continuation, weights=args.weights, kv_dtype=args.kv_dtype,
                     recall=args.recall or [], archive=args.archive)
    cfg.validate()  # bad names and data folders fail before the model loads
    bench = importlib.import_module(f"structkv.harness.eval.{cfg.bench.loop}")
    if args.report:
        result = bench.report(cfg, args.out, write=not args.no_write)
    else:
        result = bench.run(cfg, args.out, progress=not args.quiet)
    print(bench.summary_markdown(result, cfg))
    if not args.no_write:
        plots = ", ".join(result.get("plots", []))
        print(f"results in {args.out}: {cfg.bench.records}, metrics.json, summary.md, {plots}")
    return 0


def add_demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="every method on a few RULER tasks with the embedded Gemma 3 270M")
    d.add_argument("--model", default="gemma-3-270m")
    d.add_argument("--tokens", type=int, default=4096)
    d.add_argument("--samples", type=int, default=2)
    d.add_argument("--data", default=None, help=DATA_HELP)
    d.add_argument("--out", default="demo_results", help="result folder (rerunning resumes)")
    d.add_argument("--threads", type=_positive_int, default=None)
    d.add_argument("--eager", action="store_true", help="skip torch.compile")
    _budget_options(d, 0.1, 0.2)
    d.set_defaults(fn=_demo)


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="accuracy of methods on RULER, LongBench or a needle grid (offline, resumable)")
    from structkv.harness.eval.benchmarks import BENCHMARKS

    e.add_argument("benchmark", choices=list(BENCHMARKS),
                   help="fidelity: KL to the full cache, top-1 agreement and gold NLL on RULER and LongBench prompts "
                        "(docs/evaluation.md)")
    e.add_argument("--model", default="gemma-3-270m", help="alias, HF folder, .gguf file or Hub id")
    e.add_argument("--methods", type=_csv(str), default=["full", "snapkv", "fastkv", "structkv"],
                   help="comma-separated registry names (structkv.methods.names())")
    _budget_options(e, [0.1], 0.2, csv=True)
    e.add_argument("--lengths", type=_csv(int), default=[4096], help="prompt budgets in tokens")
    e.add_argument("--tasks", type=_csv(str), default=None, help="default: every task of the benchmark")
    e.add_argument("--samples", type=int, default=None,
                   help="samples per task (and per depth for niah); default: 10 for ruler and niah, every "
                        "record of each LongBench task")
    e.add_argument("--depths", type=_csv(float), default=[0.0, 0.25, 0.5, 0.75, 1.0], help="niah needle depths")
    e.add_argument("--max-new-tokens", type=int, default=None, help="cap on each task's generation length")
    e.add_argument("--window", type=int, default=None, help="observation window of the scoring methods")
    e.add_argument("--longbench-full", action="store_true", help="LongBench: full task files, not subset/")
    e.add_argument("--chat", action="store_true",
                   help="instruct models: each prompt as one user turn of the model's chat template (ruler, "
                        "longbench, niah); RULER's answer prefix follows the opened assistant turn; LongBench's "
                        "few-shot and code tasks stay plain, as LongBench's pred.py does")
    e.add_argument("--chat-every-task", action="store_true",
                   help="with --chat: wrap LongBench's few-shot and code tasks (trec, triviaqa, samsum, lcc, "
                        "repobench-p) too")
    e.add_argument("--question-after-compression", action="store_true",
                   help="query-agnostic (ruler, longbench): compress the context without the question, then "
                        "append the question (and, with --chat, the end of the turn) uncompressed; default: "
                        "the whole prompt is compressed (query-aware)")
    e.add_argument("--recall", type=_csv(str), default=None,
                   help="with --question-after-compression: each compressing method also runs with ask-time recall "
                        "at these budgets (entries per archived layer, ratios like --kv-budget or counts), labelled "
                        "name@R_KV+recall<r>; its evicted entries archived as --archive")
    e.add_argument("--archive", choices=ARCHIVE_KINDS, default="int4",
                   help="how the recall runs store the evicted entries (default int4)")
    e.add_argument("--continuation", type=_positive_int, default=64,
                   help="fidelity: tokens of the full cache's greedy continuation scored per prompt")
    e.add_argument("--seed", type=int, default=42)
    e.add_argument("--first", type=int, default=0,
                   help="first sample index of every task (LongBench records, RULER samples): a development split "
                        "that never shares a prompt with the default run (needs --samples)")
    e.add_argument("--data", default=None, help=DATA_HELP)
    e.add_argument("--out", required=True, help="result folder; rerunning with the same folder resumes")
    e.add_argument("--threads", type=_positive_int, default=None)
    _weights_option(e)
    e.add_argument("--eager", action="store_true")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--no-write", action="store_true",
                   help="with --report: print the table and write nothing (e.g. a read-only folder)")
    e.add_argument("--report", action="store_true",
                   help="compute nothing: rebuild metrics.json, summary.md and plots from the predictions so far")
    e.add_argument("--separate", action="store_true",
                   help="run every method alone (its own prefill and decode, so per-call decode speed); default: "
                        "one prefill pass shared by every method and one stacked decode per sample")
    e.set_defaults(fn=_eval)
