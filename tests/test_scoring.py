"""The benchmark scorers against hand-worked cases and brute-force definitions."""

from __future__ import annotations

import itertools

import pytest

from lt_opd_ray.evals import scoring

OPTIONS = ["a red car", "a blue car", "a green bus", "a yellow bike"]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("B", "B"), ("(C) a green bus", "C"), ("D.", "D"), ("The answer is A.", "A"), ("Answer: (b)", None),
        ("<answer>C</answer>", "C"), ("I think it is a blue car.", "B"), ("a car", None), ("E", None),
        ("a red car or a blue car", None),
    ],
)
def test_choice_letter(response, expected):
    assert scoring.choice_letter(response, OPTIONS) == expected


def test_multiple_choice_accuracy():
    assert scoring.multiple_choice_accuracy(["A", "(B)", "nothing"], [OPTIONS] * 3, ["A", "C", "D"]) == pytest.approx(1 / 3)


def test_pope_scores_equal_their_definitions():
    responses = ["Yes, there is.", "No.", "yes", "There is no dog.", "yes", "unclear"]
    labels = ["yes", "yes", "no", "no", "yes", "yes"]
    got = scoring.pope_scores(responses, labels)
    # by hand: predictions Y N Y N Y N(unreadable) vs truth Y Y N N Y Y -> tp 2, fp 1, fn 2, tn 1
    assert got["accuracy"] == pytest.approx(3 / 6)
    assert got["precision"] == pytest.approx(2 / 3) and got["recall"] == pytest.approx(2 / 4)
    assert got["f1"] == pytest.approx(2 * (2 / 3) * (1 / 2) / (2 / 3 + 1 / 2))
    assert got["yes_ratio"] == pytest.approx(3 / 6)


@pytest.mark.parametrize("raw, normal", [("Two dogs.", "2 dogs"), ("The Cat!", "cat"), ("dont", "don't"), ("3.5", "3.5"),
                                         ("yes, it is", "yes it is")])
def test_vqa_normalisation(raw, normal):
    assert scoring.normalize_vqa_answer(raw) == normal


@pytest.mark.parametrize("matching", range(0, 11))
def test_vqa_accuracy_is_the_leave_one_out_average(matching):
    references = ["two"] * matching + ["three"] * (10 - matching)
    brute = [min(sum(references[i] == "two" for i in subset) / 3, 1) for subset in itertools.combinations(range(10), 9)]
    assert scoring.vqa_accuracy("2", references) == pytest.approx(sum(brute) / len(brute))


def test_mme_scores_sum_accuracy_and_accuracy_plus():
    records = [
        {"subtask": "existence", "image": "1.jpg", "response": "Yes", "answer": "Yes"},
        {"subtask": "existence", "image": "1.jpg", "response": "No", "answer": "No"},
        {"subtask": "existence", "image": "2.jpg", "response": "Yes", "answer": "No"},
        {"subtask": "existence", "image": "2.jpg", "response": "No", "answer": "No"},
        {"subtask": "code_reasoning", "image": "c.png", "response": "yes", "answer": "Yes"},
        {"subtask": "code_reasoning", "image": "c.png", "response": "yes", "answer": "No"},
    ]
    got = scoring.mme_scores(records)
    assert got["existence"] == pytest.approx(100 * 3 / 4 + 100 * 1 / 2)
    assert got["code_reasoning"] == pytest.approx(100 * 1 / 2 + 0)
    assert (got["perception"], got["cognition"]) == (pytest.approx(125.0), pytest.approx(50.0))
    with pytest.raises(ValueError, match="unknown MME subtask"):
        scoring.mme_scores([{"subtask": "colour", "image": "x", "response": "yes", "answer": "Yes"}])


def test_ocrbench_counts_contained_answers():
    assert scoring.ocrbench_score(
        ["The sign says STOP here", "x^2 + 1", "nothing"], [["stop"], ["x^{2}+1", "x^2+1"], ["exit"]], ["IIIT5K", "HME100k", "IIIT5K"]
    ) == 2


def test_retain_ratio():
    assert scoring.retain_ratio({"a": 40, "b": 0.5}, {"a": 80, "b": 1.0}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no score at the budget"):
        scoring.retain_ratio({"a": 1}, {"a": 2, "b": 3})
    with pytest.raises(ValueError, match="undefined"):
        scoring.retain_ratio({"a": 1}, {"a": 0})
