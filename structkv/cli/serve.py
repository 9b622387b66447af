"""`structkv serve`: the OpenAI-compatible server."""
from __future__ import annotations

import os
import sys

from .options import (
    ARCHIVE_KINDS,
    DECODE_RULES,
    _budget_options,
    _bytes,
    _method_names,
    _non_negative_int,
    _port,
    _positive_bytes,
    _positive_int,
    _seconds,
    _weights_option,
    _writable_folder,
)


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


def add_parser(sub) -> None:
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
