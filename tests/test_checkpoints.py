"""Checkpoints that can be trusted: verified against their manifest at resume and export, weights-only pickles,
pruning by the run's own history, a full disk named as such, one step history across resumes.

Real runs on a local Ray cluster (real DeepSpeed ZeRO-3 checkpoints of a tiny Qwen3.5); the damage is done to
copies of a finished run's folder, as a disk, an operator or an attacker would do it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import job_for

from lt_opd_ray.core.storage import RunStorage
from lt_opd_ray.runtime.checkpoint import CheckpointStore, PassedOver, Restored
from lt_opd_ray.runtime.checkpoint_files import MANIFEST, CheckpointError, Manifest, damage, write_failure
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.learner_group import FINISH_TIMEOUT_S
from lt_opd_ray.runtime.launch import RunFolderError, claim_run_folder, start_history
from lt_opd_ray.serving.export import ExportError, export_student

STEPS = 3


def small_job(model_dir, folder, keep=STEPS, name="ck"):
    job = job_for(model_dir, folder, ranks=2, zero_stage=3, every=1, total=12, name=name)
    return job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"keep": keep})})


def run_steps(job, steps, roles, resume=False):
    driver = Driver(job, resume=resume, roles=roles)
    try:
        logs = [driver.run_step() for _ in range(steps)]
        return driver.restored, logs
    finally:
        driver.shutdown()


@pytest.fixture(scope="module")
def finished(cluster, kept, tiny_dirs, tmp_path_factory):
    """A run of STEPS updates, checkpointed after each (step-1 .. step-3)."""
    folder = tmp_path_factory.mktemp("finished")
    run_steps(small_job(tiny_dirs["qwen3_5"], folder), STEPS, kept)
    return folder


def copy_of(finished, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(finished, target)
    return target


def model_file(folder):
    return sorted(folder.glob("*model_states.pt"))[0]


def test_every_checkpoint_has_a_manifest_that_matches_its_files(finished):
    for step in range(1, STEPS + 1):
        folder = finished / f"step-{step}"
        manifest = Manifest.read(folder)
        assert manifest.step == step
        assert set(manifest.files) == {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert damage(folder) is None
    assert len({Manifest.read(finished / f"step-{s}").run_id for s in range(1, STEPS + 1)}) == 1
    assert (finished / "latest").read_text() == f"step-{STEPS}"


def test_damaged_checkpoints_are_passed_over_by_name_down_to_the_newest_intact_one(finished, tmp_path, tiny_dirs):
    folder = copy_of(finished, tmp_path)
    store = CheckpointStore(small_job(tiny_dirs["qwen3_5"], folder))
    assert store.choose() == (f"step-{STEPS}", [])

    # random bytes over the weights, same size: only the hash can tell
    target = model_file(folder / "step-3")
    data = bytearray(target.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    target.write_bytes(bytes(data))
    tag, passed = store.choose()
    assert tag == "step-2"
    assert list(map(str, passed)) == [f"step-3: {target}: SHA-256 differs from the manifest (the file was changed after it was written)"]

    # a truncated optimizer file and a hand-edited driver state
    optimizer = sorted((folder / "step-2").glob("*optim_states.pt"))[0]
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    (folder / "step-1" / "driver_state.json").write_text('{"step": 1, "cursor": 9}')
    with pytest.raises(CheckpointError) as info:
        store.choose()
    message = str(info.value)
    assert f"no intact checkpoint in {folder}" in message
    assert f"{optimizer}: 100 bytes, the manifest says" in message
    assert f"{folder / 'step-1' / 'driver_state.json'}: " in message


def test_a_resume_at_another_number_of_optimizer_steps_an_update_is_refused_by_name(finished, tmp_path, tiny_dirs):
    """The learning-rate schedule counts optimizer steps: a checkpoint trained at one step an update resumed at two
    would move its warm-up. Refused before any weight is loaded (no learner is touched)."""
    folder = copy_of(finished, tmp_path)
    job = small_job(tiny_dirs["qwen3_5"], folder)
    assert json.loads((folder / "step-3" / "driver_state.json").read_text())["steps_per_update"] == 1
    two = job.model_copy(update={"optimizer": job.optimizer.model_copy(update={"steps_per_update": 2})})
    with pytest.raises(CheckpointError, match=r"step-3 was trained at optimizer.steps_per_update 1, the job asks 2: .*"
                                              r" resume with --set optimizer.steps_per_update=1"):
        CheckpointStore(two).restore(None, "step-3", [])


def test_resume_without_latest_takes_the_newest_intact_checkpoint_and_continues_its_run(finished, kept, tmp_path, tiny_dirs):
    folder = copy_of(finished, tmp_path)
    (folder / "latest").unlink()
    (folder / "step-3" / MANIFEST).unlink()  # an unfinished checkpoint (written before its manifest)
    job = small_job(tiny_dirs["qwen3_5"], folder)
    restored, logs = run_steps(job, 1, kept, resume=True)
    assert isinstance(restored, Restored) and restored.tag == "step-2"
    assert list(map(str, restored.passed_over)) == [f"step-3: {folder / 'step-3' / MANIFEST}: missing (an unfinished checkpoint, or one written before manifests)"]
    assert logs[0].step == 2
    # the resumed run wrote step-3 again as the same run: it prunes its own history (keep 3), nothing else
    assert (folder / "latest").read_text() == "step-3" and damage(folder / "step-3") is None
    assert Manifest.read(folder / "step-3").run_id == Manifest.read(folder / "step-1").run_id


def test_a_resume_sets_a_damaged_newer_checkpoint_aside_and_prunes_by_age_not_step(finished, kept, tmp_path, tiny_dirs):
    """A run wrote step-5 and it was damaged (truncated optimizer); the resume takes step-3 and writes step-4. With
    keep 2, pruning by step number would remove the intact step-3 and keep the damaged step-5."""
    folder = copy_of(finished, tmp_path)
    shutil.copytree(folder / "step-3", folder / "step-5")
    optimizer = sorted((folder / "step-5").glob("*optim_states.pt"))[0]
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    (folder / "latest").write_text("step-5")
    restored, _ = run_steps(small_job(tiny_dirs["qwen3_5"], folder, keep=2), 1, kept, resume=True)
    assert restored.tag == "step-3" and [p.tag for p in restored.passed_over] == ["step-5"]
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-3", "step-4", "step-5.damaged"]
    assert (folder / "latest").read_text() == "step-4"
    assert damage(folder / "step-3") is None and damage(folder / "step-4") is None


def test_a_fresh_run_beside_a_finished_one_never_prunes_its_own_newest_checkpoint(finished, kept, tmp_path, tiny_dirs):
    folder = copy_of(finished, tmp_path)
    earlier = Manifest.read(folder / "step-3").run_id
    job = small_job(tiny_dirs["qwen3_5"], folder, keep=1)
    run_steps(job, 1, kept)
    assert (folder / "latest").read_text() == "step-1"
    assert damage(folder / "step-1") is None and Manifest.read(folder / "step-1").run_id != earlier
    assert all(Manifest.read(folder / f"step-{s}").run_id == earlier for s in (2, 3))  # another run's: not pruned
    assert CheckpointStore(job).choose() == ("step-1", [])


class RunsCode:
    """A pickle that touches a file when loaded: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_pickle_that_runs_code_is_refused_at_resume_and_export(finished, tmp_path, tiny_dirs):
    folder = copy_of(finished, tmp_path)
    marker = tmp_path / "pwned"
    target = model_file(folder / "step-3")
    torch.save({"module": RunsCode(marker)}, target)
    Manifest.of(folder / "step-3", Manifest.read(folder / "step-3").run_id, 3).write(folder / "step-3")  # the attacker fixes the manifest too
    job = small_job(tiny_dirs["qwen3_5"], folder)
    tag, passed = CheckpointStore(job).choose()
    assert tag == "step-2" and len(passed) == 1
    assert f"{target}: refused, the file is not weights-only" in str(passed[0]) and "posix.system" in str(passed[0])
    with pytest.raises(ExportError, match="not exported, the checkpoint is damaged or untrusted: .*not weights-only"):
        export_student(job, tmp_path / "out", step=3)
    assert not marker.exists()
    assert (export_student(job, tmp_path / "out2", step=2) / "config.json").exists()


