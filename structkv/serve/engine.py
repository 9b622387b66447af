"""The model behind the server: requests become jobs, one worker thread runs them in a batch.

Each job is prefilled alone (its own method and budgets, or its cached context extended by the
question), then joins the running batch: every running request gets one token per decode step,
all of them in one step over their stacked caches (`structkv.serve.batcher`, continuous batching),
up to `max_batch` at once; a request leaves the batch when it ends, and a waiting one joins
between two steps. A prefill that arrives while others decode is sliced (`prefill_rows` query
tokens of a layer at a time, `structkv.models.sliced`) and interleaved with their decode steps
(`structkv.serve.interleave`): each slice lasts about `prefill_share` of a decode step, so a long
prompt slows the running streams' tokens by that share instead of stopping them for its whole
prefill; with `prefill_rows` 0 it runs alone, as before. Requests wait in a bounded queue; when
it is full the server answers 503 with Retry-After instead of piling up work. A job cancelled (its
client went away) before it starts is skipped, one being prefilled in slices stops at its next
slice, and a running one leaves the batch at the next step, which frees its place.

A request's tokens are split in two: a context that is compressed once and kept in the
`ContextCache` (an explicit `context` field, or the conversation before the last user turn when
it is long enough), and the rest, appended uncompressed to a copy of the cached state. Without a
context the whole prompt is compressed with the method, question included (query-aware).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..methods import Budget, build, check_budgets, context_archive, context_default, has_struct_budget, names, restarts
from ..models.archive import ArchiveError, check_kind
from ..models.sliced import ROWS, sliced_block
from ..modules.decode_bound import DecodeBound
from ..runtime.compress import prefill
from ..runtime.decoding import backends
from ..runtime.generation import start
from ..runtime.state_file import load_state, save_state
from ..text import chat
from ..text.detokenize import StopText
from .batcher import Batch, Row
from .context_cache import ContextCache, context_key, state_bytes
from .interleave import Interleave, Stopped
from .metrics import Metrics
from .protocol import APIError, Request, bad, usage

log = logging.getLogger("structkv.serve")
SEPARATOR = "\n\n"  # between an explicit context and the first user message's own content


TOKENIZING = 2  # requests tokenized at once (a large document's ids and text are both in memory)
NORMALIZATION_SLACK = 4  # characters a normalizer may fold into one before tokens are counted
# Texts past the character bound's reach are counted in whitespace-cut pieces of COUNT_PIECE
# characters, stopping once the count passes the prompt limit: a text far over the limit costs
# about the limit's worth of tokenizing, not its own (4M characters took ~16 s on the 2-core CPU).
# Pieces tokenized alone count the tokens around each cut differently from the whole text (a few at
# most, the cut is before a space where there is one): CUT_SLACK per cut keeps the count a lower
# bound. Only texts longer than the limit times COUNT_FROM_CHARS_PER_TOKEN are counted (English
# prose is 4-5 characters a token), so a document that fits is rarely tokenized twice.
COUNT_PIECE = 1 << 16
CUT_SLACK = 16
COUNT_FROM_CHARS_PER_TOKEN = 6

@dataclass
class Settings:
    """What `structkv serve` was started with (see its --help)."""

    model_name: str
    method: str = "structkv"  # whole prompts (the question is in what is compressed)
    context_method: str | None = None  # cached contexts (compressed before the question); None: the
    # model's `methods.context_default` at its own R_KV (where no --kv-budget is given)
    kv_budget: float | int | str | None = None  # a `Budget` (ratio or token count), parsed once here
    struct_budget: float | int | str | None = None
    cache_bytes: int = 1 << 30
    max_queue: int = 16
    max_batch: int = 8  # requests decoding together (continuous batching); 1: one at a time
    max_tokens: int = 1024  # per request, new tokens
    default_max_tokens: int = 256  # chat requests without max_tokens
    room: int = 512  # free slots kept after a cached context for a question and its answer
    min_context_tokens: int = 256  # a conversation's history shorter than this is not cached
    compile: object = "auto"
    max_prompt_tokens: int | None = None  # per request, prompt tokens (None: the model's positions)
    # Ask-time recall for cached contexts: their evicted entries archived as `archive`, `recall`
    # of them recalled per archived layer by every question; `archive_dir`: each cached context in a
    # file there (hot set + archive), its archive read from disk, found again after a restart.
    # `archive` None: the contexts' default (`methods.context_archive`: int4 for a method that
    # evicts); "none": no archive, no recall
    archive: str | None = None
    recall: float | int | str | None = None
    archive_dir: str | None = None
    # A KV bound while generating (`structkv.modules.decode_bound`): every request's default, which a
    # request's own "max_kv_tokens" replaces; `decode_evict`: the rule both use
    max_kv_tokens: int | None = None
    decode_evict: str = DecodeBound.rule
    # A prefill arriving while others decode runs this many query tokens of a layer per slice,
    # interleaved with their decode steps; 0: it runs alone and they wait
    prefill_rows: int = ROWS
    # ... its slices last this share of a decode step without a prefill (a running average): the
    # streams' time between tokens then grows to about 1 + share, plus what a prefill running
    # beside them costs their steps (caches), and its own prefill takes about (1 + share) / share
    # times as long. 0.4: the p95 inter-token latency stays under 2x its idle value on Gemma 3
    # 270M at 4K (research/benchmarks_log.md, "Chunked prefill")
    prefill_share: float = 0.4

    def __post_init__(self):
        for name in ("kv_budget", "struct_budget"):
            if getattr(self, name) is not None:
                setattr(self, name, Budget.parse(getattr(self, name), name).value)
        if self.archive != "none":
            check_kind(self.archive)
        elif self.recall is not None or self.archive_dir is not None:
            raise ValueError("--recall and --archive-dir need an archive: drop them, or name --archive int4")
        if self.recall is not None:
            self.recall = Budget.parse(self.recall, "recall").value
        check_budgets(self.kv_budget, self.struct_budget)  # a bad default fails at start-up
        for name in filter(None, (self.method, self.context_method)):
            build(name, kv=self.kv_budget, struct=self.struct_budget)
        if self.max_kv_tokens is not None:
            DecodeBound(self.max_kv_tokens, self.decode_evict)  # a bad bound fails at start-up
        if isinstance(self.prefill_rows, bool) or not isinstance(self.prefill_rows, int) or self.prefill_rows < 0:
            raise ValueError(f"--prefill-rows must be an int >= 0 (0: a prefill runs alone), got {self.prefill_rows!r}")
        if isinstance(self.prefill_share, bool) or not isinstance(self.prefill_share, (int, float)) \
                or not 0 <= self.prefill_share < float("inf"):
            raise ValueError(f"--prefill-share must be a number >= 0 (a prefill slice's share of a decode step), "
                             f"got {self.prefill_share!r}")


@dataclass
class Job:
    req: Request
    method: object  # a structkv Method
    method_key: tuple
    prefix: list[int] | None  # context tokens compressed once and cached; None: compress everything
    rest: list[int]
    max_new: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload=None) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix or ()) + len(self.rest)


class Engine:
    def __init__(self, model, settings: Settings, metrics: Metrics | None = None):
        if model.tokenizer is None:
            raise ValueError("structkv serve needs a model with a tokenizer")
        self.model, self.settings = model, settings
        # the context default of this kind of model, and its own R_KV where the server sets none
        self.context_method, self.context_kv = settings.context_method, None
        if self.context_method is None:
            self.context_method, self.context_kv = context_default(model.config)
        self.metrics = metrics or Metrics()
        self.cache = ContextCache(settings.cache_bytes)
        if settings.archive_dir is not None:
            clean_stale_temp_files(settings.archive_dir)
        try:  # a bad default fails at start-up, not at the first request
            self.method_for(Request(kind="chat", model=settings.model_name))
        except APIError as e:
            raise ValueError(f"--method/--kv-budget: {e.message}") from None
        positions = model.config.max_position_embeddings
        self.prompt_limit = min(settings.max_prompt_tokens or positions, positions)
        self._longest_token = model.tokenizer.longest_token()
        self._tokenizing = threading.Semaphore(TOKENIZING)
        self._queue: queue.Queue = queue.Queue(maxsize=settings.max_queue)
        self._running = 0  # requests in the batch (read by `queued` from the event loop)
        self._step_s = 0.05  # a decode step's running average without a prefill (seconds): a prefill slice's length
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="structkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event loop side
    def method_for(self, req: Request, context: bool = False):
        """The request's method with its budgets (the server's defaults where it gives none: the
        context method for a context compressed before its question, `context`)."""
        name = req.method or (self.context_method if context else self.settings.method)
        if name not in names():
            raise bad("method", f"unknown method {name[:100]!r}; this server has: {', '.join(names())}",
                      code="unknown_method")
        if req.struct_budget is not None and not has_struct_budget(name):
            raise bad("struct_budget", f"method {name} has no structural budget (R_struct: the structkv and fastkv "
                      "methods); leave struct_budget out or choose one of those", code="unsupported_parameter")
        kv = req.kv_budget if req.kv_budget is not None else self.settings.kv_budget
        if kv is None and context and req.method is None:
            kv = self.context_kv  # the context default at its own budget
        struct = req.struct_budget if req.struct_budget is not None else self.settings.struct_budget
        try:
            method = build(name, kv=kv, struct=struct)
        except (ValueError, TypeError) as e:
            raise bad("kv_budget", f"bad budget for {name}: {e}") from None
        budgets = {k: getattr(method, k) for k in ("kv_budget", "struct_budget") if hasattr(method, k)}
        return method, (name, *sorted(budgets.items()))

    def prepare(self, req: Request, loop) -> Job:
        """Check and tokenize a request (in a thread of the server's pool: long documents take a while).
        A text that cannot fit is refused before tokenizing (its characters against the prompt limit
        times the longest token), and at most `TOKENIZING` requests tokenize at once, so large
        bodies cannot pile up in memory."""
        if req.model != self.settings.model_name:
            raise APIError(404, f"model {req.model[:100]!r} is not served here; this server has "
                           f"{self.settings.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        self.method_for(req)  # an unknown method or a bad budget is refused before the tokenizing
        max_new = req.max_tokens or min(self.settings.default_max_tokens, self.settings.max_tokens)
        if max_new > self.settings.max_tokens:
            raise bad("max_tokens", f"max_tokens {max_new} is over this server's limit of {self.settings.max_tokens} "
                      "new tokens per request (structkv serve --max-tokens)")
        if req.max_kv_tokens is not None:
            try:
                DecodeBound(req.max_kv_tokens, self.settings.decode_evict)
            except ValueError as e:
                raise bad("max_kv_tokens", str(e)) from None
        self._refuse_oversized_text(req)
        with self._tokenizing:
            prefix, rest = self._split(req)
        method, key = self.method_for(req, context=prefix is not None)
        limit = self.model.config.max_position_embeddings
        total = len(prefix or ()) + len(rest)
        if total > self.prompt_limit:
            raise APIError(400, f"this request has {total} prompt tokens, over this server's limit of "
                           f"{self.prompt_limit} (structkv serve --max-prompt-tokens)",
                           param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
        if total + max_new - 1 > limit:
            raise APIError(400, f"this request has {total} prompt tokens and asks for {max_new} new ones, over the "
                           f"model's {limit} positions; shorten the context or ask for fewer tokens",
                           param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
        return Job(req, method, key, prefix, rest, max_new, loop)

    def _refuse_oversized_text(self, req: Request) -> None:
        texts = [req.prompt or "", req.context or "", *(m["content"] for m in req.messages or ())]
        chars = sum(map(len, texts))
        # NORMALIZATION_SLACK: a tokenizer's normalizer may merge characters (composed accents)
        most = self.prompt_limit * self._longest_token * NORMALIZATION_SLACK
        param = "messages" if req.kind == "chat" else "prompt"
        if chars > most:
            raise APIError(400, f"this request's text has {chars} characters, more than {self.prompt_limit} prompt "
                           "tokens can hold; refused before tokenizing (shorten the context)",
                           param=param, code="context_length_exceeded")
        if chars > self.prompt_limit * COUNT_FROM_CHARS_PER_TOKEN:
            with self._tokenizing:
                counted = self._tokens_at_least(texts, self.prompt_limit)
            if counted > self.prompt_limit:
                raise APIError(400, f"this request's text has over {self.prompt_limit} prompt tokens, this server's "
                               "limit (structkv serve --max-prompt-tokens); refused after counting the first "
                               f"{counted} (shorten the context)", param=param, code="context_length_exceeded")

    def _tokens_at_least(self, texts: list[str], enough: int) -> int:
        """A lower bound on the tokens of `texts`, counted in whitespace-cut pieces until it passes
        `enough` (so it costs about `enough` tokens' worth of tokenizing)."""
        counted = 0
        for text in texts:
            start = 0
            while start < len(text) and counted <= enough:
                end = len(text) if len(text) - start <= COUNT_PIECE else text.rfind(" ", start + 1, start + COUNT_PIECE)
                end = start + COUNT_PIECE if end <= start else end  # no space in the piece: cut anyway
                cut = end < len(text)
                counted += max(0, len(self.model.tokenizer.encode(text[start:end], add_bos=False, special=False))
                               - CUT_SLACK * cut)
                start = end
        return counted

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy ({self.settings.max_queue} requests waiting); retry shortly",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None

    def _split(self, req: Request) -> tuple[list[int] | None, list[int]]:
        tok = self.model.tokenizer
        try:
            if req.kind == "completion":
                if req.context is None:
                    return None, tok.encode(req.prompt)
                return tok.encode(req.context), tok.encode(req.prompt, add_bos=False)
            if req.context is not None:
                return _split_at_context(tok, req.messages, req.context)
            return self._split_history(tok, req.messages)
        except ValueError as e:  # the chat template refused the conversation, or there is none
            raise bad("messages", str(e), code="invalid_messages") from None

    def _split_history(self, tok, messages):
        """The conversation before the last user turn as the cached context, when it is long enough
        and the template renders it the same way once the new turn follows."""
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        history = messages[:last]
        if history:
            prefix = chat.encode(tok, history, add_generation_prompt=False)
            if len(prefix) >= self.settings.min_context_tokens:
                try:
                    return prefix, chat.continuation(tok, history, messages[last:])
                except ValueError:
                    pass  # this template rewrites earlier turns: compress the whole conversation
        return None, chat.encode(tok, messages)

    def queued(self) -> int:
        return self._queue.qsize() + self._running

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker at its next step. Called when the server shuts down, after its grace
        period: a job still queued or running then has no client left (its request finished or was
        cancelled), so it is dropped, never run for nobody."""
        self._closing.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                self.metrics.add("cancelled")
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        compile = self.settings.compile  # a row class's first graph stalls every stream: compiled only when asked
        batch = Batch(self.model, compile=None if compile in ("auto", False, None) else
                      ("inductor" if compile is True else compile))
        while not self._closing.is_set():
            if not self._admit(batch):
                break
            self._step(batch)
        for row in batch.cancel_all():  # shutting down: what still runs has no client left
            self.metrics.add("cancelled")
            row.tag.job.emit("cancelled")
        self._running = 0

    def _admit(self, batch: Batch) -> bool:
        """Prefill waiting jobs into the batch while it has room (waiting for one when it is empty);
        False when the engine is closing."""
        while len(batch) < self.settings.max_batch:
            try:
                job = self._queue.get() if len(batch) == 0 else self._queue.get_nowait()
            except queue.Empty:
                return True
            if job is None or self._closing.is_set():
                return False
            if job.cancelled.is_set():
                self.metrics.add("cancelled")
                job.emit("cancelled")
                continue
            self._running = len(batch) + 1
            try:
                row = self._start(job) if len(batch) == 0 or not self.settings.prefill_rows else \
                    self._interleaved(job, batch)
                if row is not None:
                    batch.join(row)
            except ValueError as e:  # a limit only the model could check (e.g. cache room)
                job.emit("error", APIError(400, str(e), code="invalid_request"))
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed", job.req.id)
                job.emit("error", _internal(e))
        return True

    def _step(self, batch: Batch, timed: bool = True) -> None:
        """One decode step of the batch; its ended rows answered, its time averaged when `timed`
        (steps between prefill slices are not: a prefill beside them slows them, and slices that
        followed those times would grow with every step)."""
        self._running = len(batch)
        t0 = time.perf_counter()
        try:
            ended = batch.step()
        except Exception as e:  # noqa: BLE001 - the server must keep serving; the log has the traceback
            log.exception("a decode step failed; its %d requests get an error", len(batch))
            for row in batch.cancel_all():
                row.tag.job.emit("error", _internal(e))
            ended = []
        if timed:
            self._step_s += 0.2 * (time.perf_counter() - t0 - self._step_s)
        for row in ended:
            self._finish(row)
        self._running = len(batch)

    def _interleaved(self, job: Job, batch: Batch) -> Row | None:
        """The job's prefill in slices of about `prefill_share` decode steps, the batch's steps run
        between them; None when the job was cancelled (or the server closes) before it ended."""
        share = self.settings.prefill_share

        def step():
            self._step(batch, timed=False)
            self._running = len(batch) + 1

        pause = Interleave(step, lambda: share * self._step_s if len(batch) else float("inf"),
                           stop=lambda: job.cancelled.is_set() or self._closing.is_set())
        try:
            return self._start(job, sliced_block(pause, self.settings.prefill_rows))
        except Stopped:
            self.metrics.add("cancelled")
            job.emit("cancelled")
            return None
        finally:
            self.metrics.add("prefill_interleaved_steps", pause.steps)

    def _start(self, job: Job, block=None) -> Row:
        """The job's prefill (its cached context extended by the rest, or its whole prompt
        compressed), as a batch row that streams its text to the job's client; `block`: how the
        prompt's layers run (`structkv.models.sliced`), None: whole."""
        t0 = time.perf_counter()
        run = _Run(job, StopText(self.model.tokenizer, job.req.stop), queue_s=t0 - job.arrived)
        prefill_backend, step_backend = backends(self.model, self.settings.compile, job.max_new)
        bound = self._bound(job.req)
        backend = dict(max_new_tokens=job.max_new, backend=prefill_backend, decode_backend=step_backend, bound=bound)
        compress = dict(backend, block=block)
        if job.prefix is not None:
            need = len(job.rest) + job.max_new
            archive = self._archive(job)
            key = context_key((self.settings.model_name, *job.method_key, ("archive", archive)), job.prefix)
            state = self.cache.get(key, room=need)
            run.status = "hit" if state is not None else "miss"
            if state is None:
                state = self._stored(key, job, need)
                run.status = "disk" if state is not None else "miss"
            if state is None:
                state = self._compress(key, job, need, block)
            if run.status in ("miss", "disk"):
                self._keep(key, state)
            try:
                started = start(self.model, job.rest, state=state, **backend)
            except ArchiveError as e:  # its file was damaged since it was opened: never answer from it
                log.warning("%s; compressing the context again", e)
                self.cache.discard(key)
                if self.settings.archive_dir is not None:
                    self._file(key).unlink(missing_ok=True)
                state, run.status = self._compress(key, job, need), "miss"
                self._keep(key, state)
                started = start(self.model, job.rest, state=state, **backend)
            run.state = state
        else:
            started = start(self.model, job.rest, method=job.method, **compress)
        run.prefill_s = time.perf_counter() - t0
        req = job.req
        return Row(started, job.max_new, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                   on_token=run.on_token, tag=run, bound=bound)

    def _keep(self, key, state) -> None:
        """Cache a compressed context; one larger than the whole bound is said, not silently dropped."""
        if not self.cache.put(key, state):
            log.warning("a compressed context of %d bytes is over --cache-bytes (%d) on its own: it is not cached, "
                        "so each question compresses it again; raise --cache-bytes or use --archive-dir",
                        state_bytes(state), self.cache.max_bytes)

    def _bound(self, req: Request):
        """The request's KV bound while generating: its own max_kv_tokens, else the server's; None: unbounded."""
        tokens = req.max_kv_tokens or self.settings.max_kv_tokens
        return DecodeBound(tokens, self.settings.decode_evict) if tokens is not None else None

    def _compress(self, key, job: Job, need: int, block=None):
        """The job's context compressed (archived, and written to its file, when the server recalls)."""
        s = self.settings
        archive = self._archive(job)
        if archive is None:
            return prefill(self.model, job.prefix, job.method, room=max(s.room, need), block=block)
        state = prefill(self.model, job.prefix, job.method, room=max(s.room, need), archive=archive,
                        recall=s.recall, block=block)
        if s.archive_dir is not None:
            try:
                save_state(state, self._file(key))
            except OSError as e:  # a full disk, a read-only folder, a file size limit: answer from RAM
                log.warning("could not write the context's file under --archive-dir (%s); keeping it in RAM", e)
        return state

    def _archive(self, job: Job) -> str | None:
        """The archive kind of the job's cached context: the server's (default int4), none for a
        method with nothing to archive (`full`, or GemFilter when a request names it)."""
        return None if restarts(job.method) else context_archive(job.method, self.settings.archive)

    def _stored(self, key, job: Job, need: int):
        """The context's state from its file (a restart, or one dropped from RAM), or None; a file
        that cannot be trusted is removed, and the context is compressed again."""
        path = self._file(key) if self.settings.archive_dir is not None else None
        if path is None or not path.exists():
            return None
        try:
            state = load_state(path, self.model, job.method)
        except ArchiveError as e:
            log.warning("%s; compressing the context again", e)
            path.unlink(missing_ok=True)
            return None
        return state if state.cache.free() >= need else None

    def _file(self, key):
        from pathlib import Path

        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return Path(self.settings.archive_dir) / f"{name}.safetensors"

    def _finish(self, row: Row) -> None:
        run, done = row.tag, time.perf_counter()
        job, started = run.job, row.started
        if row.error is not None:  # this row alone failed; the batch went on without it
            log.error("request %s failed: %s: %s", job.req.id, type(row.error).__name__, row.error)
            job.emit("error", _internal(row.error))
            return
        tail = run.text.finish()
        if tail:
            job.emit("delta", tail)
        if job.cancelled.is_set():
            self.metrics.add("cancelled")
        ps = run.state.stats if run.state is not None else started.prefill
        stats = {"method": job.method_key[0], "options": dict(job.method_key[1:]), "context_cache": run.status,
                 "context_tokens": len(job.prefix or ()), "queue_s": run.queue_s, "prefill_s": run.prefill_s,
                 "time_to_first_token_s": (run.first or done) - job.arrived, "decode_s": done - row.joined,
                 "prefill_fraction": ps.prefill_fraction if ps else 1.0,
                 "pivot_layer": ps.pivot_layer if ps else None, "kv_bytes_kept": started.kept,
                 "kv_bytes_allocated": sum(layer.nbytes() for layer in started.cache.layers),
                 "batch_rows_max": row.peers}
        self._account(job, stats, len(row.tokens), run.status)
        job.emit("done", {"text": run.text.text, "finish_reason": row.finish, "stats": stats,
                          "usage": usage(job.prompt_tokens, len(row.tokens),
                                         len(job.prefix) if run.status in ("hit", "disk") else 0)})

    def _account(self, job: Job, stats: dict, completion_tokens: int, status: str) -> None:
        m = self.metrics
        m.add("prompt_tokens", job.prompt_tokens)
        m.add("completion_tokens", completion_tokens)
        if status != "off":
            m.add(f"context_cache_{ {'hit': 'hits', 'disk': 'disk_hits'}.get(status, 'misses')}")
        m.observe("queue_seconds", stats["queue_s"])
        m.observe("prefill_seconds", stats["prefill_s"])
        m.observe("time_to_first_token_seconds", stats["time_to_first_token_s"])


@dataclass
class _Run:
    """The engine's record of a request in the batch: its text so far (stop strings cut it) and
    the figures its answer reports."""

    job: Job
    text: StopText
    queue_s: float
    status: str = "off"  # the context cache: "off" (no context), "hit" or "miss"
    state: object = None  # the cached context's CompressedState
    prefill_s: float = 0.0  # the cached context's compression (on a miss) and the rest's prefill
    first: float | None = None  # when its first token came

    def on_token(self, token: int | None) -> bool:
        """A new token (None: EOS) -> its text to the client; True ends the row (a stop string,
        a cancelled client)."""
        if token is not None:
            if self.first is None:
                self.first = time.perf_counter()
            delta = self.text.push(token)
            if delta:
                self.job.emit("delta", delta)
        return self.job.cancelled.is_set() or self.text.stopped


STALE_TEMP_S = 600.0  # a temporary file older than this is a killed writer's, not one under way


def clean_stale_temp_files(folder) -> int:
    """Remove the temporary files a killed process left in `folder` (`.<name>.safetensors.XXXX`,
    written then renamed into place by `write_atomic`); a recent one may be another server's
    write under way and is kept. Returns how many were removed."""
    from pathlib import Path

    removed, now = 0, time.time()
    for path in Path(folder).glob(".*.safetensors.*"):
        try:
            if path.is_file() and now - path.stat().st_mtime > STALE_TEMP_S:
                path.unlink()
                removed += 1
        except OSError:
            pass  # gone meanwhile, or not ours to remove: nothing to clean
    if removed:
        log.info("removed %d stale temporary file(s) from %s", removed, folder)
    return removed


def _internal(e: Exception) -> APIError:
    return APIError(500, f"internal error ({type(e).__name__}); the server logged it and keeps serving",
                    type="server_error", code="internal_error")


def _split_at_context(tok, messages, context):
    """Tokens up to the end of `context`, placed at the start of the first user turn, and the rest.

    The conversation is rendered once with a marker after the context; the text before the marker
    is the cached part, so the same document under the same system prompt gives the same tokens."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    marked = [dict(m) for m in messages]
    marked[first]["content"] = context + chat.SENTINEL + SEPARATOR + marked[first]["content"]
    return chat.encode_split(tok, marked, chat.SENTINEL)  # control text in the document or question stays text
