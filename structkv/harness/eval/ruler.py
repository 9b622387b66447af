"""RULER's 13 synthetic tasks, generated offline and sized with the model's own tokenizer.

Templates, task configs, answer prefixes and metrics follow RULER (hsiehjackson/RULER, Apache-2.0;
see docs/ruler_notes.md). Records have RULER's fields (`index`, `input` = prompt
with the answer prefix appended, `outputs` = gold strings, `length` = prompt tokens) plus
`task`, `answer_prefix`, `question` (the text after the haystack, answer prefix included: what a
query-agnostic run appends after compressing the rest), `max_new_tokens` and `metric`.

Deliberate differences, none of which changes what a task asks:
- every sample has its own seeded `random.Random`, so sample i is the same whether 1 or 500 are
  generated (RULER draws all samples from one stream);
- the haystack size is the largest that fits (binary search), not RULER's coarse 500-word or
  25-sentence steps, so prompts fill the budget more tightly;
- sentence splitting is rule-based (`structkv.harness.eval.text`), not nltk punkt;
- niah word keys are drawn uniformly from all adjective-noun pairs without materialising the
  sorted list of 6 million pairs.

One task of our own, outside RULER's 13 (`EXTRA_TASKS`, asked for by name): `niah_many`, the
compress-once-ask-many task. A context holds four needles (word key -> 7-digit number, as
niah_multikey_1 but every key is real) and each is asked on its own: samples 4c..4c+3 share
context c and ask its keys 0..3, so a query-agnostic run answers four questions from one
compressed state (the runner reuses it), as `structkv serve` does with a cached document.
"""
from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...util.files import read_json
from .sources import ruler_file
from .text import split_sentences

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
                    "{num_v} variables are assgined the value {query}, they are: ")  # upstream's typo, kept
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: 40 evenly spaced depths, 0..100 percent


@dataclass(frozen=True)
class Task:
    kind: str  # niah, vt, cwe, fwe, qa
    max_new_tokens: int
    metric: str  # string_match_all or string_match_part
    options: tuple = ()

    def opt(self, name, default=None):
        return dict(self.options).get(name, default)


def _niah(haystack, key, value, k=1, v=1, q=1, many=False):
    return Task("niah", 128, "string_match_all", (("haystack", haystack), ("key", key), ("value", value),
                                                   ("k", k), ("v", v), ("q", q), ("many", many)))


TASKS: dict[str, Task] = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", k=4, q=4),
    "vt": Task("vt", 30, "string_match_all", (("chains", 1), ("hops", 4))),
    "cwe": Task("cwe", 120, "string_match_all", (("freq_cw", 30), ("freq_ucw", 3), ("num_cw", 10))),
    "fwe": Task("fwe", 50, "string_match_all", (("alpha", 2.0),)),
    "qa_1": Task("qa", 32, "string_match_part", (("dataset", "squad"),)),
    "qa_2": Task("qa", 32, "string_match_part", (("dataset", "hotpotqa"),)),
}
MANY = 4  # questions per context of `niah_many`
EXTRA_TASKS: dict[str, Task] = {"niah_many": _niah("essay", "words", "numbers", k=MANY, many=True)}
ALL_TASKS = {**TASKS, **EXTRA_TASKS}


# ------------------------------------------------------------------------------ ingredients


def _essay_words(root) -> tuple[str, ...]:
    return _words_of(ruler_file("PaulGrahamEssays.json", root))


@lru_cache(maxsize=2)
def _words_of(path: Path) -> tuple[str, ...]:  # cached by the resolved file, so STRUCTKV_DATA changes count
    return tuple(read_json(path)["text"].split())


@lru_cache(maxsize=1)
def _wordlists() -> tuple[list[str], list[str], list[str]]:
    try:
        import importlib.resources as resources

        import wonderwords  # noqa: F401
    except ImportError as e:
        raise ImportError("RULER's word lists come from the `wonderwords` package: pip install 'structkv[eval]'") from e
    assets = resources.files("wonderwords") / "assets"

    def read(name):
        return sorted({w for w in (assets / name).read_text().split("\n") if w})

    return read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")