def test_a_file_planted_beside_an_honest_manifest_is_refused_by_name_and_its_pickle_never_runs(finished, tmp_path, tiny_dirs):
    """DeepSpeed's loader opens every *_model_states.pt in the folder, not only those the manifest names."""
    folder = copy_of(finished, tmp_path)
    marker = tmp_path / "pwned"
    planted = folder / "step-3" / "a_model_states.pt"
    torch.save({"module": RunsCode(marker)}, planted)
    job = small_job(tiny_dirs["qwen3_5"], folder)
    tag, passed = CheckpointStore(job).choose()
    assert tag == "step-2" and [p.tag for p in passed] == ["step-3"]
    assert f"{planted}: not named by the checkpoint's manifest (1 such file(s))" in str(passed[0])
    with pytest.raises(ExportError, match=f"{planted}: not named by the checkpoint's manifest"):
        export_student(job, tmp_path / "out", step=3)
    assert not marker.exists()


def plant_link_to_payload(step, outside, marker):
    torch.save({"module": RunsCode(marker)}, outside / "payload.pt")
    os.symlink(outside / "payload.pt", step / "a_model_states.pt")


def plant_dangling_link(step, outside, marker):
    os.symlink(outside / "later.pt", step / "a_model_states.pt")  # its target written after any check ran


