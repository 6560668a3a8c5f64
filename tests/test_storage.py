"""Run storage behind a URI (pyarrow.fs): pyarrow's in-process mock filesystem and a file:// URI stand in for
s3:// / gs:// (the same pyarrow calls); a plain path stays a plain folder."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from lt_opd_ray.config.loading import JobConfigError, load_job
from lt_opd_ray.core.storage import RunStorage, StorageError
from lt_opd_ray.runtime.checkpoint_files import MANIFEST, Manifest, remote_damage
from lt_opd_ray.runtime.launch import RunFolderError, claim_run_folder


def filled(storage: RunStorage) -> RunStorage:
    (storage.local / "step-1" / "sub").mkdir(parents=True)
    (storage.local / "step-1" / "a.pt").write_bytes(b"a" * 10)
    (storage.local / "step-1" / "sub" / "b.json").write_text("{}")
    storage.put("step-1")
    storage.write_text("latest", "step-1")
    return storage


@pytest.mark.parametrize("scheme", ["mock", "file"])
def test_pieces_go_up_and_come_back_through_the_uri(tmp_path, scheme):
    uri = "mock://bucket/run" if scheme == "mock" else f"file://{tmp_path}/bucket/run"
    storage = filled(RunStorage(uri, tmp_path / "stage"))
    assert storage.remote and storage.local == (tmp_path / "stage").resolve()
    assert storage.names() == ["latest", "step-1"] and storage.is_dir("step-1") and not storage.is_dir("latest")
    assert storage.sizes("step-1") == {"a.pt": 10, "sub/b.json": 2} and storage.sizes("step-9") is None
    assert storage.read_text("latest") == "step-1" and storage.read_text("nothing") is None
    assert storage.describe("step-1") == f"{uri}/step-1"
    back = storage.get("step-1", into=tmp_path / "back")
    assert (back / "a.pt").read_bytes() == b"a" * 10 and (back / "sub" / "b.json").read_text() == "{}"
    assert storage.get("nothing") is None
    storage.delete("step-1")
    assert storage.names() == ["latest"]


def test_a_plain_path_is_its_own_storage(tmp_path):
    storage = filled(RunStorage(str(tmp_path / "run")))
    assert not storage.remote and storage.describe("step-1") == str(tmp_path / "run" / "step-1")
    assert storage.names() == ["latest", "step-1"] and storage.get("step-1") == tmp_path / "run" / "step-1"


def test_an_uploaded_checkpoint_without_its_manifest_or_with_a_short_file_is_not_intact(tmp_path):
    storage = filled(RunStorage("mock://bucket/run", tmp_path / "stage"))
    assert remote_damage(storage, "step-1") == f"mock://bucket/run/step-1/{MANIFEST}: missing (an unfinished checkpoint, or one written before manifests)"
    manifest = Manifest("r1", 1, 0.0, {"a.pt": [10, "x"], "sub/b.json": [2, "y"]})
    storage.write_text(f"step-1/{MANIFEST}", manifest.text())
    assert remote_damage(storage, "step-1") is None
    storage.write_text(f"step-1/{MANIFEST}", json.dumps({**json.loads(manifest.text()), "files": {"a.pt": [11, "x"], "c.pt": [1, "z"]}}))
    assert remote_damage(storage, "step-1") == "mock://bucket/run/step-1/a.pt: 10 bytes, the manifest says 11 (truncated or overwritten)"


def test_a_fresh_run_is_refused_a_uri_that_holds_an_earlier_run_and_force_moves_it_aside(tmp_path):
    uri = f"file://{tmp_path}/bucket/run"
    claim_run_folder(uri, resume=False, force=False, staging=str(tmp_path / "stage"))  # nothing there yet
    filled(RunStorage(uri, tmp_path / "stage"))
    with pytest.raises(RunFolderError, match=rf"{uri} holds an earlier run \(latest, step-1\): `--resume` continues it, `--force` starts afresh and moves it to run-before-"):
        claim_run_folder(uri, resume=False, force=False, staging=str(tmp_path / "stage"))
    claim_run_folder(uri, resume=False, force=True, staging=str(tmp_path / "stage"))
    (aside,) = (tmp_path / "bucket").glob("run-before-*")
    assert not (tmp_path / "bucket" / "run").exists() and (aside / "step-1" / "a.pt").read_bytes() == b"a" * 10  # moved, not deleted


def test_a_storage_that_cannot_be_opened_is_named(tmp_path):  # and at preflight: test_runtime
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nmodel: {path: 'tiny:qwen3_5'}\ncheckpoint: {dir: 'ftp://host/run'}\n")
    with pytest.raises(JobConfigError, match=r"checkpoint.dir.*unknown storage scheme 'ftp'; use a path or one of file://, s3://, gs://"):
        load_job(path)
    with pytest.raises(StorageError, match=r"cannot open hdfs://namenode:8020/run: "):
        RunStorage("hdfs://namenode:8020/run")  # no Hadoop client on this machine: refused by name, before any actor starts


def someone_elses_folder(path):
    """The folder made first by another local user (uid 65534), as in a shared /tmp."""
    path.mkdir(mode=0o755)
    os.chown(path, 65534, 65534)


def a_link_to_elsewhere(path):
    (path.parent / "elsewhere").mkdir()
    path.symlink_to(path.parent / "elsewhere")


def a_world_writable_folder(path):
    path.mkdir()
    path.chmod(0o777)


def a_file(path):
    path.write_text("x")


PLANTED = {"a link to elsewhere": (a_link_to_elsewhere, "a link"), "writable by all": (a_world_writable_folder, "writable by others (mode 777)"),
           "a file": (a_file, "not a folder")}
if os.geteuid() == 0:  # another user exists to be only where this one is root (CI's and this machine's case)
    PLANTED["another user's"] = (someone_elses_folder, "owned by uid 65534")


@pytest.mark.parametrize("plant", PLANTED.values(), ids=PLANTED.keys())
def test_the_staging_folder_of_a_uri_is_this_users_own_and_a_planted_one_is_refused(tmp_path, monkeypatch, plant):
    """URI checkpoints stage under <tmp>/lt-opd-ray-<uid>, made 0700: where someone made that name first (another
    user, a link, a folder open to all, a file), the run is refused by name before it writes anything there."""
    import tempfile

    make, why = plant
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / f"lt-opd-ray-{os.getuid()}"
    storage = RunStorage("mock://bucket/run")
    assert storage.local.is_relative_to(mine.resolve()) and oct(mine.stat().st_mode & 0o777) == "0o700"
    os.rmdir(storage.local) if storage.local.exists() else None
    shutil.rmtree(mine)
    make(mine)
    with pytest.raises(StorageError, match=f"{mine}: {re.escape(why)}.*not a private folder|{mine}: {re.escape(why)}"):
        RunStorage("mock://bucket/run")


def test_a_link_planted_at_a_staged_files_temporary_name_is_not_written_through(tmp_path):
    """`write_text` replaces a file through <name>.tmp: a link placed there (to a file the run's user may write) is
    removed, never followed."""
    storage = RunStorage("mock://bucket/run", tmp_path / "stage")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    storage.local.mkdir(parents=True)
    (storage.local / "latest.tmp").symlink_to(victim)
    storage.write_text("latest", "step-1")
    assert victim.read_text() == "precious" and storage.read_text("latest") == "step-1"


def test_a_file_uri_storage_copies_no_link_or_fifo_out_of_the_run(tmp_path):
    """pyarrow's local filesystem copies a link's target as a file: from a `file://` run folder a `final/notes.md ->
    credentials` link (or a FIFO, which would block the copy) is refused by name and nothing is downloaded."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (tmp_path / "credentials").write_text("aws_secret_access_key = wJalr")
    storage = RunStorage(f"file://{run}", tmp_path / "stage")
    assert (storage.get("final", into=tmp_path / "ok") / "config.json").read_text() == "{}"
    os.symlink(tmp_path / "credentials", run / "final" / "notes.md")
    with pytest.raises(StorageError, match=r"final/notes.md: a link"):
        storage.get("final", into=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (run / "final" / "notes.md").unlink()
    os.mkfifo(run / "final" / "pipe")
    with pytest.raises(StorageError, match=r"final/pipe: a FIFO"):
        storage.get("final", into=tmp_path / "out")
    os.symlink(tmp_path / "credentials", run / "latest")
    with pytest.raises(StorageError, match="a link or not a regular file"):
        storage.get("latest")
