"""The trained student as a servable folder: a standard Hugging Face checkpoint plus its compression config.

`lt_opd_compression.json` (selector, budget_bps, k_min, merge) travels with the weights:
our vLLM plugin applies it to every request that does not set its own selection,
so `lt-opd serve DIR` (or `vllm serve DIR` with this package installed) answers at
the student's budget. The folder is assembled beside its destination and renamed
into place (`core.outputs`), so a failed export never leaves a half-written folder under that name,
and `--force` replaces only an earlier export, never a folder export did not write.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
from lt_opd_ray.core.model_files import ModelFolderError, check_model_folder, write_file_list
from lt_opd_ray.core.outputs import OutputFolder, OutputFolderError


class ExportError(RuntimeError):
    pass


def export_student(job, out_dir: str | Path, step: int | None = None, force: bool = False) -> Path:
    """Write the job's student to `out_dir`: from `<checkpoint.dir>/final`, or from checkpoint `step-<step>`."""
    from lt_opd_ray.core.storage import RunStorage

    storage = RunStorage(job.checkpoint.dir, job.checkpoint.staging_dir)
    if not storage.names():
        raise ExportError(f"no run at {job.checkpoint.dir} (the job's checkpoint.dir): nothing to export")
    destination = OutputFolder(Path(out_dir), "export", force)
    try:
        staging = destination.staging()  # refuses a destination export may not write, before any work
    except OutputFolderError as exc:
        raise ExportError(str(exc)) from None
    try:
        if step is None:
            if storage.read_text("final/config.json") is None:  # written last: a final/ without it is unfinished
                raise ExportError(
                    f"{storage.describe('final')}: no finished student (the run has not reached budget.total_steps);"
                    f" export a checkpoint with --step (available: {_steps(storage) or 'none'})"
                )
            if storage.remote:
                storage.get("final", into=staging)
            else:
                _check_final(storage.local / "final", storage.describe("final"))
                shutil.copytree(storage.local / "final", staging, symlinks=True, dirs_exist_ok=True)  # a link stays a link: refused below
            _check_final(staging, storage.describe("final"))  # what was copied, links and FIFOs included
        else:
            _from_deepspeed_checkpoint(job, storage, step, staging)
        CompressionConfig.from_job(job).write(staging)
        _write_serving_defaults(job, staging)
        write_file_list(staging)
        _check_loadable(staging)
        return destination.publish(staging)
    except OSError as exc:  # shutil.Error too: a full disk, a folder it may not write
        destination.discard(staging)
        raise ExportError(f"writing {staging} failed ({_first_os_error(exc)}); nothing was left there") from exc
    except BaseException:
        destination.discard(staging)
        raise


def _write_serving_defaults(job, folder: Path) -> None:
    """The job's stop strings and the end tokens its rollouts stopped at (the folder tokenizer's and its generation
    config's), the defaults `lt-opd serve` answers with."""
    from transformers import AutoTokenizer

    from lt_opd_ray.models.processor import end_of_sequence_ids

    ServingDefaults(tuple(job.sampling.stop), end_of_sequence_ids(folder, AutoTokenizer.from_pretrained(folder))).write(folder)


def _check_final(folder: Path, where: str) -> None:
    from lt_opd_ray.core.regular_files import irregular_entry

    if irregular := irregular_entry(folder):  # nothing is exported through a link (a notes.md -> ~/.aws/credentials)
        raise ExportError(f"{where} is not exported: {irregular.replace(str(folder), where)}")
    try:
        check_model_folder(folder)
    except ModelFolderError as exc:
        raise ExportError(f"{where} is damaged: {str(exc).replace(str(folder), where)}; export a checkpoint with --step instead") from None


def _first_os_error(exc: OSError) -> str:
    """What went wrong, in words: copytree gathers its per-file errors as (source, target, why) in a shutil.Error."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        source, _, why = exc.args[0][0]
        return f"{why} (copying {source}; {len(exc.args[0])} file(s) failed)"
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _steps(storage) -> list[int]:
    from lt_opd_ray.runtime.checkpoint_files import step_of

    return sorted(step for n in storage.names() if (step := step_of(n)) is not None and storage.read_text(f"{n}/driver_state.json") is not None)


def _from_deepspeed_checkpoint(job, storage, step: int, staging: Path) -> None:
    """fp32 weights gathered from the ZeRO partitions of one complete checkpoint, saved over the base model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from lt_opd_ray.models.loading import load_vlm
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.runtime.checkpoint_files import CheckpointError, Manifest, damage, private_copy, weights_only_loads
    from lt_opd_ray.sources.resolve import resolve_model_dir

    tag = f"step-{step}"
    if storage.read_text(f"{tag}/driver_state.json") is None:
        raise ExportError(f"{storage.describe(tag)}: no complete checkpoint (available steps: {_steps(storage) or 'none'})")
    fetched = staging.with_name(staging.name + ".checkpoint") if storage.remote else storage.local
    if storage.remote:
        storage.get(tag, into=fetched / tag)
    private = Path(tempfile.mkdtemp(prefix=".lt-opd-export-", dir=staging.parent))  # 0700: only this user writes it
    try:
        if why := damage(fetched / tag):  # links, FIFOs, sizes, SHA-256 and weights-only pickles, before any loader opens a file
            raise ExportError(f"{storage.describe(tag)}: not exported, the checkpoint is damaged or untrusted: {why}")
        try:  # DeepSpeed's reader globs its folder and unpickles: it reads a private copy of what was hashed, weights-only
            private_copy(fetched / tag, Manifest.read(fetched / tag).files, private / tag)
        except CheckpointError as exc:
            raise ExportError(f"{storage.describe(tag)}: not exported, the checkpoint is damaged or untrusted: {exc}") from None
        with weights_only_loads():
            state = get_fp32_state_dict_from_zero_checkpoint(str(private), tag=tag)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        if storage.remote:
            shutil.rmtree(fetched, ignore_errors=True)
    prefix = "model."  # the DeepSpeed module wraps the Hugging Face model as `.model`
    weights = {name[len(prefix) :]: tensor for name, tensor in state.items() if name.startswith(prefix)}
    model_dir, model = load_vlm(resolve_model_dir(job.model.path), token_merge=job.selector.merge == "learnable")
    expected = set(model.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:5], sorted(set(weights) - expected)[:5]
        raise ExportError(f"{storage.describe(tag)}: weights do not match {job.model.path} (missing {missing}, unexpected {extra})")
    model.save_pretrained(staging, state_dict=weights)
    processor = VLMProcessor.for_data(model_dir, job.data)
    processor.tokenizer.save_pretrained(staging)
    processor.image_processor.save_pretrained(staging)


def _check_loadable(folder: Path) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - any failure means the folder is not a usable checkpoint
        raise ExportError(f"{folder}: the exported folder does not load as a Hugging Face model: {exc}") from None
