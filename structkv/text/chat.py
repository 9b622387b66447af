"""Chat templates: messages -> the model's prompt text, rendered as its own template says.

The template comes with the model (`tokenizer_config.json` / `chat_template.jinja` in HF folders,
`tokenizer.chat_template` in GGUF metadata) and is rendered by jinja2 in a sandbox (a template is
code from a model repository: no attribute access to Python internals, no file or network). The
rendered text is tokenized without adding BOS: a template that wants one writes it. Generation
stops at the template's end-of-turn token (`Tokenizer.eos_ids` holds it).
"""
from __future__ import annotations

from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool")


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
    """Token ids of the rendered conversation (no BOS added: the template writes it if wanted)."""
    return tokenizer.encode(render(tokenizer, messages, add_generation_prompt=add_generation_prompt), add_bos=False)


def continuation(tokenizer, history, new_messages, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `new_messages` appended to `history` (what a later turn adds to a conversation
    whose beginning is already in a cache): the rendering of the whole, minus that of the history."""
    before = render(tokenizer, history, add_generation_prompt=False)
    after = render(tokenizer, [*history, *new_messages], add_generation_prompt=add_generation_prompt)
    if not after.startswith(before):
        raise ValueError("this chat template renders earlier turns differently once a new turn follows, so a "
                         "cached conversation cannot be continued; compress the whole conversation instead")
    return tokenizer.encode(after[len(before):], add_bos=False)


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
