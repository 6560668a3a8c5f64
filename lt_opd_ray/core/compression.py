"""The compression a served student applies to its images: selector, budget, k_min, merge (`lt_opd_compression.json`).

Written by `lt-opd export` beside the weights; read by the vLLM plugin, `lt-opd serve` and the driver.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

COMPRESSION_FILE = "lt_opd_compression.json"
MERGES = ("none", "learnable")  # selector.merge's values (config/schema.py)


@dataclass(frozen=True)
class CompressionConfig:
    selector: str
    budget_bps: int  # visual budget r in basis points (500 = 5%)
    k_min: int
    merge: str = "none"  # "learnable": the kept tokens take in their discarded neighbours (the head is in the weights)

    @classmethod
    def from_job(cls, job) -> CompressionConfig:
        return cls(selector=job.selector.name, budget_bps=job.budget.target_bps, k_min=job.budget.k_min, merge=job.selector.merge)

    def write(self, folder: Path) -> None:
        (Path(folder) / COMPRESSION_FILE).write_text(json.dumps({"format": 1, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> CompressionConfig | None:
        """The folder's compression config, or None when it has none (a stock model: every token). A folder in the
        paper's release layout has none of ours: its `vision_token_compressor` (config.json) says the same."""
        path = Path(folder) / COMPRESSION_FILE
        if not path.exists():
            return cls.from_release(Path(folder) / "config.json")
        data = json.loads(path.read_text())
        try:
            config = cls(selector=str(data["selector"]), budget_bps=int(data["budget_bps"]), k_min=int(data["k_min"]), merge=str(data.get("merge", "none")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a compression config ({exc!r}); expected selector, budget_bps, k_min") from None
        if config.merge not in MERGES:
            raise ValueError(f"{path}: merge {config.merge!r}; one of {', '.join(MERGES)}")
        return config

    @classmethod
    def from_release(cls, config_path: Path) -> CompressionConfig | None:
        """The release's compressor settings as ours: CDPruner at its final retention, at least
        `minimum_tokens_per_image` tokens per image, the learnable merge when enabled."""
        if not config_path.exists():
            return None
        settings = json.loads(config_path.read_text()).get("vision_token_compressor")
        if not settings or not settings.get("enabled"):
            return None
        if settings.get("method") != "cdpruner":
            raise ValueError(f"{config_path}: vision_token_compressor.method {settings.get('method')!r}; this runtime implements cdpruner")
        curriculum = settings.get("curriculum") or {}
        bps = curriculum.get("final_retention_bps") if curriculum.get("enabled") else round(float(settings.get("retention_ratio", 0.05)) * 10000)
        merge = "learnable" if learnable_merge({"vision_token_compressor": settings}) is not None else "none"
        return cls(selector="cdpruner", budget_bps=int(bps), k_min=int(settings.get("minimum_tokens_per_image", 1)), merge=merge)


def learnable_merge(config) -> dict | None:
    """The learnable token merge a model config names (a config.json dict or a transformers config; ours and the
    paper's release write the same `vision_token_compressor.learnable_merge` entry), or None when it names none."""
    entry = config.get("vision_token_compressor") if isinstance(config, dict) else getattr(config, "vision_token_compressor", None)
    merge = (entry.get("learnable_merge") or {}) if isinstance(entry, dict) else {}
    return merge if merge.get("enabled") else None


GENERATION_CONFIG = "generation_config.json"
SERVING_FILE = "lt_opd_serving.json"
MAX_STOP = 4  # stop strings one chat request carries (OpenAI's API, vLLM's server)


@dataclass(frozen=True)
class ServingDefaults:
    """Where a served student's answer ends unless a request says otherwise: the job's stop strings
    (`lt_opd_serving.json`, read by both servers: the request guard in front of vLLM fills a request's stop field from
    it, the transformers engine its own) and every token that ended a response in training, the tokenizer's end token
    and the base model's (generation_config.json's `eos_token_id`, which vLLM and transformers read themselves). The
    stop strings stay out of generation_config.json: transformers' `generate` refuses `stop_strings` there unless
    every caller passes the tokenizer."""

    stop: tuple[str, ...]
    end_token_ids: tuple[int, ...]

    def write(self, folder: Path) -> None:
        """The stop strings into lt_opd_serving.json; the end tokens into generation_config.json, its other fields kept."""
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings {list(self.stop)[:8]}: at most {MAX_STOP} non-empty strings (a chat request carries at most {MAX_STOP})")
        (Path(folder) / SERVING_FILE).write_text(json.dumps({"format": 1, "stop": list(self.stop)}, indent=2) + "\n")
        path = Path(folder) / GENERATION_CONFIG
        config = _json_object(path) if path.exists() else {}
        config["eos_token_id"] = list(self.end_token_ids)
        path.write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def read(cls, folder: str | Path) -> ServingDefaults:
        """The folder's defaults; a folder without them (a base model): no stop string, its generation config's end tokens."""
        serving, generation = Path(folder) / SERVING_FILE, Path(folder) / GENERATION_CONFIG
        stop = _json_object(serving).get("stop", []) if serving.exists() else []
        ends = _json_object(generation).get("eos_token_id") if generation.exists() else None
        ends = [] if ends is None else [ends] if isinstance(ends, int) and not isinstance(ends, bool) else ends
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"{serving}: stop must be a list of at most {MAX_STOP} non-empty strings (a chat request carries at most"
                             f" {MAX_STOP}); got {str(stop)[:200]}")
        if not isinstance(ends, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ends):
            raise ValueError(f"{generation}: eos_token_id must be an integer or a list of integers; got {str(ends)[:200]}")
        return cls(tuple(stop), tuple(ends))


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