def plant_fifo(step, outside, marker):
    os.mkfifo(step / "a_model_states.pt")


def swap_a_listed_file_for_a_link_to_its_copy(step, outside, marker):
    target = model_file(step)
    shutil.copy(target, outside / "copy.pt")
    target.unlink()
    os.symlink(outside / "copy.pt", target)  # the same bytes, read through a link


def plant_a_folder_link(step, outside, marker):
    (outside / "d").mkdir()
    torch.save({"module": RunsCode(marker)}, outside / "d" / "x_model_states.pt")
    os.symlink(outside / "d", step / "sub")


def swap_the_manifest_for_a_link(step, outside, marker):
    shutil.copy(step / MANIFEST, outside / MANIFEST)
    (step / MANIFEST).unlink()
    os.symlink(outside / MANIFEST, step / MANIFEST)


def list_a_file_outside_the_folder(step, outside, marker):
    manifest = json.loads((step / MANIFEST).read_text())
    torch.save({"module": RunsCode(marker)}, outside / "payload.pt")
    manifest["files"]["../../outside/payload.pt"] = [os.path.getsize(outside / "payload.pt"), "0" * 64]
    (step / MANIFEST).write_text(json.dumps(manifest))


IRREGULAR = {
    "a link to a payload": (plant_link_to_payload, "a_model_states.pt: a link"),
    "a dangling link": (plant_dangling_link, "a_model_states.pt: a link"),
    "a FIFO": (plant_fifo, "a_model_states.pt: a FIFO"),
    "a listed file as a link to its copy": (swap_a_listed_file_for_a_link_to_its_copy, "model_states.pt: a link"),
    "a folder link": (plant_a_folder_link, "sub: a link"),
    "the manifest as a link": (swap_the_manifest_for_a_link, f"{MANIFEST}: a link"),
    "a manifest naming a path outside": (list_a_file_outside_the_folder, "names '../../outside/payload.pt', not a path inside the checkpoint folder"),
}


