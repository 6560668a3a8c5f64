"""The toy teachers: small Qwen-architecture VLMs trained here at full visual tokens, one per toy task.

Training is seeded, with a fixed thread count and sample order, so machines with
the same CPU kernels produce the same weights (others the same accuracy up to
float rounding); the folder is cached under a hash of the recipe. A few minutes
on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lt_opd_ray.sources.toy.base import TILE, ToyTask
from lt_opd_ray.sources.toy.tasks import toy_task

KEY_ITEMS = 32  # items per split whose drawing is part of a teacher's key


@dataclass(frozen=True)
class TeacherRecipe:
    task: str = "sizes"
    family: str = "qwen3_vl"
    hidden: int = 64
    layers: int = 4
    vision_hidden: int = 64
    train_vision: bool = True
    # grid sides (tiles) the training images are drawn at, one per image, as real VLMs are
    # pretrained at many resolutions; the full-resolution side only: full tokens only
    resolutions: tuple[int, ...] = (4, 5, 6, 7, 8, 9, 10, 10, 10)
    train_items: int = 2048
    steps: int = 800
    items_per_step: int = 16
    lr: float = 3e-3
    seed: int = 0
    threads: int = 2
    eval_size: int = 128

    def key(self) -> str:
        """The recipe's fields and what the task draws (the pixels, question, answer and response of the first
        KEY_ITEMS items of each split): a change to how its items are drawn retrains; a refactor that draws the same
        items does not."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        for split in ("train", "test"):
            for item in toy_task(self.task).items(KEY_ITEMS, split):
                image = item.sample.images[0].read() if hasattr(item.sample.images[0], "read") else item.sample.images[0]
                digest.update(image.tobytes())
                digest.update(f"{item.sample.question}\0{item.sample.answer}\0{item.response}\0".encode())
        return digest.hexdigest()[:12]


RECIPES = {
    # design 1: the language model learns to count over a random, frozen vision tower
    "board": TeacherRecipe(task="board", train_vision=False, resolutions=(6,), train_items=1024, steps=1500),
    "sizes": TeacherRecipe(),
    "circles": TeacherRecipe(task="circles"),
    # design 4: four kinds of question, a third of the items close calls; trained on all four at full tokens
    "discs": TeacherRecipe(task="discs", train_items=8192, steps=2400),
}


