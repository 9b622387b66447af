"""Tokenizer on the `tokenizers` library, from a HF `tokenizer.json` or from GGUF metadata.

GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`, e.g. Gemma 3) store
tokens, scores (= -rank) and token types, but no merges. Converting that as a Unigram model splits
words into characters and the model then outputs garbage. We rebuild the BPE model instead: every
split of a vocabulary token into two vocabulary pieces is a merge, ranked by the token's score.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..util.files import read_json_object

# End-of-turn tokens of common chat templates (Gemma, ChatML, Llama 3, Phi).
TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")
# Pre-tokenizers of byte-level BPE vocabularies by GGUF `tokenizer.ggml.pre` (the split regexes are
# those of the models' own tokenizer.json files; "smollm" is checked against transformers).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# SentencePiece token types as stored in GGUF.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class Tokenizer:
    """Text <-> ids. `encode` adds BOS where the model expects it; `decode` drops special tokens."""

    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_ids: tuple[int, ...], pad_id: int | None,
                 add_bos: bool, chat_template: str | None = None):
        self._tok = tok
        self.bos_id, self.eos_ids, self.pad_id, self.add_bos = bos_id, tuple(eos_ids), pad_id, add_bos
        self.chat_template = chat_template  # a jinja2 template (HF's tokenizer_config / GGUF metadata)
        self._plain_tok = None  # a copy matching no control token in text, made when first needed

    def token(self, i: int) -> str | None:
        """The string of token id `i` (special tokens included)."""
        return self._tok.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; `special=False` encodes text that spells a control token
        ("<|im_end|>") as the plain text it is (a chat message's content)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = (self._tok if special else self._plain()).encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def _plain(self) -> HFTokenizer:
        """A copy of the tokenizer that matches no control token in text (made once)."""
        if self._plain_tok is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_tok = plain
        return self._plain_tok

    def special_texts(self) -> list[str]:
        """The strings of the control tokens (the ones encode turns into a single control id)."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def longest_token(self) -> int:
        """Characters in the vocabulary's longest token string (a token string has at least as many
        characters as the text it decodes to): a text of n characters takes at least n / this
        many tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def tokens(self, text: str) -> list[str]:
        """The token strings of `text` (no BOS); handy for checking a tokenizer by eye."""
        return self._tok.encode(text, add_special_tokens=False).tokens

    # ------------------------------------------------------------------ readers
    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @classmethod
    def from_file(cls, path: str | Path, *, bos_id=None, eos_ids=(), pad_id=None, add_bos=None,
                  chat_template: str | None = None) -> "Tokenizer":
        """Load `tokenizer.json`; BOS handling and the chat template follow `tokenizer_config.json`
        (and `chat_template.jinja`) beside it when present."""
        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a valid tokenizer.json ({e}); re-download it") from None
        if add_bos is not None:  # decided by the caller (e.g. GGUF metadata)
            return cls(tok, bos_id=bos_id, eos_ids=tuple(eos_ids), pad_id=pad_id, add_bos=add_bos,
                       chat_template=chat_template)
        add_bos = None
        cfg_path = path.parent / "tokenizer_config.json"
        jinja = path.parent / "chat_template.jinja"
        if jinja.exists():
            chat_template = jinja.read_text(encoding="utf-8")
        if cfg_path.exists():
            tcfg = read_json_object(cfg_path)
            if chat_template is None and isinstance(tcfg.get("chat_template"), str):
                chat_template = tcfg["chat_template"]
            add_bos = tcfg.get("add_bos_token")
            bos_tok = tcfg.get("bos_token")
            if isinstance(bos_tok, dict):
                bos_tok = bos_tok.get("content")
            if isinstance(bos_tok, str) and tok.token_to_id(bos_tok) is not None:
                bos_id = tok.token_to_id(bos_tok)
        if add_bos is None and bos_id is not None:  # no explicit setting: do what the post-processor does
            add_bos = bos_id in tok.encode("a", add_special_tokens=True).ids
        return cls(tok, bos_id=bos_id, eos_ids=eos_ids, pad_id=pad_id, add_bos=bool(add_bos) and bos_id is not None,
                   chat_template=chat_template)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Build from GGUF `tokenizer.ggml.*` metadata: SentencePiece vocabularies ("llama", as in
        Gemma 3) or byte-level BPE ("gpt2", as in SmolLM2, Llama 3, Qwen2)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind == "llama":
            tok = _sentencepiece_bpe(fields)
        elif kind == "gpt2":
            tok = _byte_level_bpe(fields)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (llama: SentencePiece, gpt2: "
                             "byte-level BPE); use a HF folder with tokenizer.json instead")
        vocab = tok.get_vocab()
        eos = fields.get("tokenizer.ggml.eos_token_id")
        turn_ends = (vocab[t] for t in TURN_ENDS if t in vocab)  # chat turns end there too
        eos_ids = tuple(dict.fromkeys(i for i in (eos, *turn_ends) if i is not None))
        return cls(tok, bos_id=fields.get("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids,
                   pad_id=fields.get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   chat_template=fields.get("tokenizer.chat_template"))


def _sentencepiece_bpe(fields: dict) -> HFTokenizer:
    """The BPE rebuild described in the module docstring."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "llama":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; only SentencePiece vocabularies "
            "('llama', as in Gemma 3) can be rebuilt. Use a HF folder with tokenizer.json instead."
        )
    missing = [k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
               if k not in fields]
    if missing:
        raise ValueError(f"GGUF metadata key {missing[0]!r} is missing (needed to rebuild the tokenizer)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    scores: list[float] = fields["tokenizer.ggml.scores"]
    types: list[int] = fields["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty in (_NORMAL, _USER_DEFINED)}
    candidates = []  # (score, token id, left, right)
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != _NORMAL or len(t) < 2:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-scores[i], i, left, right))
    candidates.sort()
    merges = [(left, right) for _, _, left, right in candidates]
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                     byte_fallback=True, fuse_unk=True)
    tok = HFTokenizer(bpe)
    norm = [normalizers.Replace(" ", "▁")]
    if fields.get("tokenizer.ggml.add_space_prefix", False):
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


def _pre_tokenizer(name: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = lambda pattern: pre_tokenizers.Sequence([  # noqa: E731
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    table = {
        "default": lambda: byte_level, "gpt-2": lambda: byte_level, "gpt2": lambda: byte_level,
        "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        "llama-bpe": lambda: split(_LLAMA3_SPLIT), "llama3": lambda: split(_LLAMA3_SPLIT),
        "qwen2": lambda: split(_QWEN2_SPLIT),
    }
    if name not in table:
        raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported ({', '.join(table)}); use a HF folder "
                         "with tokenizer.json instead")
    return table[name]()


def _byte_level_bpe(fields: dict) -> HFTokenizer:
    """A GPT-2 style byte-level BPE from the GGUF vocabulary, merges and pre-tokenizer name."""
    missing = [k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if k not in fields]
    if missing:
        raise ValueError(f"GGUF metadata key {missing[0]!r} is missing (needed to rebuild the tokenizer)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok
