"""The OpenAI HTTP API as this server speaks it: requests checked field by field into `Request`,
errors as OpenAI error objects, responses and stream chunks as the `openai` client reads them.

Checking is by hand rather than by a schema library so that every refusal names the field and the
fix in OpenAI's own error shape (`{"error": {"message", "type", "param", "code"}}`) with a 4xx code.
Fields clients send with their neutral values (`n: 1`, `presence_penalty: 0`, ...) are accepted;
features this server does not have are refused when asked for, never silently ignored.
"""
from __future__ import annotations

import math
import numbers
import time
import uuid
from dataclasses import dataclass, field

from ..modules.budget import Budget

# Fields a request may carry beyond OpenAI's (the `openai` client sends them with `extra_body=`).
EXTRA_FIELDS = ("method", "kv_budget", "struct_budget", "context", "max_kv_tokens")
# Accepted only at their neutral value: this server has no such feature.
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "echo": False,
           "best_of": 1, "top_logprobs": 0}
REFUSED = ("tools", "functions", "tool_choice", "function_call", "logit_bias", "suffix", "audio", "prediction")
# OpenAI fields that say who is asking or how to bill and store, not what to generate: accepted,
# with no effect here.
INFORMATIONAL = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
FIELDS = {"chat": ("model", "messages", "max_tokens", "max_completion_tokens"),
          "completion": ("model", "prompt", "max_tokens")}
COMMON = ("temperature", "top_p", "stop", "seed", "stream", "stream_options", "response_format")
SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit integers


class APIError(Exception):
    """An error for the client: HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Request:
    """One generation request, checked. `messages` for chat, `prompt` for completions."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list | None = None
    prompt: str | None = None
    context: str | None = None  # a document compressed once and cached (extra field)
    method: str | None = None  # None: the server's default
    kv_budget: float | int | None = None
    struct_budget: float | int | None = None
    max_tokens: int | None = None
    max_kv_tokens: int | None = None  # a KV bound while generating (extra field); None: the server's
    temperature: float = 1.0
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body, kind: str) -> Request:
    """A JSON body (already decoded) as a `Request`, or an `APIError` naming the bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _refuse_unknown(body, kind)
    _refuse_lone_surrogates(body)
    req = Request(kind=kind, model=_string(body, "model", required=True))
    if kind == "chat":
        req.messages = _messages(body.get("messages"))
        req.max_tokens = _count(body, "max_completion_tokens")
        if req.max_tokens is None:
            req.max_tokens = _count(body, "max_tokens")
    else:
        req.prompt = _prompt(body.get("prompt"))
        req.max_tokens = _count(body, "max_tokens")
        req.max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's completions default
    req.context = _string(body, "context")
    if req.context is not None and not req.context.strip():
        raise bad("context", "context is empty; leave it out or give the document's text")
    req.method = _string(body, "method")
    if req.method is not None and not req.method.strip():
        raise bad("method", "'method' is empty: name a method (GET /v1/models lists the server's) or leave it out "
                  "for the server's default", code="unknown_method")
    req.kv_budget = _budget(body, "kv_budget")
    req.struct_budget = _budget(body, "struct_budget")
    req.max_kv_tokens = _count(body, "max_kv_tokens")
    temperature = _number(body, "temperature", low=0, high=2)
    req.temperature = 1.0 if temperature is None else temperature
    req.top_p = _number(body, "top_p", low=0, high=1, low_open=True)
    req.stop = _stop(body.get("stop"))
    req.seed = _integer(body, "seed")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise bad("seed", f"'seed' must be an integer in [0, 2**64), got {_show(req.seed)}")
    req.stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "stream_options must be an object such as {\"include_usage\": true}")
        if not req.stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        req.include_usage = _flag(options, "include_usage")
    _refuse_unsupported(body)
    return req


def _refuse_unknown(body: dict, kind: str) -> None:
    """Fields this server does not know are refused, never silently ignored (a typo such as
    "max_token" would otherwise change nothing without a word)."""
    known = {*FIELDS[kind], *COMMON, *EXTRA_FIELDS, *NEUTRAL, *REFUSED, *INFORMATIONAL}
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        shown = ", ".join(_show(k) for k in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise bad(unknown[0][:100], f"unknown field(s) {shown} for {kind} requests; this server reads: "
                  f"{', '.join(sorted(known - set(REFUSED)))}", code="unknown_parameter")


def _refuse_lone_surrogates(body) -> None:
    """A JSON string may carry a lone UTF-16 surrogate ("\\ud800"), which no text encoding can
    hold: refused here, naming where, rather than failing deep in the tokenizer."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            stack += [(path or "body", k) for k in value]  # keys are strings too
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(path[:100] or "body", f"{path[:100] or 'the body'} holds a lone UTF-16 surrogate (an "
                          "unpaired \\ud800-\\udfff escape), which is not text; fix the client's encoding") from None


