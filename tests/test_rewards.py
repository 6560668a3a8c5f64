"""The RL baselines' rewards (`evals/rewards.py`): each built-in on responses written by hand, a user's own, and every
way a reward can be wrong named with the reward and the row."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lt_opd_ray.core.samples import Sample
from lt_opd_ray.evals.rewards import BUILT_IN, JobReward, RewardError, checked_rewards, load_reward, row_problems


def rows(*answers):
    return [Sample(f"row-{i}", (b"png",), "q?", answer) for i, answer in enumerate(answers)]


@pytest.mark.parametrize(("name", "answers", "responses", "expected"), [
    ("answer", ("Red", "2"), ["<answer> red </answer>", "<answer>two</answer>"], [1.0, 0.0]),
    ("answer_normalised", ("2", "the cat"), ["<answer>Two.</answer>", "<answer>a cat</answer>"], [1.0, 1.0]),
    ("answer_normalised", ("2",), ["2"], [0.0]),  # no <answer>: nothing committed to
    ("choice", ("B", "c"), ["<answer>(B)</answer>", "The answer is D."], [1.0, 0.0]),
    ("format", ("x", "y"), ["<think>..</think><answer>y</answer>", "y"], [1.0, 0.0]),
])
def test_each_built_in_reward_on_responses_written_by_hand(name, answers, responses, expected):
    assert checked_rewards(name, load_reward(name), rows(*answers), responses) == expected


def test_dapos_overlong_punishment_falls_linearly_over_the_buffer_to_minus_one_at_the_longest_response():
    """DAPO's soft overlong punishment at max_new_tokens 16 and a buffer of 4: nothing up to 12 tokens, then a
    quarter less per token, -1 at 16 (the longest a response can be), added to the reward."""
    reward = JobReward("format", overlong_buffer=4, max_new_tokens=16)
    lengths = [1, 12, 13, 14, 15, 16]
    assert reward(rows(*"abcdef"), ["<answer>x</answer>"] * 6, lengths) == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert reward(rows("a", "b"), ["x", "x"], [12, 14]) == [0.0, -0.5]
    assert JobReward("format", overlong_buffer=0, max_new_tokens=16)(rows("a"), ["x"], [16]) == [0.0]  # no buffer: none


def test_a_users_own_reward_is_named_as_module_and_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("import numpy as np\ndef length(samples, responses):\n"
                                            "    return [np.float32(len(r)) for r in responses]\nnot_callable = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LT_OPD_TRUSTED_MODULES", "user_rewards, my_rewards")
    assert checked_rewards("my_rewards:length", load_reward("my_rewards:length"), rows("a", "b"), ["xy", "xyz"]) == [2.0, 3.0]
    with pytest.raises(RewardError, match="reward 'my_rewards:nothing' cannot be loaded"):
        load_reward("my_rewards:nothing")
    with pytest.raises(RewardError, match="reward 'my_rewards:not_callable' is not callable"):
        load_reward("my_rewards:not_callable")
    with pytest.raises(RewardError, match=r"reward 'exactish': one of answer, answer_normalised, choice, format, judge, or module:function"):
        load_reward("exactish")
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(("values", "message"), [
    ([1.0], r"reward r: 1 values for 2 responses \(rows row-0, row-1\)"),
    ([1.0, float("nan")], r"reward r: response 1 \(row row-1\) got nan, not a finite number"),
    ([1.0, "1"], r"reward r: response 1 \(row row-1\) got '1', not a finite number"),
    ([np.inf, 0.0], r"reward r: response 0 \(row row-0\) got inf"),
])
def test_a_reward_that_gives_anything_but_one_finite_number_per_response_is_named(values, message):
    with pytest.raises(RewardError, match=message):
        checked_rewards("r", lambda samples, responses: values, rows("a", "b"), ["x", "y"])


@pytest.mark.parametrize("trusted", ["", "my", "my_rewards.sub", "other,  ", "my_rewards_x", "*"])
def test_a_module_the_operator_does_not_trust_is_never_imported_validate_included(tmp_path, monkeypatch, capsys, trusted):
    """A job naming `module:function` runs that module's top-level code only where the operator's environment lists the
    module by its whole name (LT_OPD_TRUSTED_MODULES): `lt-opd validate` of the job imports nothing, names the
    variable, and fails."""
    from lt_opd_ray.cli.main import main

    marker = tmp_path / "ran"
    (tmp_path / "my_rewards.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef length(samples, responses):\n    return [0.0] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LT_OPD_TRUSTED_MODULES", trusted)
    with pytest.raises(RewardError, match=r"reward 'my_rewards:length' names code to import, and module 'my_rewards' is not among the"
                                          r" operator's trusted modules: set LT_OPD_TRUSTED_MODULES=my_rewards where the job runs"):
        load_reward("my_rewards:length")
    job = tmp_path / "job.yaml"
    job.write_text(f'model: {{path: "tiny:qwen3_5"}}\ndata: {{path: "synthetic:4"}}\nobjective: {{mode: grpo}}\nsampling: {{n: 2}}\n'
                   f'reward: {{name: "my_rewards:length"}}\ncheckpoint: {{dir: "{tmp_path / "run"}"}}\n')
    assert main(["validate", str(job)]) == 1  # validate: 1 when a job has problems
    assert "not among the operator's trusted modules" in capsys.readouterr().err
    assert not marker.exists() and "my_rewards" not in sys.modules


def test_a_reward_that_raises_is_named_with_the_rows_it_was_given():
    with pytest.raises(RewardError, match=r"reward mine:f raised KeyError: 'colour' \(rows row-0, row-1\)"):
        checked_rewards("mine:f", lambda samples, responses: [{}["colour"]], rows("a", "b"), ["x", "y"])


def test_answer_rewards_refuse_rows_without_an_answer_and_choice_rows_without_a_letter():
    with pytest.raises(RewardError, match="rows without a reference answer cannot be rewarded by their answer: row-1"):
        BUILT_IN["answer"](rows("a", None), ["x", "y"])
    with pytest.raises(RewardError, match="reward choice: rows whose answer is not an option letter A-J: row-0"):
        BUILT_IN["choice"](rows("blue"), ["x"])
    with pytest.raises(RewardError, match="reward choice: rows whose answer is not an option letter A-J: row-1"):
        BUILT_IN["choice"](rows("a", "AB"), ["x", "y"])  # two letters are not one option


def test_rows_a_reward_cannot_score_are_named_before_the_run_starts():
    assert row_problems("answer", rows("a", None, None), "rows.jsonl") == [
        "reward.name answer compares each response with its row's answer, but 2 of the 3 rows of data.path 'rows.jsonl' carry"
        " none (row-1, row-2): give each row an `answer`"]
    assert row_problems("choice", rows("B", "blue"), "rows.jsonl") == [
        "reward.name choice reads option letters, but 1 rows of data.path 'rows.jsonl' answer otherwise (row-1): use answer or"
        " answer_normalised"]
    assert row_problems("choice", rows("b", "J"), "x") == row_problems("answer_normalised", rows("2"), "x") == []
    assert row_problems("format", rows(None), "x") == row_problems("my:reward", rows(None), "x") == []  # neither reads answers


def test_validate_names_a_reward_that_cannot_load_or_score_the_rows(tmp_path, capsys):
    """`lt-opd validate` and train's preflight read the job's inputs alike (runtime/job_inputs.py)."""
    import json

    from conftest import random_image

    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read())
    random_image(2).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"sample_uid": u, "image": "a.png", "question": "Q?", **extra}) + "\n"
                                                 for u, extra in (("a", {"answer": "red"}), ("b", {}), ("c", {}))))
    data = [f"--set=data.path={tmp_path / 'rows.jsonl'}", f"--set=data.image_root={tmp_path}", "--set=sampling.prompts_per_step=2"]
    for reward, expected in (("answer", f"reward.name answer compares each response with its row's answer, but 2 of the 3 rows of"
                                        f" data.path '{tmp_path / 'rows.jsonl'}' carry none (b, c)"),
                             ("user_rewards:fn", "reward.name: reward 'user_rewards:fn' cannot be loaded: module 'user_rewards' has no"
                                                 " attribute 'fn'")):
        assert main(["validate", str(job), *data, f"--set=reward.name={reward}"]) == 1, reward
        err = capsys.readouterr().err
        assert expected in err, (reward, err)
    assert main(["validate", str(job), *data, "--set=reward.name=format"]) == 0  # reads no answer


def test_a_judge_whose_template_thinks_gives_its_verdict_at_once(tiny_dirs, tmp_path):
    """Under a chat template that opens a thinking block after the assistant's turn (as Qwen3.5's does), the judge's
    prompt closes it empty (the template's `enable_thinking` switch), so its reward is read at its answer's first
    token, not at the block's first thought; a template that opens one whatever it is asked is refused."""
    import dataclasses
    import shutil

    import torch

    from lt_opd_ray.config.schema import DataConfig
    from lt_opd_ray.evals.judge import Judge, judge_question
    from lt_opd_ray.models.processor import encode_samples
    from lt_opd_ray.sources.resolve import load_samples

    thinking = shutil.copytree(tiny_dirs["qwen3_5"], tmp_path / "thinking")
    template = thinking / "chat_template.jinja"
    opened = "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    assert template.read_text().count("<|im_start|>assistant\n") == 1
    template.write_text(template.read_text().replace("<|im_start|>assistant\n", opened))
    (row,) = load_samples("synthetic:1")
    judge = Judge(str(thinking), DataConfig(path="synthetic:1", max_pixels=65536))
    (value,) = judge([row], [f"<answer>{row.answer}</answer>"])
    asked = dataclasses.replace(row, question=judge_question(row, f"<answer>{row.answer}</answer>"))
    (prompt,) = encode_samples(judge.processor, [asked], answer_at_once=True)
    decode = judge.processor.tokenizer.decode
    assert decode(prompt.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert decode(encode_samples(judge.processor, [asked])[0].input_ids).endswith("<|im_start|>assistant\n<think>\n")  # a run's own prompts think
    with torch.no_grad():
        p = judge.model(input_ids=prompt.input_ids[None], mm_token_type_ids=prompt.mm_token_type_ids[None], pixel_values=prompt.pixel_values,
                        image_grid_thw=prompt.image_grid_thw).logits[0, -1].double().softmax(dim=0)
    p_yes, p_no = (float(p[list(ids)].sum()) for ids in (judge.yes, judge.no))
    assert value == pytest.approx(p_yes / (p_yes + p_no), rel=1e-5)
    template.write_text(template.read_text().replace(opened, "<|im_start|>assistant\n<think>\n"))  # thinks whatever it is asked
    with pytest.raises(ValueError, match="its chat template opens a thinking block after the question even with enable_thinking=False"):
        Judge(str(thinking), DataConfig(path="synthetic:1", max_pixels=65536))


def test_the_judge_rewards_its_probability_of_yes_after_the_question_about_each_response(tiny_dirs):
    """A reward that needs a model: the judge's reward for each response is P(yes) / (P(yes) + P(no)) (either
    capitalised) at its next token after being asked about the response. The judge asks about a call's responses in
    packed rows (two rows of two responses each, of different lengths; a 1-token budget puts each question in a
    forward of its own); here each is computed again by transformers' own forward of that question alone, every
    position's logits (another path to the same numbers). Its rows need answers (named before a run), and a job's judge
    reward without a judge to ask is refused."""
    import dataclasses

    import torch

    from lt_opd_ray.config.schema import DataConfig
    from lt_opd_ray.evals.judge import Judge, judge_question
    from lt_opd_ray.evals.rewards import JobReward
    from lt_opd_ray.models.processor import encode_samples
    from lt_opd_ray.sources.resolve import load_samples

    rows_ = load_samples("synthetic:2")
    samples = [rows_[0], rows_[1], rows_[0], rows_[1]]
    judge = Judge(str(tiny_dirs["qwen3_5"]), DataConfig(path="synthetic:2", max_pixels=65536))
    responses = [f"<answer>{rows_[0].answer}</answer>", "it is a dog", "no", f"the answer is plainly {rows_[1].answer}, as drawn"]
    values = JobReward("judge", judge=judge)(samples, responses, [3, 4, 1, 9])
    alone = Judge(str(tiny_dirs["qwen3_5"]), DataConfig(path="synthetic:2", max_pixels=65536), micro_batch_tokens=1)(samples, responses)
    tokenizer = judge.processor.tokenizer
    verdicts = {word: {tokenizer(form, add_special_tokens=False)["input_ids"][0] for form in (word, word.capitalize())} for word in ("yes", "no")}
    assert (set(judge.yes), set(judge.no)) == (verdicts["yes"], verdicts["no"]) and not verdicts["yes"] & verdicts["no"]
    lengths = []
    for row, response, value, single in zip(samples, responses, values, alone):
        prompt = encode_samples(judge.processor, [dataclasses.replace(row, question=judge_question(row, response))])[0]
        assert f"Response: {response}" in tokenizer.decode(prompt.input_ids)
        lengths.append(prompt.input_ids.numel())
        inputs = {"input_ids": prompt.input_ids[None], "mm_token_type_ids": prompt.mm_token_type_ids[None],
                  "pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
        with torch.no_grad():
            p = judge.model(**inputs).logits[0, -1].double().softmax(dim=0)  # the next token's distribution after the question
        p_yes, p_no = (sum(float(p[i]) for i in verdicts[word]) for word in ("yes", "no"))
        assert value == pytest.approx(p_yes / (p_yes + p_no), rel=1e-5) and single == pytest.approx(value, rel=1e-5)
    assert len(set(lengths)) == len(lengths)  # every question of another length
    assert 0 < min(values) and max(values) < 1 and len(set(values)) == len(values)
    assert row_problems("judge", rows("a", None), "x")[0].startswith("reward.name judge compares each response with its row's answer")
    with pytest.raises(RewardError, match="reward judge: no judge model to ask"):
        JobReward("judge")
