"""Answer extraction and scorers of the paper's nine benchmarks, and the retain ratio.

- multiple choice (MMBench, MMMU, V*Bench, HR-Bench): the option letter a response
  commits to (a bare letter, "(B)", "B.", "Answer: B", or the text of exactly one
  option), accuracy over questions;
- yes/no (POPE): accuracy, precision, recall and F1 with "yes" as the positive class;
- VQA accuracy (TextVQA): min(#annotators who gave the answer / 3, 1), averaged over
  the ten leave-one-annotator-out subsets, after the VQA answer normalisation;
  GQA: exact match after the same normalisation;
- MME: per subtask, accuracy over questions plus accuracy+ over images (both of an
  image's two questions right), each in percent; perception and cognition are the
  sums over their subtasks;
- OCRBench: the count of responses that contain a reference answer (case-insensitive;
  spaces ignored for handwritten math expressions).

The retain ratio is the score at a budget over the full-token score, averaged over
benchmarks (the paper's headline metric).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

LETTERS = "ABCDEFGHIJ"

# --------------------------------------------------------------------------- multiple choice
_LETTER_PATTERNS = [
    re.compile(r"^\s*\(?([A-J])\)?\s*(?:[.:)\]]|$)"),  # "B", "(B)", "B.", "B:" at the start
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE),
    re.compile(r"<answer>\s*\(?([A-J])\)?\s*</answer>"),
]


def choice_letter(response: str, options: Sequence[str]) -> str | None:
    """The option letter a response commits to, or None when it names none (or several) of the options."""
    valid = LETTERS[: len(options)]
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(response)
        if match and match.group(1) in valid:
            return match.group(1)
    text = _squash(response)
    named = [LETTERS[i] for i, option in enumerate(options) if option and _squash(option) in text]
    return named[0] if len(named) == 1 else None


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def multiple_choice_accuracy(responses: Sequence[str], options: Sequence[Sequence[str]], answers: Sequence[str]) -> float:
    return _mean([choice_letter(r, o) == a for r, o, a in zip(responses, options, answers, strict=True)])


# ------------------------------------------------------------------------------------- yes/no
def yes_no(response: str) -> str | None:
    words = re.findall(r"[a-z]+", response.lower())
    found = [w for w in words if w in ("yes", "no")]
    return found[0] if found else None


def pope_scores(responses: Sequence[str], labels: Sequence[str]) -> dict[str, float]:
    """Accuracy, precision, recall, F1 ("yes" positive; an unreadable answer counts as "no") and the yes ratio."""
    predicted = [yes_no(r) == "yes" for r in responses]
    truth = [label.strip().lower() == "yes" for label in labels]
    if len(predicted) != len(truth):
        raise ValueError(f"{len(predicted)} responses for {len(truth)} labels")
    tp = sum(p and t for p, t in zip(predicted, truth))
    fp = sum(p and not t for p, t in zip(predicted, truth))
    fn = sum(t and not p for p, t in zip(predicted, truth))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return {
        "accuracy": _mean([p == t for p, t in zip(predicted, truth)]),
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "yes_ratio": _mean(predicted),
    }


# ---------------------------------------------------------------------------- VQA accuracy
_NUMBER_WORDS = {w: str(i) for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {"dont": "don't", "doesnt": "doesn't", "isnt": "isn't", "arent": "aren't", "cant": "can't", "wont": "won't",
                 "im": "i'm", "ive": "i've", "youre": "you're", "thats": "that's", "whats": "what's", "its": "it's"}
_PUNCTUATION = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$|~:']")


def normalize_vqa_answer(answer: str) -> str:
    """The VQA evaluation's answer normalisation: case, punctuation, number words, articles, contractions."""
    text = answer.replace("\n", " ").replace("\t", " ").strip().lower()
    text = re.sub(r"(?<!\d)\.(?!\d)", "", text)  # periods, except decimal points
    text = _PUNCTUATION.sub(lambda m: "" if m.group(0) == "'" else " ", text)
    words = []
    for word in text.split():
        word = _NUMBER_WORDS.get(word, word)
        if word in _ARTICLES:
            continue
        words.append(_CONTRACTIONS.get(word, word))
    return " ".join(words)


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """min(#matching annotators / 3, 1), averaged over the leave-one-out subsets of the references."""
    if not references:
        raise ValueError("a VQA question needs reference answers")
    predicted = normalize_vqa_answer(prediction)
    matches = [normalize_vqa_answer(r) == predicted for r in references]
    if len(references) == 1:
        return float(matches[0])
    subsets = [matches[:i] + matches[i + 1 :] for i in range(len(matches))]
    return _mean([min(sum(s) / 3, 1.0) for s in subsets])


def exact_match(prediction: str, reference: str) -> bool:
    return normalize_vqa_answer(prediction) == normalize_vqa_answer(reference)


# ---------------------------------------------------------------------------------------- MME
MME_PERCEPTION = ("existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork", "OCR")
MME_COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")


def mme_scores(records: Sequence[Mapping[str, str]]) -> dict[str, float]:
    """records: {subtask, image, response, answer ("Yes"/"No")}; per subtask acc + acc+ (percent), and the two sums."""
    by_task: dict[str, list] = defaultdict(list)
    for record in records:
        by_task[record["subtask"]].append(record)
    scores = {}
    for task, rows in by_task.items():
        correct = [yes_no(r["response"]) == r["answer"].strip().lower() for r in rows]
        per_image: dict[str, list[bool]] = defaultdict(list)
        for row, ok in zip(rows, correct):
            per_image[row["image"]].append(ok)
        scores[task] = 100 * _mean(correct) + 100 * _mean([all(v) for v in per_image.values()])
    unknown = sorted(set(scores) - set(MME_PERCEPTION) - set(MME_COGNITION))
    if unknown:
        raise ValueError(f"unknown MME subtask(s) {unknown}; known: {MME_PERCEPTION + MME_COGNITION}")
    scores["perception"] = sum(scores.get(t, 0.0) for t in MME_PERCEPTION)
    scores["cognition"] = sum(scores.get(t, 0.0) for t in MME_COGNITION)
    return scores


# ----------------------------------------------------------------------------------- OCRBench
def ocrbench_correct(response: str, answers: Sequence[str], dataset: str = "") -> bool:
    """A reference answer appears in the response (case-insensitive; HME100k ignores spaces)."""
    if dataset == "HME100k":
        text = response.strip().replace(" ", "")
        return any(a.strip().replace(" ", "") in text for a in answers)
    text = response.lower().strip().replace("\n", " ")
    return any(a.lower().strip().replace("\n", " ") in text for a in answers)


def ocrbench_score(responses: Sequence[str], answers: Sequence[Sequence[str]], datasets: Sequence[str]) -> int:
    return sum(ocrbench_correct(r, a, d) for r, a, d in zip(responses, answers, datasets, strict=True))


# -------------------------------------------------------------------------------------- retain
def retain_ratio(at_budget: Mapping[str, float], full: Mapping[str, float]) -> float:
    """Mean over benchmarks of score at the budget / full-token score (benchmarks with full score 0 are refused)."""
    missing = sorted(set(full) - set(at_budget))
    if missing:
        raise ValueError(f"no score at the budget for {missing}")
    zero = sorted(name for name, score in full.items() if score == 0)
    if zero:
        raise ValueError(f"full-token score is 0 for {zero}: the retain ratio is undefined")
    return _mean([at_budget[name] / full[name] for name in full])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