@lru_cache(maxsize=1)
def _cwe_words() -> list[str]:
    nouns, adjs, verbs = _wordlists()
    words = sorted(set(nouns + adjs + verbs))
    random.Random(42).shuffle(words)
    return words


def _random_word_key(rng: random.Random) -> str:
    nouns, adjs, _ = _wordlists()
    i = rng.randrange(len(adjs) * len(nouns))
    return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"


def _random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return _random_word_key(rng)
    raise ValueError(f"unknown needle type {kind!r}")


def _qa_data(root, dataset: str):
    """(questions, documents): each question has gold answers, gold docs and same-article docs."""
    return _qa_data_of(ruler_file("squad.json" if dataset == "squad" else "hotpotqa.json", root), dataset)


@lru_cache(maxsize=2)
def _qa_data_of(path: Path, dataset: str):
    if dataset == "squad":
        data = read_json(path)["data"]
        docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        questions = []
        for d in data:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                gold = index[p["context"]]
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        questions.append((qa["question"], [a["text"] for a in qa["answers"]], [gold],
                                          [i for i in article if i != gold]))
        return questions, docs
    data = read_json(path)
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    questions = [(d["question"], [d["answer"]], [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]], [])
                 for d in data]
    return questions, docs


# ------------------------------------------------------------------------------ generators


def _singular(template: str) -> str:
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _niah_sample(task: Task, rng: random.Random, size: int, root, ask: int | None = None) -> tuple[str, str, list[str]]:
    """`ask`: the key asked (`niah_many`); None: RULER's draw of `q` keys."""
    k, v, q = task.opt("k"), task.opt("v"), task.opt("q")
    k = max(k, q)
    keys, values, needles = [], [], []
    for _ in range(k):
        keys.append(_random(rng, task.opt("key")))
        values.append([_random(rng, task.opt("value")) for _ in range(v)])
        needles += [NIAH_NEEDLE.format(type_needle_v=task.opt("value"), key=keys[-1], value=val) for val in values[-1]]
    rng.shuffle(needles)
    haystack = task.opt("haystack")
    if haystack == "essay":
        sentences = split_sentences(" ".join(_essay_words(root)[:size]))
        cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles):
            parts += [" ".join(sentences[last:cut]), needle]
            last = cut
        parts.append(" ".join(sentences[last:]))
        context = " ".join(parts)
    else:
        if haystack == "repeat":
            lines = [REPEAT_HAYSTACK] * size
        else:  # distractor needles with random keys and values
            lines = [NIAH_NEEDLE.format(type_needle_v=task.opt("value"), key=_random(rng, task.opt("key")),
                                        value=_random(rng, task.opt("value"))) for _ in range(size)]
        for at, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(k), q) if ask is None else [ask]
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, kind = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, task.opt("value")
    if q * v == 1:
        template, prefix, kind = _singular(template), _singular(prefix), kind[:-1]
    prompt = template.format(type_needle_v=kind, context=context, query=query)
    return prompt, prefix.format(type_needle_v=kind, query=query), answers, _question(prompt, context)


def _vt_chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain


def _vt_text(rng: random.Random, noises: int, hops: int, letters: int) -> tuple[str, str, list[str]]:
    names, chain = _vt_chain(rng, hops, letters)
    sentences = [REPEAT_HAYSTACK + "\n"] * noises
    if len(sentences) <= len(chain):  # too few noise lines: split them into sentences
        sentences = [s + "." if s.strip() else s for line in sentences for s in line.split(".")]
    at = sorted(rng.sample(range(len(sentences)), len(chain)))
    for j, (pos, link) in enumerate(zip(at, chain)):
        sentences.insert(pos + j, link)
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    prompt = VT_TEMPLATE.format(context=context, query=value)
    return prompt, VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value), names, _question(prompt, context)


