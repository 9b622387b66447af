"""Scoring: RULER's string matches and LongBench v1's English metrics, reimplemented.

Each function scores one prediction against one gold string (LongBench) or a list of gold
strings (RULER) and returns a value in [0, 1]; tables multiply by 100. LongBench's quirks are
kept on purpose, so scores are comparable with published tables:
- ROUGE-L is the `rouge` package's summary-level F (sentences split on "."; words counted as
  sets, so repeated words count once), as LongBench calls `Rouge().get_scores(...)["rouge-l"]["f"]`;
  an empty prediction scores 0 (LongBench catches the package's error).
- code similarity is fuzzywuzzy's `ratio` (difflib's SequenceMatcher, rounded to an integer
  percent) on the first line of the prediction that is not a comment or a code fence.
- for trec, triviaqa, samsum and lsht only the first line of the prediction is scored.
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter

# ---------------------------------------------------------------------------------- RULER


def string_match_all(prediction: str, golds: list[str]) -> float:
    """Fraction of the gold strings that occur in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(g.lower() in pred for g in golds) / len(golds)


def string_match_part(prediction: str, golds: list[str]) -> float:
    """1 if any gold string occurs in the prediction (case-insensitive), else 0."""
    pred = prediction.lower()
    return float(any(g.lower() in pred for g in golds))


# ------------------------------------------------------------------------------- LongBench


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, gold: str) -> float:
    """Token-level F1 after `normalize_answer` (LongBench's qa_f1_score)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """The words of one longest common subsequence, reconstructed with the `rouge` package's tie rule."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            if ref[i - 1] == hyp[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words, i, j = set(), n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(prediction: str, gold: str) -> float:
    """Summary-level ROUGE-L F as computed by the `rouge` package (used by LongBench)."""
    def sentences(text):
        return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]

    hyp, ref = sentences(prediction), sentences(gold)
    if not hyp or not ref:
        return 0.0
    hyp_words = [w for s in hyp for w in s.split(" ")]
    ref_words = [w for s in ref for w in s.split(" ")]
    union: set[str] = set()
    overlap = 0
    for ref_sentence in ref:
        before = len(union)
        for hyp_sentence in hyp:
            union |= _lcs_words(ref_sentence.split(" "), hyp_sentence.split(" "))
        overlap += len(union) - before
    recall = overlap / len(set(ref_words))
    precision = overlap / len(set(hyp_words))
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def classification(prediction: str, gold: str, all_classes: list[str]) -> float:
    """1/(number of class names found) if the gold class is among them (LongBench's classification_score)."""
    found = [c for c in all_classes if c in prediction]
    # Drop class names that are part of the gold name. LongBench removes while iterating over the
    # same list, which skips the element after each removal; kept so scores match its tables.
    i = 0
    while i < len(found):
        if found[i] in gold and found[i] != gold:
            found.pop(i)
        i += 1
    return 1.0 / len(found) if gold in found else 0.0


def passage_retrieval(prediction: str, gold: str) -> float:
    """Share of the numbers in the prediction that name the gold paragraph ("Paragraph 12")."""
    match = re.findall(r"Paragraph (\d+)", gold)
    if not match:
        raise ValueError(f"a passage retrieval answer looks like 'Paragraph N', got {gold!r}")
    numbers = re.findall(r"\d+", prediction)
    return sum(n == match[0] for n in numbers) / len(numbers) if numbers else 0.0


def passage_count(prediction: str, gold: str) -> float:
    """Share of the numbers in the prediction equal to the gold count."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(gold) for n in numbers) / len(numbers) if numbers else 0.0


def code_similarity(prediction: str, gold: str) -> float:
    """fuzzywuzzy ratio (difflib) of the first real code line of the prediction and the gold line."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if "`" not in ln and "#" not in ln and "//" not in ln), "")
    if not line or not gold:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, line, gold).ratio()) / 100


LONGBENCH_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1",
    "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l", "samsum": "rouge_l",
    "trec": "classification", "passage_count": "passage_count", "passage_retrieval_en": "passage_retrieval",
    "lcc": "code_similarity", "repobench-p": "code_similarity",
}
FIRST_LINE_ONLY = {"trec", "triviaqa", "samsum", "lsht"}


def longbench_score(task: str, prediction: str, golds: list[str], all_classes: list[str] | None = None) -> float:
    """LongBench's per-sample score: the best over the gold answers, in [0, 1]."""
    if task not in LONGBENCH_METRIC:
        raise ValueError(f"no LongBench metric for task {task!r}; English tasks: {', '.join(LONGBENCH_METRIC)}")
    if task in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRIC[task]
    best = 0.0
    for gold in golds:
        if metric == "classification":
            score = classification(prediction, gold, all_classes or [])
        else:
            score = {"qa_f1": qa_f1, "rouge_l": rouge_l, "passage_count": passage_count,
                     "passage_retrieval": passage_retrieval,
                     "code_similarity": code_similarity}[metric](prediction, gold)
        best = max(best, score)
    return best
