"""`structkv generate`: continue a prompt, or answer questions about a document compressed once."""
from __future__ import annotations

import argparse
import os
import sys

from structkv.util.fetch import cache_root

from .options import (
    ARCHIVE_KINDS,
    DECODE_RULES,
    INT8_HELP,
    TP_HELP,
    _budget_options,
    _method_names,
    _positive_int,
    _rank,
    _seed,
    _weights_option,
    _writable,
    _writable_folder,
)

GENERATE_DOC = """Continue a prompt, streaming tokens to stdout; a stats line (prefill s, prefill fraction,
pivot, KV entries and bytes kept, decode tok/s) goes to stderr.

examples:
  structkv generate "The capital of France is" --max-new-tokens 10
  structkv generate -f report.txt --method structkv --kv-budget 0.1 --max-new-tokens 200
  cat report.txt | structkv generate --method snapkv --kv-budget 0.2 \\
      -q "Who wrote the report?" -q "What does it recommend?"
"""


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


def add_parser(sub) -> None:
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