@pytest.mark.parametrize("plant", IRREGULAR.values(), ids=IRREGULAR.keys())
def test_links_fifos_and_paths_outside_make_a_checkpoint_untrusted_and_nothing_is_read_through_them(finished, tmp_path, tiny_dirs, plant):
    """A checkpoint folder holds regular files and folders only, at the paths its manifest names: each form is named
    by resume (which passes over to the checkpoint before) and by export, no FIFO blocks either, and no pickle
    planted behind a link runs, then or when the dangling link's target is written after the check."""
    make, reason = plant
    folder, outside = copy_of(finished, tmp_path), tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "pwned"
    make(folder / "step-3", outside, marker)
    job = small_job(tiny_dirs["qwen3_5"], folder)
    tag, passed = CheckpointStore(job).choose()
    assert tag == "step-2" and [p.tag for p in passed] == ["step-3"] and reason in str(passed[0]), passed
    with pytest.raises(ExportError, match="not exported, the checkpoint is damaged or untrusted"):
        export_student(job, tmp_path / "out", step=3)
    torch.save({"module": RunsCode(marker)}, outside / "later.pt")
    assert damage(folder / "step-3") is not None and not marker.exists()


def test_the_exporters_reader_unpickles_weights_only_and_reads_a_private_copy_of_what_was_hashed(finished, tmp_path):
    """DeepSpeed's zero_to_fp32 unpickles with weights_only=False: under `weights_only_loads` a payload is refused.
    `private_copy` hashes what it copies: a file changed after `damage` read it is refused and nothing is left."""
    from lt_opd_ray.runtime.checkpoint_files import private_copy, weights_only_loads

    marker = tmp_path / "pwned"
    torch.save({"module": RunsCode(marker)}, tmp_path / "payload.pt")
    with weights_only_loads(), pytest.raises(Exception, match="Weights only load failed"):
        torch.load(tmp_path / "payload.pt", weights_only=False)
    assert not marker.exists() and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    step = finished / "step-3"
    listed = Manifest.read(step).files
    private_copy(step, listed, tmp_path / "copy")
    assert oct((tmp_path / "copy").stat().st_mode & 0o777) == "0o700"
    assert {str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file()} == set(listed)
    changed = {name: [size, "0" * 64] if name == next(iter(listed)) else [size, digest] for name, (size, digest) in listed.items()}
    with pytest.raises(CheckpointError, match="SHA-256 differs from the manifest"):
        private_copy(step, changed, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_export_copies_no_link_out_of_final(finished, tmp_path, tiny_dirs):
    """A `final/notes.md -> ~/.aws/credentials` link: the export is refused by name and writes nothing."""
    folder = copy_of(finished, tmp_path)
    job = small_job(tiny_dirs["qwen3_5"], folder)
    export_student(job, folder / "final", step=3)  # a finished student's folder
    (tmp_path / "credentials").write_text("aws_secret_access_key = wJalr")
    os.symlink(tmp_path / "credentials", folder / "final" / "notes.md")
    with pytest.raises(ExportError, match=r"final is not exported: .*notes.md: a link"):
        export_student(job, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (folder / "final" / "notes.md").unlink()
    assert "wJalr" not in "".join(p.read_text(errors="replace") for p in export_student(job, tmp_path / "out").rglob("*") if p.is_file())


def test_a_folder_named_like_a_step_in_other_digits_is_no_checkpoint(finished, tmp_path, tiny_dirs):
    """`step-²` (a digit to str.isdigit, not to int): passed by as no checkpoint's name; `latest` naming it is refused."""
    folder = copy_of(finished, tmp_path)
    shutil.copytree(folder / "step-3", folder / "step-²")
    store = CheckpointStore(small_job(tiny_dirs["qwen3_5"], folder))
    assert store.choose()[0] == "step-3"
    (folder / "latest").write_text("step-²")
    with pytest.raises(CheckpointError, match="names 'step-²', not a checkpoint name a run writes"):
        store.choose()


@pytest.mark.parametrize("pointer", ["../outside", "/tmp/elsewhere", "step-1/../../outside", "step-2\n../x", "final"])
def test_a_latest_pointer_that_is_no_checkpoint_name_is_refused_and_moves_nothing(finished, tmp_path, tiny_dirs, pointer):
    """`latest` is read as a checkpoint's name only when it is one a run writes (step-N): a path would be renamed to
    *.damaged, or downloaded over, as if it were a checkpoint."""
    folder = copy_of(finished, tmp_path)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("mine")
    (folder / "latest").write_text(pointer)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(CheckpointError, match=f"{folder / 'latest'} names .* not a checkpoint name a run writes \\(step-N\\)"):
        CheckpointStore(small_job(tiny_dirs["qwen3_5"], folder)).choose()
    assert sorted(p.name for p in folder.iterdir()) == before and (tmp_path / "outside" / "keep.txt").read_text() == "mine"


def test_a_full_disk_is_named_and_keeps_the_previous_checkpoint(cluster, kept, tiny_dirs, tmp_path, finished):
    # a real disk that fills: a tmpfs sized for one and a half checkpoints (mounting needs root, as CI runs)
    one = sum(p.stat().st_size for p in (finished / "step-1").rglob("*") if p.is_file())
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(one * 1.5) + (1 << 20)}", "tmpfs", str(mount)], check=True)
    try:
        job = small_job(tiny_dirs["qwen3_5"], mount / "ck", keep=3)
        driver = Driver(job, roles=kept)
        try:
            with pytest.raises(CheckpointError) as info:
                for _ in range(2):
                    driver.run_step()
        finally:
            begin = time.perf_counter()
            driver.shutdown()
        # a rank whose write succeeded waits in DeepSpeed's barrier for the one whose write failed: the stop kills the
        # ranks without the leaving barrier, which that barrier would take the place of (FINISH_TIMEOUT_S, 30 s)
        assert driver.learners.interrupted == "writing checkpoint step-2" and time.perf_counter() - begin < FINISH_TIMEOUT_S / 2
        message = str(info.value)
        assert f"writing checkpoint step-2 to {mount / 'ck' / 'step-2'} failed: the disk holding {mount / 'ck' / '.incoming' / 'step-2'}" in message
        assert "is full" in message and "`latest` still names step-1" in message
        assert not (mount / "ck" / ".incoming" / "step-2").exists()  # the space is given back
        assert CheckpointStore(job).choose() == ("step-1", [])
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_write_that_fails_with_enospc_is_reported_as_a_full_disk(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert write_failure(tmp_path, full).startswith(f"the disk holding {tmp_path} is full")
    assert not write_failure(tmp_path, OSError(errno.EACCES, os.strerror(errno.EACCES))).startswith("the disk holding")
    try:  # torch reports a full disk as its own error, with the ENOSPC underneath
        try:
            raise full
        except OSError as cause:
            raise RuntimeError("unexpected pos 64 vs 0") from cause
    except RuntimeError as wrapped:
        assert write_failure(tmp_path, wrapped).startswith(f"the disk holding {tmp_path} is full")
    assert write_failure(tmp_path, RuntimeError("boom\nlast line")) == "last line"


def test_the_step_log_reads_as_one_history_across_a_resume(tmp_path):
    step_file = tmp_path / "steps.jsonl"
    step_file.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(5)) + '{"step": 5, "lo')
    resumed = SimpleNamespace(restored=Restored("step-3", {"step": 3, "cursor": 6}, [], [PassedOver("step-4", "damaged")]), step=3)
    assert start_history(resumed, RunStorage(str(tmp_path)), resume=True) == step_file
    assert [json.loads(line)["step"] for line in step_file.read_text().splitlines()] == [0, 1, 2]


