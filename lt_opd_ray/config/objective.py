"""The objective's sections of a job: what the student learns from (`objective`), how its rollouts are sampled
(`sampling`) and how they are rewarded (`reward`). Torch-free, as the whole schema (config/schema.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lt_opd_ray.config.base import (
    MAX_DYNAMIC_SAMPLING_ROUNDS,
    MAX_PROMPTS_PER_STEP,
    MAX_RESPONSES_PER_PROMPT,
    MAX_SEQUENCE_TOKENS,
    MAX_TOP_K,
    StrictModel,
)


# Who writes the responses each objective mode trains on (`ObjectiveConfig.prefixes`).
PREFIXES = {"lt_opd": "student", "sft": "dataset", "fixed_prefix": "dataset", "sequence_kd": "teacher", "teacher_prefix": "teacher",
            "grpo": "student", "dapo": "student", "gspo": "student"}
POLICY_GRADIENT = ("grpo", "dapo", "gspo")  # the RL baselines: a clipped policy gradient on the reward (core/rl.py)


class ObjectiveConfig(StrictModel):
    mode: Literal["lt_opd", "sft", "fixed_prefix", "sequence_kd", "teacher_prefix", "grpo", "dapo", "gspo"] = "lt_opd"
    """What the student learns from. `lt_opd`: its own rollouts at budget r, scored by the teacher
    (docs/architecture.md §1). The paper's baselines train on the responses that come with the data (each row's
    `response`; a job whose rows lack one is refused, and `sampling.n` must be 1): `sft`, cross-entropy on them;
    `fixed_prefix`, the teacher's distributions on them (with the curriculum). Two more, on responses the frozen
    full-token teacher samples (each rollout worker then holds a frozen copy of the initial weights):
    `sequence_kd`, cross-entropy on them (sequence-level distillation); `teacher_prefix`, the teacher's
    distributions on them. The RL baselines train the student's rollouts on `reward.name` instead of a teacher
    (`sampling.n` responses per prompt, each one's advantage relative to its prompt's group; core/rl.py): `grpo`
    (PPO-clipped token ratios, each response's token mean), `dapo` (clip-higher, a token mean over the update) and
    `gspo` (one length-normalised ratio per response, clipped)."""
    divergence: Literal["jsd", "forward_kl", "reverse_kl"] = "jsd"
    """Per-position divergence on the top-k union plus a tail bin."""
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    """The RL baselines' KL term, β: β times KL(student || frozen initial weights) at each response token, added to
    the policy term and averaged as it is (per response, or DAPO's over the update's tokens; a response masked by
    `truncated: mask` loses both). The frozen weights are the teacher pool's (the job then starts one), which see the
    full-token prompt: unlike GRPO's KL, whose reference sees the policy's own input, below 100% budget this pulls
    toward the full-token model, part of LT-OPD's own signal. The KL is taken over the top-k union plus a tail bin
    (`reverse_kl` of the distillation modes, exact on that support, not a sampled estimate). 0 (the default, DAPO's and
    GSPO's practice): no KL term and no teacher pool."""
    clip_low: float | None = Field(None, gt=0.0, lt=1.0)
    """The RL baselines' clip range on their ratio is [1 - clip_low, 1 + clip_high]; unset, each paper's own (GRPO
    0.2 / 0.2, DAPO's clip-higher 0.2 / 0.28, GSPO 3e-4 / 4e-4 on its length-normalised sequence ratio)."""
    clip_high: float | None = Field(None, gt=0.0)
    """See `clip_low`."""
    dual_clip: float | None = Field(3.0, gt=1.0)
    """The RL baselines' cap on a token whose advantage is negative: its term is at most dual_clip times |A|, however
    far its ratio is above 1 (Ye et al.'s dual clip; verl's clip_ratio_c, 3 by default). Under staleness the old policy
    is the rollout engine's log-probs, where one mismatched token would otherwise weigh its push down by its whole
    ratio. grpo and dapo; gspo's sequence ratio is clipped to a narrow range and its log clamped at 10 instead, as
    verl's GSPO. null: no cap. Every token's log-ratio is clamped to ±20 before its exp in any case (verl's bound)."""
    scale_advantages: bool = True
    """The RL baselines' advantage: each response's reward minus its prompt group's mean, divided by the group's
    standard deviation (GRPO's, DAPO's and GSPO's: true) or not (false: Dr. GRPO's advantage, which keeps the reward's
    scale, so a group whose rewards barely differ takes a small step; Dr. GRPO's other change, a constant length
    normaliser in place of each response's token mean, is not offered)."""
    alpha: float = Field(0.5, gt=0.0, lt=1.0)
    """Teacher weight of the generalised JSD mixture M = (1-α)P_S + αP_T."""
    top_k: int = Field(100, ge=1, le=MAX_TOP_K)
    """Size of the student and teacher top-k sets that form the support U."""
    importance_clip: float = Field(2.0, gt=0.0)
    """Truncation of the detached importance weight min(exp(logp - old_logp), clip)."""
    importance: Literal["token", "prefix"] = "token"
    """What the importance weight at position t is the ratio of. `token` (the paper's): the token sampled at t.
    `prefix` (beyond the paper): the response before t, Π_{j<t} exp(logp_j - old_logp_j), truncated at
    importance_clip. The divergence at t depends on the prefix only, so under staleness (rollouts of older
    weights) only `prefix` weights the states by the current policy's chance of reaching them; `token` leaves their
    distribution the rollout policy's and adds variance. The old policy is the rollout engine's log-probs of its
    samples, so on policy each token's ratio is the engines' mismatch (exp of the learner's minus the engine's log-prob:
    1 where the learner samples with the same kernels, as the transformers engine does; vLLM's bf16 kernels are off by
    ~0.01-0.05 a token), and the prefix weight is the product of those mismatches up to t: it drifts with t (about
    σ√t in log space, ~1.6 at σ = 0.05 and t = 1,000) and the clip then binds for reasons other than staleness. With
    vLLM rollouts and long responses prefer `token` (core/objective.py)."""
    logsoftmax_chunk: int = Field(1024, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Positions per chunk of the full-vocabulary log-softmax (memory is chunk × vocab)."""
    truncated: Literal["keep", "mask"] = "keep"
    """A response cut at sampling.max_new_tokens (finish reason `length`): `keep` trains on it as on any other;
    `mask` gives it no loss (its positions still count in the step's statistics, and the update's loss still
    divides by all its sequences, so the step shrinks by the share masked). The share cut is in every step line."""

    @property
    def prefixes(self) -> Literal["student", "dataset", "teacher"]:
        """Who writes the responses trained on: the student's rollouts, the rows' own responses, or the teacher's samples."""
        return PREFIXES[self.mode]

    @property
    def cross_entropy(self) -> bool:
        """The loss is the cross-entropy of the responses' tokens (SFT), not a divergence from the teacher's distributions."""
        return self.mode in ("sft", "sequence_kd")

    @property
    def policy_gradient(self) -> bool:
        """The loss is an RL baseline's clipped policy gradient on the responses' rewards."""
        return self.mode in POLICY_GRADIENT

    @property
    def teacher_scores(self) -> bool:
        """The loss reads the teacher's distributions on the responses. Where it does not (the cross-entropy modes,
        the RL baselines without a KL term), the job starts no teacher pool and its learners ask nothing of one
        (`sequence_kd`'s responses come from the rollout workers' frozen copy)."""
        if self.policy_gradient:
            return self.kl_coef > 0
        return not self.cross_entropy

    @property
    def student_top_k(self) -> int:
        """How many of the student's top ids a rollout carries at each response position: `top_k` where the teacher is
        asked for its log-probs there (the top-k union the divergence, or the RL baselines' KL term, is taken on), else
        0 (the loss reads the sampled token's log-prob only: a rollout engine then computes and sends no top-k)."""
        return self.top_k if self.teacher_scores else 0

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): an RL baseline's ratio is clipped to [1 - low, 1 + high] (`clip_low`, `clip_high`, else its paper's)."""
        from lt_opd_ray.core.rl import CLIP_RANGES  # torch's module: the config stays importable without it

        low, high = CLIP_RANGES[self.mode]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    @model_validator(mode="after")
    def _terms_of_the_rl_baselines(self) -> ObjectiveConfig:
        for name in ("kl_coef", "clip_low", "clip_high", "dual_clip", "scale_advantages"):
            if getattr(self, name) != type(self).model_fields[name].default and not self.policy_gradient:
                raise ValueError(f"objective.{name} is the RL baselines' (grpo, dapo, gspo); objective.mode {self.mode} trains no"
                                 " clipped policy gradient")
        if self.mode == "gspo" and self.dual_clip != type(self).model_fields["dual_clip"].default:
            raise ValueError("objective.dual_clip caps a token's term; objective.mode gspo clips one ratio per response and takes"
                             " no dual clip (as verl's GSPO)")
        for name in ("importance", "importance_clip"):
            if self.policy_gradient and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"objective.{name} weighs the distillation modes' divergence; objective.mode {self.mode} corrects"
                                 " for rollouts of older weights by its clipped ratio instead (objective.clip_low, clip_high)")
        return self


class SamplingConfig(StrictModel):
    prompts_per_step: int = Field(80, ge=1, le=MAX_PROMPTS_PER_STEP)
    """Prompts per rollout batch (one optimizer step per batch)."""
    n: int = Field(8, ge=1, le=MAX_RESPONSES_PER_PROMPT)
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature of the rollout policy (above ~2 a policy samples noise; 10 is far past any use)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass of the rollout policy."""
    max_new_tokens: int = Field(1024, ge=1, le=MAX_SEQUENCE_TOKENS)
    """Longest response."""
    stop: list[Annotated[str, Field(min_length=1)]] = Field(["</answer>"], max_length=4)
    """Strings that end a response (besides EOS); the stop string is kept in the response. At most 4: the served
    student ends at them too, and a chat request carries at most 4 (OpenAI's API, vLLM's server)."""


JUDGE_REWARD = "judge"  # reward.name of a reward that needs a model: evals/judge.py, served by pools.reward


class RewardConfig(StrictModel):
    """How each sampled response is scored, one number per response, on the rollout workers (evals/rewards.py).
    The update's mean reward is in every step line, steps.jsonl and the trackers."""

    name: str | None = None
    """`answer` (1 where the response's <answer> equals the row's, case aside), `answer_normalised` (after the VQA
    normalisation), `choice` (the option letter it commits to), `format` (1 where it answers inside <answer> tags),
    `judge` (a model's verdict: `judge` below), or your own `module:function`, called with the rows and the responses'
    texts and returning one number per response (importable where the rollout workers run). None: no reward. The
    answer rewards and the judge need an `answer` on every training row (`lt-opd validate` names the rows without one)."""
    judge: str | None = None
    """reward.name `judge`: the judge model (a folder, `tiny:<family>`, `toy:<task>`), a VLM asked for each response
    whether it gives its row's reference answer (it reads the row's images, question and answer); the reward is its
    probability of "yes" against "no" (evals/judge.py). It runs as its own Ray Serve pool, `pools.reward`, scaled
    apart from the others; the rollout workers ask it as they sample."""
    overlong_buffer: int = Field(0, ge=0, le=MAX_SEQUENCE_TOKENS)
    """DAPO's soft overlong punishment: a response longer than sampling.max_new_tokens - overlong_buffer loses
    (length - (max_new_tokens - overlong_buffer)) / overlong_buffer from its reward, 1 at max_new_tokens. 0: none."""
    dynamic_sampling_rounds: int = Field(0, ge=0, le=MAX_DYNAMIC_SAMPLING_ROUNDS)
    """DAPO's dynamic sampling (the RL baselines): a prompt whose responses all get the same reward, after the overlong
    punishment (zero advantages, no gradient; DAPO's paper judges the answers' accuracy, which differs only where the
    punishment tells responses apart), gives its place in the update to a training row drawn at random, sampled before
    the learners start, up to this many times per place, each place moving on as soon as its own group is judged
    (core/dynamic_sampling.py); one still flat after the last takes no part in the step (no loss, no place in its
    normaliser: DAPO's filter; a step left with none has a zero gradient, though AdamW's momentum and weight decay
    still move the weights and the learning rate still steps). Every prompt is its own rollout group (schedule.group_prompts 1). The step line counts
    the replacements (one per place per round) and the places kept flat. 0: off."""

    @property
    def uses_judge(self) -> bool:
        """The reward needs a model: the judge, served by pools.reward."""
        return self.name == JUDGE_REWARD