def _vt_sample(task, rng, size, root, example: str):
    prompt, prefix, names, question = _vt_text(rng, size, task.opt("hops"), 5)
    return example + "\n\n" + prompt, prefix, names, question


def _vt_example(rng: random.Random, task: Task, tokenizer) -> str:
    """A solved 3-letter chain of about 500 tokens, shown before the task (RULER's in-context example)."""
    noises = 1
    while True:
        state = rng.getstate()
        prompt, prefix, names, _ = _vt_text(rng, noises + 1, min(10, task.opt("hops")), 3)
        if len(tokenizer.encode(prompt + prefix)) > 500 - 30:
            rng.setstate(state)
            prompt, prefix, names, _ = _vt_text(rng, noises, min(10, task.opt("hops")), 3)
            return prompt + prefix + " ".join(names)
        rng.setstate(state)
        noises += 1


@lru_cache(maxsize=64)
def _vt_example_of(name: str, index: int, seed: int, length: int, tokenizer) -> str:
    """A sample's in-context example: fixed by its seed, so built once, not at every size the
    haystack search tries (each build tokenizes several candidate chains)."""
    return _vt_example(random.Random(f"{seed}/{name}/{length}/{index}/example"), TASKS[name], tokenizer)


def _cwe_list(rng: random.Random, n_words: int, common_repeats: int, rare_repeats: int, common: int):
    words = rng.sample(_cwe_words(), n_words)
    frequent, rare = words[:common], words[common:]
    listed = frequent * common_repeats + rare * rare_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), frequent


def _cwe_sample(task, rng, size, root, length: int):
    common = task.opt("num_cw")
    if length < 4096:
        example, example_answer = _cwe_list(rng, 20, 3, 1, common)
        context, answer = _cwe_list(rng, size, 6, 1, common)
    else:
        example, example_answer = _cwe_list(rng, 40, 10, 3, common)
        context, answer = _cwe_list(rng, size, task.opt("freq_cw"), task.opt("freq_ucw"), common)
    shown = CWE_TEMPLATE.format(context=example) + CWE_ANSWER_PREFIX + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(example_answer))
    prompt = shown + "\n" + CWE_TEMPLATE.format(context=context)
    return prompt, CWE_ANSWER_PREFIX, answer, _question(prompt, context)


