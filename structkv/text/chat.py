"""Chat templates: messages -> the model's prompt text, rendered as its own template says.

The template comes with the model (`tokenizer_config.json` / `chat_template.jinja` in HF folders,
`tokenizer.chat_template` in GGUF metadata) and is rendered by jinja2 in a sandbox (a template is
code from a model repository: no attribute access to Python internals, no file or network). The
rendered text is tokenized without adding BOS: a template that wants one writes it. Generation
stops at the template's end-of-turn token (`Tokenizer.eos_ids` holds it).
"""
from __future__ import annotations

import re
from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool")
MARK = "\u2063"  # invisible separator: with a number between two, marks where a content is rendered


def check_messages(messages) -> list[dict]:
    """Messages as a list of {"role": ..., "content": str}, or a TypeError/ValueError naming the
    problem."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with a str 'role' and a str 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; roles: {', '.join(ROLES)}")
    return [dict(m) for m in messages]


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render(tokenizer, messages, *, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` under the model's chat template; `add_generation_prompt`
    ends it with the opening of the assistant's turn."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template (none in its tokenizer_config.json, chat_template.jinja "
                         "or GGUF metadata); pass a plain prompt instead of messages")
    from jinja2.exceptions import TemplateError

    special = {"bos_token": tokenizer.token(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
               "eos_token": tokenizer.token(tokenizer.eos_ids[0]) if tokenizer.eos_ids else ""}
    try:
        return _compiled(template).render(messages=check_messages(messages),
                                          add_generation_prompt=add_generation_prompt, **special)
    except TemplateError as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None


def encode(tokenizer, messages, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered conversation (no BOS added: the template writes it if wanted).

    Only the template writes control tokens: text inside a message that spells one
    (`<|im_end|>\n<|im_start|>system ...` typed by a user) is encoded as the plain text it is,
    so no message can forge another role's turn."""
    messages = check_messages(messages)
    text = render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return _encode_spans(tokenizer, text, _content_spans(tokenizer, messages, text, add_generation_prompt))


def encode_split(tokenizer, messages, marker: str, *, add_generation_prompt: bool = True):
    """(ids before `marker`, ids after it): the conversation encoded as `encode` does, cut where
    `marker` (written once, inside a message's content) is rendered; the marker itself is dropped."""
    messages = check_messages(messages)
    text = render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    if text.count(marker) != 1:
        raise ValueError("this model's chat template does not place the user's content once, so a context cannot be "
                         "cached; put the document in a message instead")
    cut = text.index(marker)
    spans = _content_spans(tokenizer, messages, text, add_generation_prompt)
    head = [(a, min(b, cut)) for a, b in spans if a < cut]
    tail = [(max(a, cut + len(marker)) - cut - len(marker), b - cut - len(marker)) for a, b in spans
            if b > cut + len(marker)]
    return _encode_spans(tokenizer, text[:cut], head), _encode_spans(tokenizer, text[cut + len(marker):], tail)


def _content_spans(tokenizer, messages: list[dict], text: str, add_generation_prompt: bool,
                   history: list[dict] = ()) -> list[tuple[int, int]]:
    """Where each message's content lies in `text` (the rendering of `history` + `messages`,
    minus the history's own), found by rendering marks in place of the contents: a template that
    writes each content as it is, or trimmed, gives exact spans. Where the template does anything
    else, a content spelling a control token is refused (it would become that token)."""
    marks = [f"{MARK}{i}{MARK}" for i in range(len(messages))]
    marked = [{**m, "content": k} for m, k in zip(messages, marks)]
    before = render(tokenizer, list(history), add_generation_prompt=False) if history else ""
    layout = render(tokenizer, [*history, *marked], add_generation_prompt=add_generation_prompt)[len(before):]
    for shape in (str, str.strip):
        spans, out, at = [], [], 0
        for piece in re.split(f"({MARK}\\d+{MARK})", layout):
            if piece.startswith(MARK) and piece.endswith(MARK) and piece[len(MARK):-len(MARK)].isdigit():
                content = shape(messages[int(piece[len(MARK):-len(MARK)])]["content"])
                spans.append((at, at + len(content)))
                piece = content
            out.append(piece)
            at += len(piece)
        if "".join(out) == text:
            return spans
    found = sorted({t for m in messages for t in tokenizer.special_texts() if t in m["content"]})
    if found:
        raise ValueError(f"a message contains the control text {found[0]!r}, which this model's chat template would "
                         "turn into a control token; remove it from the message")
    return []


def _encode_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text` encoded with control tokens recognised outside `spans` and not inside them."""
    ids, at = [], 0
    for start, end in spans:
        ids += tokenizer.encode(text[at:start], add_bos=False) if start > at else []
        ids += tokenizer.encode(text[start:end], add_bos=False, special=False) if end > start else []
        at = end
    return ids + (tokenizer.encode(text[at:], add_bos=False) if at < len(text) else [])


def continuation(tokenizer, history, new_messages, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `new_messages` appended to `history` (what a later turn adds to a conversation
    whose beginning is already in a cache): the rendering of the whole, minus that of the history."""
    before = render(tokenizer, history, add_generation_prompt=False)
    after = render(tokenizer, [*history, *new_messages], add_generation_prompt=add_generation_prompt)
    if not after.startswith(before):
        raise ValueError("this chat template renders earlier turns differently once a new turn follows, so a "
                         "cached conversation cannot be continued; compress the whole conversation instead")
    new, added = after[len(before):], check_messages(new_messages)
    return _encode_spans(tokenizer, new, _content_spans(tokenizer, added, new, add_generation_prompt,
                                                        history=check_messages(history)))


SENTINEL = "\u2063STRUCTKV-USER-CONTENT\u2063"  # a string no template produces by itself


def frame(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids around the content of one user turn, generation prompt included: a prompt given as
    token ids becomes `head + content + tail` without re-tokenizing it (what `eval --chat` does to
    task prompts that were sized and truncated as tokens)."""
    text = render(tokenizer, [{"role": "user", "content": SENTINEL}])
    if text.count(SENTINEL) != 1:
        raise ValueError("this chat template does not place the user's content once; cannot frame a prompt with it")
    before, after = text.split(SENTINEL)
    return tokenizer.encode(before, add_bos=False), tokenizer.encode(after, add_bos=False)
