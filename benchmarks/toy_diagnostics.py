"""Why a toy student recovers as fast as it does: its confidence when pruned, and a supervised ceiling.

    python benchmarks/toy_diagnostics.py confidence            # the untrained student's answer token at the target budget
    python benchmarks/toy_diagnostics.py supervised --steps 400  # cross-entropy on the reference responses at the budget

`confidence` teacher-forces each held-out item's reference response through the
pruned student and reads the distribution at the answer's first token: a student
that is confidently wrong there sits where JSD's gradient vanishes.
`supervised` trains the student single-process with cross-entropy on the reference
responses, its own selector choosing the kept tokens each step (as LT-OPD's
rollouts do), and evaluates held-out accuracy per eval selector: how much of what
pruning removes this architecture can recover at all, and how fast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.core.optim import module_of
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.evaluation import evaluate_answers
from lt_opd_ray.models.loading import load_vlm
from lt_opd_ray.models.processor import VLMProcessor, encode_samples
from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir
from lt_opd_ray.sources.toy.tasks import toy_task

ANSWER_TAG = "<answer>"


def answer_position(tokenizer, response: str) -> tuple[torch.Tensor, int]:
    """The response's token ids and the index of the answer's first token."""
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    prefix = tokenizer(response[: response.index(ANSWER_TAG) + len(ANSWER_TAG)], add_special_tokens=False)["input_ids"]
    if ids[: len(prefix)] != prefix:
        raise ValueError(f"the tokenizer merges across the answer tag in {response!r}")
    return torch.tensor(ids), len(prefix)


@torch.no_grad()
def confidence(job, vlm: QwenVLM, processor: VLMProcessor, task, count: int) -> None:
    items = task.items(count, "test")
    prompts = encode_samples(processor, [item.sample for item in items])
    selector = build_selector(job.selector.name)
    top, right = [], []
    for item, prompt in zip(items, prompts):
        ids, position = answer_position(processor.tokenizer, item.response)
        features = vlm.visual_features(prompt)
        kept = vlm.select(prompt, features, selector, job.budget.target_bps, job.budget.k_min)
        hidden = vlm.response_hidden([vlm.reduce(prompt, features, kept)], [ids])[0]
        probs = vlm.lm_head(hidden[position]).softmax(-1)  # row i scores response token i
        top.append(float(probs.max()))
        right.append(float(probs[ids[position]]))
    print(f"untrained student at {job.budget.target_bps / 100:g}% ({job.selector.name}), {count} held-out items, answer's first token:")
    print(f"  mean top probability {statistics.fmean(top):.3f}, share above 0.9 {sum(p > 0.9 for p in top) / count:.2f},"
          f" mean probability of the right token {statistics.fmean(right):.3f}")


def supervised(job, vlm: QwenVLM, processor: VLMProcessor, task, steps: int, every: int, items_per_step: int) -> None:
    model = vlm.model.train()
    train = task.items(2048, "train")
    prompts = encode_samples(processor, [item.sample for item in train])
    targets = [answer_position(processor.tokenizer, item.response)[0] for item in train]
    groups: dict[str, list] = {}
    for name, param in model.named_parameters():
        groups.setdefault(module_of(name), []).append(param)
    optimizer = torch.optim.AdamW(  # the job's per-module rates, no warm-up
        [{"params": params, "lr": getattr(job.optimizer.lr, module)} for module, params in groups.items()],
        betas=job.optimizer.betas, eps=job.optimizer.eps, weight_decay=job.optimizer.weight_decay,
    )
    selector = build_selector(job.selector.name)
    held_out = load_samples(job.eval.data)
    order = torch.Generator().manual_seed(0)
    begin = time.perf_counter()

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            accuracy = {
                name: evaluate_answers(vlm, processor, held_out, job.budget.target_bps, name, job.budget.k_min,
                                       max_new_tokens=job.eval.max_new_tokens).accuracy
                for name in job.eval.selectors
            }
        model.train()
        print(f"step {step:4d}  " + "  ".join(f"acc[{n}] {a:.3f}" for n, a in accuracy.items())
              + f"  {time.perf_counter() - begin:.0f}s", flush=True)

    evaluate(0)
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(train), (items_per_step,), generator=order).tolist()
        reduced = []
        for i in batch:
            features = vlm.visual_features(prompts[i])
            kept = vlm.select(prompts[i], features, selector, job.budget.target_bps, job.budget.k_min)
            reduced.append(vlm.reduce(prompts[i], features, kept))
        hidden = vlm.response_hidden(reduced, [targets[i] for i in batch])
        loss = sum(torch.nn.functional.cross_entropy(vlm.lm_head(h), targets[i]) for h, i in zip(hidden, batch)) / len(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optimizer.grad_clip)
        optimizer.step()
        if step % every == 0:
            evaluate(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["confidence", "supervised"])
    parser.add_argument("--job", default="jobs/toy_circles.yaml")
    parser.add_argument("--items", type=int, default=128, help="held-out items for `confidence`")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--items-per-step", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    job = load_job(args.job)
    task = toy_task(job.model.path.removeprefix("toy:"))
    model_dir, model = load_vlm(resolve_model_dir(job.model.path), "cpu")
    vlm, processor = QwenVLM(model.eval()), VLMProcessor(model_dir)
    if args.part == "confidence":
        confidence(job, vlm, processor, task, args.items)
    else:
        supervised(job, vlm, processor, task, args.steps, args.every, args.items_per_step)


if __name__ == "__main__":
    main()
