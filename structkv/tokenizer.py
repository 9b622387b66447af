"""Tokenizer on the `tokenizers` library, from a HF `tokenizer.json` or from GGUF metadata.

GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`, e.g. Gemma 3) store
tokens, scores (= -rank) and token types, but no merges. Converting that as a Unigram model splits
words into characters and the model then outputs garbage. We rebuild the BPE model instead: every
split of a vocabulary token into two vocabulary pieces is a merge, ranked by the token's score.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from .files import read_json_object

# SentencePiece token types as stored in GGUF.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class Tokenizer:
    """Text <-> ids. `encode` adds BOS where the model expects it; `decode` drops special tokens."""

    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_ids: tuple[int, ...], pad_id: int | None,
                 add_bos: bool):
        self._tok = tok
        self.bos_id, self.eos_ids, self.pad_id, self.add_bos = bos_id, tuple(eos_ids), pad_id, add_bos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def tokens(self, text: str) -> list[str]:
        """The token strings of `text` (no BOS); handy for checking a tokenizer by eye."""
        return self._tok.encode(text, add_special_tokens=False).tokens

    # ------------------------------------------------------------------ readers
    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @classmethod
    def from_file(cls, path: str | Path, *, bos_id=None, eos_ids=(), pad_id=None, add_bos=None) -> "Tokenizer":
        """Load `tokenizer.json`; BOS handling follows `tokenizer_config.json` beside it when present."""
        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
            raise ValueError(f"{path} is not a valid tokenizer.json ({e}); re-download it") from None
        if add_bos is not None:  # decided by the caller (e.g. GGUF metadata)
            return cls(tok, bos_id=bos_id, eos_ids=tuple(eos_ids), pad_id=pad_id, add_bos=add_bos)
        add_bos = None
        cfg_path = path.parent / "tokenizer_config.json"
        if cfg_path.exists():
            tcfg = read_json_object(cfg_path)
            add_bos = tcfg.get("add_bos_token")
            bos_tok = tcfg.get("bos_token")
            if isinstance(bos_tok, dict):
                bos_tok = bos_tok.get("content")
            if isinstance(bos_tok, str) and tok.token_to_id(bos_tok) is not None:
                bos_id = tok.token_to_id(bos_tok)
        if add_bos is None and bos_id is not None:  # no explicit setting: do what the post-processor does
            add_bos = bos_id in tok.encode("a", add_special_tokens=True).ids
        return cls(tok, bos_id=bos_id, eos_ids=eos_ids, pad_id=pad_id, add_bos=bool(add_bos) and bos_id is not None)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Build from GGUF `tokenizer.ggml.*` metadata (SentencePiece-BPE vocabularies)."""
        tok = _sentencepiece_bpe(fields)
        vocab = tok.get_vocab()
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids = (eos,) if eos is not None else ()
        if "<end_of_turn>" in vocab:  # Gemma chat turns end here
            eos_ids += (vocab["<end_of_turn>"],)
        return cls(tok, bos_id=fields.get("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids,
                   pad_id=fields.get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)))


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