def _zeta(alpha: float) -> float:
    terms = 10_000
    return sum(k ** -alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms ** -alpha


def _fwe_sample(task, rng, size, root, length: int):
    alpha = task.opt("alpha")
    vocab_size = length // 50
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent word is noise
    z = _zeta(alpha)
    words = [w for k, w in enumerate(ranked, start=1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(words)
    context = " ".join(words)
    prompt = FWE_TEMPLATE.format(context=context)
    return prompt, FWE_ANSWER_PREFIX, ranked[1:4], _question(prompt, context)


def _qa_sample(task, rng, size, root, index: int):
    questions, docs = _qa_data(root, task.opt("dataset"))
    question, answers, gold, related = questions[index % len(questions)]
    if size < len(docs):
        if size - len(gold) > len(related):
            taken = set(gold + related)
            others = rng.sample(range(len(docs) - len(taken)), max(0, size - len(taken)))
            free = [i for i in range(len(docs)) if i not in taken]  # only the sampled ranks are mapped below
            chosen = gold + related + [free[i] for i in others]
        else:
            chosen = gold + rng.sample(related, max(0, size - len(gold)))
        picked = [docs[i] for i in chosen]
    else:
        picked = list(docs)
    rng.shuffle(picked)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(picked))
    prompt = QA_TEMPLATE.format(context=context, query=question)
    return prompt, QA_ANSWER_PREFIX, answers, _question(prompt, context)


def _question(prompt: str, context: str) -> str:
    """What follows the haystack: the question (and instructions), which a query-agnostic run
    appends only after the context was compressed."""
    return prompt[prompt.rindex(context) + len(context):]


# ------------------------------------------------------------------------------ sizing


def _make_prompt(name: str, index: int, size: int, seed: int, length: int, root, tokenizer):
    task = ALL_TASKS[name]
    if task.opt("many"):  # one context per MANY samples, each asking one of its keys
        return _niah_sample(task, random.Random(f"{seed}/{name}/{length}/{index // MANY}"), size, root, index % MANY)
    rng = random.Random(f"{seed}/{name}/{length}/{index}")
    if task.kind == "niah":
        return _niah_sample(task, rng, size, root)
    if task.kind == "vt":
        return _vt_sample(task, rng, size, root, _vt_example_of(name, index, seed, length, tokenizer))
    if task.kind == "cwe":
        return _cwe_sample(task, rng, size, root, length)
    if task.kind == "fwe":
        return _fwe_sample(task, rng, size, root, length)
    return _qa_sample(task, rng, size, root, index)


def _min_size(name: str) -> int:
    """The smallest haystack size a task can be built with (words, lines, list entries or documents)."""
    task = ALL_TASKS[name]
    needles = max(task.opt("k") or 1, task.opt("q") or 1) * (task.opt("v") or 1)
    return {"niah": needles, "vt": 1, "cwe": (task.opt("num_cw") or 0) + 1, "fwe": 10, "qa": 1}[task.kind]


def generate(task: str, tokenizer, length: int, samples: int, *, seed: int = 42, data_dir=None,
             start: int = 0) -> list[dict]:
    """`samples` records of RULER task `task` whose prompt plus answer fits in `length` tokens.

    The haystack is the largest that fits: tokens(prompt with answer prefix) + the task's
    max_new_tokens <= length, counted with `tokenizer` (BOS included). `start` skips samples,
    so generate(..., samples=5, start=5) continues generate(..., samples=5).
    """
    if task not in ALL_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; valid: {', '.join(ALL_TASKS)}")
    if not isinstance(length, int) or length < 256:
        raise ValueError(f"length must be an int of at least 256 tokens, got {length!r}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    spec = ALL_TASKS[task]
    root = None if data_dir is None else str(data_dir)
    budget = length - spec.max_new_tokens

    def tokens_at(index, size):
        if spec.opt("many"):  # the context is sized once, by its first question: all its questions share it
            index -= index % MANY
        prompt, prefix, _, _ = _make_prompt(task, index, size, seed, length, root, tokenizer)
        return len(tokenizer.encode(prompt + prefix))

    records = []
    for index in range(start, start + samples):
        lo = _min_size(task)
        if tokens_at(index, lo) > budget:
            raise ValueError(f"{task}: even the smallest haystack exceeds {length} tokens; use a longer length")
        hi, reached = lo * 2, tokens_at(index, lo)
        while (grown := tokens_at(index, hi)) <= budget:  # grow until it overflows
            if grown <= reached and not task.startswith("qa"):  # the haystack ran out: more size adds nothing
                raise ValueError(f"{task}: the haystack data ran out at {grown} tokens, short of the {length}-token "
                                 "budget; the data file is too short for this length (use shorter lengths)")
            lo, hi, reached = hi, hi * 2, grown
            if task.startswith("qa") and lo >= len(_qa_data(root, spec.opt("dataset"))[1]):
                break
        while hi - lo > 1:  # largest size that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tokens_at(index, mid) <= budget else (lo, mid)
        prompt, prefix, answers, question = _make_prompt(task, index, lo, seed, length, root, tokenizer)
        text = prompt + prefix
        records.append({"index": index, "task": task, "input": text, "question": question + prefix,
                        "outputs": answers,
                        "length": len(tokenizer.encode(text)), "answer_prefix": prefix,
                        "max_new_tokens": spec.max_new_tokens, "metric": spec.metric})
    return records