def test_a_fresh_run_is_refused_a_folder_that_holds_an_earlier_run_unless_forced(tmp_path):
    root = tmp_path / "run"
    claim_run_folder(root, resume=False, force=False)  # nothing there yet
    root.mkdir()
    (root / "job.yaml").write_text("name: x\n")
    claim_run_folder(root, resume=False, force=False)  # a folder with only the job in it is still fresh
    (root / "step-4").mkdir()
    (root / "steps.jsonl").write_text("{}\n")
    with pytest.raises(RunFolderError, match=r"holds an earlier run \(step-4, steps.jsonl\): `--resume` continues it, `--force` starts afresh"):
        claim_run_folder(root, resume=False, force=False)
    claim_run_folder(root, resume=True, force=False)
    assert (root / "step-4").is_dir()
    claim_run_folder(root, resume=False, force=True)
    (aside,) = tmp_path.glob("run-before-*")
    assert not root.exists() and (aside / "step-4").is_dir() and (aside / "steps.jsonl").read_text() == "{}\n"  # moved, not deleted
    root.mkdir()  # a folder that says which run it holds is moved aside under that run's id
    (root / "run.json").write_text(json.dumps({"run_id": "0123abcd4567", "job": "x"}))
    (root / "final").mkdir()
    claim_run_folder(root, resume=False, force=True)
    assert (tmp_path / "run-0123abcd4567" / "final").is_dir() and not root.exists()