def build_untrained(recipe: TeacherRecipe, out_dir: Path) -> Path:
    """Random initial weights of the recipe's architecture, as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models.tiny import build_tokenizer, image_processor_config, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config(recipe.family, tokenizer, hidden=recipe.hidden, head_dim=16)  # the toy's measured teacher
    config.text_config.num_hidden_layers = recipe.layers
    if recipe.family == "qwen3_5":  # keep the hybrid pattern: every second layer full attention
        config.text_config.layer_types = ["linear_attention", "full_attention"] * (recipe.layers // 2)
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size, vision.num_heads = recipe.vision_hidden, 2 * recipe.vision_hidden, 4
    for part in (config, config.text_config, vision):
        part.initializer_range = 0.02  # trained from scratch: the usual init, not the random-test one
    torch.manual_seed(recipe.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    pixels = toy_task(recipe.task).image_size ** 2
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config(recipe.family, pixels, pixels), indent=2))
    return out_dir


def _at_resolution(sample, side: int):
    """The sample with its image redrawn at `side` x `side` tiles (bilinear), the question unchanged."""
    from dataclasses import replace

    from PIL import Image

    from lt_opd_ray.models.processor import load_image

    image = load_image(sample.images[0], sample.uid)
    if image.width == side * TILE:
        return replace(sample, images=(image,))
    return replace(sample, images=(image.resize((side * TILE, side * TILE), Image.BILINEAR),))


class TrainingPrompts:
    """Each training item encoded at one of the recipe's resolutions (one seeded draw per item, made up front),
    encoded when a step asks for it: 8,192 items encoded at once would hold ~20 GB of pixels."""

    def __init__(self, recipe: TeacherRecipe, task: ToyTask, out_dir: Path, items):
        import random

        from lt_opd_ray.models.processor import VLMProcessor

        low, high = min(recipe.resolutions) * TILE, task.image_size
        self.processor = VLMProcessor(out_dir, min_pixels=low * low, max_pixels=high * high)
        draw = random.Random(recipe.seed)
        self.items, self.sides = items, [draw.choice(recipe.resolutions) for _ in items]

    def __getitem__(self, index: int):
        from lt_opd_ray.models.processor import encode_samples

        return encode_samples(self.processor, [_at_resolution(self.items[index].sample, self.sides[index])])[0]


def train_teacher(recipe: TeacherRecipe, out_dir: Path, log=print) -> dict:
    """Cross-entropy on the task's reference responses at full tokens; returns the training record it also writes.

    `train_vision`: the vision tower learns with the rest (design 2), or stays at
    its random initialisation (design 1, board: the language model then counts
    over all visual tokens, like a VLM whose encoder only has local features).
    """
    import torch

    from lt_opd_ray.core.families import family_of
    from lt_opd_ray.core.optim import module_of
    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.evaluation import evaluate_answers
    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor

    task = toy_task(recipe.task)
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    build_untrained(recipe, out_dir)
    _, model = load_vlm(str(out_dir), "cpu")
    vlm = QwenVLM(model.train())
    family = family_of(model.config.model_type)
    for name, param in model.named_parameters():
        param.requires_grad_(recipe.train_vision or module_of(name, family) != "vision_encoder")
    train = task.items(recipe.train_items, task.teacher_split)
    prompts = TrainingPrompts(recipe, task, out_dir, train)
    tokenizer = VLMProcessor(out_dir).tokenizer
    targets = [torch.tensor(tokenizer(item.response, add_special_tokens=False)["input_ids"]) for item in train]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.lr, weight_decay=0.0)
    # linear warm-up over the first 5%, then cosine decay to zero
    warmup = max(1, recipe.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, recipe.steps) / recipe.steps))
    )
    order = torch.Generator().manual_seed(recipe.seed)
    losses, begin = [], time.perf_counter()
    for step in range(recipe.steps):
        batch = torch.randint(0, len(train), (recipe.items_per_step,), generator=order).tolist()
        full = []
        for i in batch:
            prompt = prompts[i]
            features = vlm.visual_features(prompt)
            full.append(vlm.reduce(prompt, features, vlm.keep_all(features)))
        hidden = vlm.response_hidden(full, [targets[i] for i in batch])
        loss = sum(torch.nn.functional.cross_entropy(vlm.lm_head(h), targets[i]) for h, i in zip(hidden, batch)) / len(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == recipe.steps - 1:
            log(f"{task.name} teacher step {step + 1}/{recipe.steps}  loss {losses[-1]:.4f}  {time.perf_counter() - begin:.0f}s")
    model.save_pretrained(out_dir)
    held_out = task.samples(recipe.eval_size, "test")
    model.eval()
    accuracy = evaluate_answers(vlm, VLMProcessor(out_dir), held_out, 10_000, max_new_tokens=task.response_tokens).accuracy
    record = {"recipe": asdict(recipe), "key": recipe.key(), "losses": losses, "full_token_accuracy": accuracy, "seconds": time.perf_counter() - begin}
    (out_dir / "training.json").write_text(json.dumps(record))
    log(f"{task.name} teacher: full-token accuracy {accuracy:.3f} on {recipe.eval_size} held-out items")
    return record


SHIPPED = Path(__file__).parent / "teachers"  # teachers small enough to ship: <task>/, trained by `python -m lt_opd_ray.sources.toy.teacher --ship <task>`


def shipped_teacher(recipe: TeacherRecipe) -> Path | None:
    """The teacher shipped with the package for `recipe`, if one was trained by exactly this recipe on the items the task draws now (`TeacherRecipe.key`)."""
    folder = SHIPPED / recipe.task
    record = folder / "training.json"
    if record.exists() and json.loads(record.read_text()).get("key") == recipe.key():
        return folder
    return None


def toy_teacher_dir(recipe: TeacherRecipe, cache_root: str | Path | None = None, log=print) -> Path:
    """The trained toy teacher for `recipe`: the shipped one when it matches, else trained once into a cache folder
    (atomic rename when complete). A shipped teacher is the same on every CPU; one trained here is the same only
    on CPUs with the same float kernels."""
    shipped = shipped_teacher(recipe)
    if shipped is not None:
        return shipped
    root = Path(cache_root or os.environ.get("LT_OPD_CACHE", Path.home() / ".cache" / "lt-opd-ray"))
    target = root / "toy" / f"{recipe.task}-teacher-{recipe.key()}"
    if not (target / "training.json").exists():
        staging = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        train_teacher(recipe, staging, log)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def ship(task: str) -> Path:
    """Train `task`'s teacher (or take it from the cache) and copy it into the package, replacing the shipped one."""
    trained = toy_teacher_dir(RECIPES[task])  # the shipped folder itself when it already matches
    target = SHIPPED / task
    if trained != target:
        staging = target.with_name(task + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(trained, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Ship a toy task's trained teacher with the package.")
    parser.add_argument("--ship", required=True, choices=sorted(RECIPES), help="the toy task whose teacher to ship")
    print(f"shipped: {ship(parser.parse_args().ship)}")