def _show(value, limit: int = 100) -> str:
    """A client's value for an error message, cut to `limit` characters (a message never echoes
    a whole large value back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise bad(name, f"{name}={_show(body[name])} is not supported by this server (only {neutral!r})",
                      code="unsupported_value")
    for name in REFUSED:
        if body.get(name) not in (None, [], {}):
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported",
                  code="unsupported_value")


def _string(body, name, required=False):
    value = body.get(name)
    if value is None:
        if required:
            raise bad(name, f"'{name}' is required", code="missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise bad(name, f"'{name}' must be a string, got {type(value).__name__}")
    return value


def _flag(body, name) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {_show(value)}")
    return value


def _integer(body, name):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {_show(value)}")
    return value


def _count(body, name):
    value = _integer(body, name)
    if value is not None and value < 1:
        raise bad(name, f"'{name}' must be at least 1, got {value}")
    return value


def _budget(body, name):
    """A `Budget` value: a ratio in (0, 1] (0.1) or a token count (512), as everywhere in structkv."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad(name, f"'{name}' must be a number: a ratio in (0, 1] (e.g. 0.1) or a token count (e.g. 512)")
    try:
        return Budget.parse(value, f"'{name}'").value
    except ValueError as e:
        raise bad(name, str(e)) from None


def _number(body, name, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    try:  # an integer of hundreds of digits overflows float: not a number this field can hold
        finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise bad(name, f"'{name}' must be a finite number, got {_show(value)}")
    if low is not None and (value < low or (low_open and value == low)):
        raise bad(name, f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise bad(name, f"'{name}' must be <= {high}, got {value}")
    return float(value)


def _messages(messages) -> list[dict]:
    if messages is None:
        raise bad("messages", "'messages' is required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                          "are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or text parts")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}].role", f"messages[{i}].role {_show(m['role'])} is not one of system, "
                      "developer, user, assistant")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not any(m["role"] == "user" for m in out):
        raise bad("messages", "the conversation needs at least one user message")
    return out


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad("prompt", "'prompt' is required", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise bad("prompt", "'prompt' must be one string (batches of prompts are not supported; send one request "
                  "each)")
    if not prompt:
        raise bad("prompt", "'prompt' is empty")
    return prompt


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad("stop", "'stop' must be a non-empty string or an array of up to 4 non-empty strings")
    return stops


# ---------------------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response(req: Request, text: str, finish_reason: str, usage_: dict, stats: dict) -> dict:
    """The whole answer of a non-streaming request."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": _id(req), "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": usage_, "structkv": stats}


def chunk(req: Request, text: str | None = None, finish_reason: str | None = None, *, role: bool = False,
          usage_: dict | None = None, stats: dict | None = None, choices: bool = True) -> dict:
    """One server-sent event's data: a text delta, the last chunk (finish reason, stats), or the
    usage chunk (no choices)."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    out = {"id": _id(req), "object": obj, "created": req.created, "model": req.model,
           "choices": [choice] if choices else []}
    if usage_ is not None:
        out["usage"] = usage_
    if stats is not None:
        out["structkv"] = stats
    return out


def _id(req: Request) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id
