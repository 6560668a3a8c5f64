"""A job YAML read into a `JobConfig`: `--set` overrides applied, every problem named with its field and line."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import yaml
from pydantic import ValidationError

from lt_opd_ray.config.schema import JobConfig


class JobConfigError(ValueError):
    """A job YAML that does not fit the schema; `problems` lists (location, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {where}: {reason}" for where, reason in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def _yaml_line(root: yaml.Node | None, path: tuple) -> int | None:
    """1-based line of the deepest YAML node along `path` (keys and list indices)."""
    node, line = root, None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _unknown_key(path: tuple) -> str:
    """"unknown key", with the nearest key the schema has at that place when one is near (a misspelling)."""
    import difflib

    from pydantic import BaseModel

    model = JobConfig
    for key in path[:-1]:
        field = model.model_fields.get(str(key))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "unknown key"
        model = annotation
    near = difflib.get_close_matches(str(path[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f"unknown key; did you mean {near[0]}?" if near else "unknown key"


def _keys_given_twice(node: yaml.Node | None, path: tuple = ()) -> list[tuple[str, str]]:
    """Every mapping key the YAML gives twice (YAML loaders keep the last silently), with both lines."""
    problems = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.value in first:
                dotted = ".".join((*path, str(key.value)))
                problems.append((f"{dotted} (lines {first[key.value]} and {line})", "given twice; keep one"))
            first.setdefault(key.value, line)
            problems += _keys_given_twice(value, (*path, str(key.value)))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            problems += _keys_given_twice(item, (*path, str(index)))
    return problems


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...], source: str) -> dict:
    """`data` with each `dotted.path=value` set (the value read as YAML: numbers, booleans, lists); sections on the
    path are created as needed, and the schema then judges the result as it judges the file."""
    out = copy.deepcopy(data)
    for override in overrides:
        path, sep, value = override.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise JobConfigError(source, [(f"--set {override}", "expected --set dotted.path=value, e.g. optimizer.lr.language_model=2e-6")])
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise JobConfigError(source, [(f"--set {path}", f"value {value!r} is not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
        node = out
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise JobConfigError(source, [(f"--set {path}", f"{'.'.join(keys[: depth + 1])} is a value, not a section")])
        node[keys[-1]] = parsed
    return out


def parse_job(text: str, source: str = "<job>", overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Parse and validate YAML text (with `--set` overrides applied); raise JobConfigError naming every bad field,
    by YAML line, or by the `--set` that gave it."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "yaml"
        raise JobConfigError(source, [(where, f"not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
    except RecursionError:
        raise JobConfigError(source, [("yaml", "nested too deeply to be a job (a job is at most four levels deep)")]) from None
    if not isinstance(data, dict):
        raise JobConfigError(source, [("<top>", "a job YAML must be a mapping of sections")])
    if twice := _keys_given_twice(root):
        raise JobConfigError(source, twice)
    data = apply_overrides(data, overrides, source)
    overridden = [o.partition("=")[0].strip() for o in overrides]
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as exc:
        located = []
        for err in exc.errors():
            path = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
            dotted = ".".join(str(p) for p in path) or "<top>"
            line = _yaml_line(root, path)
            if any(dotted == o or dotted.startswith(o + ".") for o in overridden):
                line, where = 0, f"{dotted} (--set)"
            else:
                where = f"{dotted} (line {line})" if line else dotted
            reason = _unknown_key(path) if err["type"] == "extra_forbidden" else err["msg"]
            located.append((line or 0, where, reason))
        located.sort(key=lambda item: item[0])  # in file order; fields missing from the file first
        raise JobConfigError(source, [(where, reason) for _, where, reason in located]) from None
    _check_cross_fields(job, source, root)
    return job


def _check_cross_fields(job: JobConfig, source: str, root: yaml.Node | None) -> None:
    """Rules that span sections."""
    problems = []
    # The largest image the processor lets through has max_pixels / (patch*merge)^2 visual tokens
    # at Qwen's 16-pixel patches and 2x2 merge; a k_min above that means the budget never applies.
    max_tokens = math.floor(job.data.max_pixels / (16 * 2) ** 2)
    if job.budget.k_min > max_tokens:
        line = _yaml_line(root, ("budget", "k_min"))
        problems.append(
            (
                f"budget.k_min (line {line})" if line else "budget.k_min",
                f"k_min ({job.budget.k_min}) is above N = {max_tokens}, the visual tokens of the largest"
                f" image allowed by data.max_pixels ({job.data.max_pixels})",
            )
        )
    if job.sampling.prompts_per_step < job.pools.learner.ranks:
        problems.append(
            (
                "pools.learner.ranks",
                f"{job.pools.learner.ranks} ranks but only {job.sampling.prompts_per_step} prompts per update"
                " (sampling.prompts_per_step): every rank needs at least one prompt",
            )
        )
    if job.budget.decay_end > job.budget.total_steps:
        problems.append(("budget.decay_end", f"decay_end ({job.budget.decay_end}) is after total_steps ({job.budget.total_steps})"))
    if problems:
        raise JobConfigError(source, problems)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load and validate a job YAML file, with `--set dotted.path=value` overrides applied."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise JobConfigError(str(path), [("<file>", f"cannot read: {exc.strerror}")]) from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise JobConfigError(str(path), [("<file>", "UTF-16 text: save the job as UTF-8")])
    if b"\x00" in raw:
        raise JobConfigError(str(path), [("<file>", f"binary data (a NUL byte at offset {raw.index(0)}), not a YAML text file")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise JobConfigError(str(path), [(f"line {line}", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): save the job as UTF-8")]) from None
    return parse_job(text, source=str(path), overrides=overrides)