def test_a_run_to_a_storage_uri_resumes_and_exports_from_the_storage_alone(finished, kept, tmp_path, tiny_dirs):
    """checkpoint.dir as a URI (file://, through pyarrow.fs as s3:// or gs:// would go): every checkpoint is uploaded
    and its staging copy removed; a resume on a machine with an empty staging folder downloads, verifies and continues;
    the exported weights equal those of the same run in a plain folder."""
    uri = f"file://{tmp_path}/bucket/ck"
    job = small_job(tiny_dirs["qwen3_5"], tmp_path / "unused")
    staged = lambda name: job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": uri, "staging_dir": str(tmp_path / name)})})  # noqa: E731
    run_steps(staged("node-a"), 2, kept)
    stored = tmp_path / "bucket" / "ck"
    assert (stored / "latest").read_text() == "step-2" and damage(stored / "step-2") is None and damage(stored / "step-1") is None
    assert not list((tmp_path / "node-a").glob("**/*.pt"))  # uploaded, then removed from the staging folder
    restored, logs = run_steps(staged("node-b"), 1, kept, resume=True)  # a fresh staging folder: everything comes from the storage
    assert restored.tag == "step-2" and logs[0].step == 2
    assert Manifest.read(stored / "step-3").run_id == Manifest.read(stored / "step-1").run_id
    ours = export_student(staged("node-c"), tmp_path / "from-uri", step=3)
    theirs = export_student(small_job(tiny_dirs["qwen3_5"], finished), tmp_path / "from-folder", step=3)
    from safetensors.torch import load_file

    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unfinished_upload_is_passed_over_and_a_damaged_download_is_named(finished, tmp_path, tiny_dirs):
    uri = f"file://{tmp_path}/bucket/ck"
    shutil.copytree(finished, tmp_path / "bucket" / "ck")
    job = small_job(tiny_dirs["qwen3_5"], tmp_path / "unused")
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": uri, "staging_dir": str(tmp_path / "stage")})})
    (tmp_path / "bucket" / "ck" / "step-3" / MANIFEST).unlink()  # an upload cut short: the manifest goes last
    with open(model_file(tmp_path / "bucket" / "ck" / "step-2"), "r+b") as f:  # same size, other bytes: only a download tells
        f.seek(200)
        f.write(b"\x00" * 64)
    store = CheckpointStore(job)
    tag, passed = store.choose()
    assert tag == "step-2" and list(map(str, passed)) == [f"step-3: {uri}/step-3/{MANIFEST}: missing (an unfinished checkpoint, or one written before manifests)"]
    storage = RunStorage(uri, str(tmp_path / "stage"))
    from lt_opd_ray.runtime.checkpoint import download

    with pytest.raises(CheckpointError, match=rf"checkpoint {uri}/step-2 is damaged: .*model_states.pt: SHA-256 differs from the manifest"):
        download(storage, "step-2")
    assert not (tmp_path / "stage" / "step-2").exists()
