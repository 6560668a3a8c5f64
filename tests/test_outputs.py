"""Commands that write keep the user's files: an --out of the user's is refused by name before any work, whatever
the flags; --force replaces only the command's own earlier output; nothing is left beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_benchmarks import fixture

from lt_opd_ray.core.outputs import MARKER, OutputFolder, OutputFolderError


def files_of(folder) -> dict:
    """Every file under `folder`, byte for byte."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("given, force, refusal", [
    ("file", False, "is a file; --out names the folder `lt-opd eval` writes"),
    ("file", True, "is a file"),
    ("theirs", False, "is a folder lt-opd did not write and is not empty: it is left alone (even with --force)"),
    ("theirs", True, "is a folder lt-opd did not write and is not empty: it is left alone (even with --force)"),
    ("export", True, "is `lt-opd export`'s output and is not empty: it is left alone"),
    ("eval", False, "holds an earlier `lt-opd eval` output; pass --force to replace it"),
    ("eval", True, None),
    ("empty", False, None),
    ("missing", False, None),
])
def test_an_out_is_written_only_when_new_empty_or_the_commands_own_with_force(tmp_path, given, force, refusal):
    out = tmp_path / "out"
    if given == "file":
        out.write_text("mine")
    elif given != "missing":
        out.mkdir()
        if given == "theirs":
            (out / "notes.txt").write_text("mine")
        elif given in ("eval", "export"):
            (out / "results.json").write_text("earlier")
            (out / MARKER).write_text(json.dumps({"command": given}))
    before = files_of(tmp_path)
    destination = OutputFolder(out, "eval", force)
    if refusal:
        with pytest.raises(OutputFolderError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
            destination.staging()
        assert files_of(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        return
    staging = destination.staging()
    (staging / "results.json").write_text("new")
    assert destination.publish(staging) == out
    assert (out / "results.json").read_text() == "new" and json.loads((out / MARKER).read_text()) == {"command": "eval"}
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as a folder made with mkdir, not mkdtemp's owner-only 0700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or replaced folder left beside it


def test_the_working_directory_is_no_out_and_a_link_names_its_folder(tmp_path, monkeypatch):
    """`--out .` (or a folder holding the working directory) is refused: replacing it would pull the folder from under
    the shell. `--out LINK` writes the folder the link names, and the link still names it."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for out, held in ((".", ""), ("..", " or holds it")):
        with pytest.raises(OutputFolderError, match=f"is the working directory{held}: --out names a folder the command creates"):
            OutputFolder(Path(out), "eval", force=True).staging()
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / MARKER).write_text(json.dumps({"command": "eval"}))
    (tmp_path / "link").symlink_to(tmp_path / "real")
    destination = OutputFolder(tmp_path / "link", "eval", force=True)
    staging = destination.staging()
    (staging / "results.json").write_text("new")
    assert destination.publish(staging) == tmp_path / "real"
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link" / "results.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "work"]


def test_eval_out_keeps_the_model_and_any_folder_of_the_users_and_replaces_its_own_results_only_with_force(tiny_dirs, tmp_path, capsys):
    """`lt-opd eval MODEL --out MODEL` once removed the model it was evaluating."""
    from lt_opd_ray.cli.main import main

    pope, _, _ = fixture("pope", tmp_path)
    model = tmp_path / "model"
    import shutil

    shutil.copytree(tiny_dirs["qwen3_5"], model)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("keep me too")
    before = files_of(tmp_path)
    base = ["eval", str(model), "--bench", f"pope={pope}", "--budgets", "500", "--max-new-tokens", "2", "--limit", "2"]
    for out in (model, mine, tmp_path / "a-file"):
        for force in ([], ["--force"]):
            assert main([*base, "--out", str(out), *force]) == 2
            refused = capsys.readouterr().err
            assert refused.startswith(f"eval: {out} is a") and "Traceback" not in refused, refused
    assert files_of(tmp_path) == before  # the model, the user's folder and file, byte for byte; nothing beside them

    out = tmp_path / "eval"
    assert main([*base, "--out", str(out)]) == 0
    first = files_of(out)
    assert main([*base, "--out", str(out)]) == 2
    assert "holds an earlier `lt-opd eval` output; pass --force to replace it" in capsys.readouterr().err
    assert files_of(out) == first
    (out / "results.json").write_text("an earlier result")
    assert main([*base, "--out", str(out), "--force"]) == 0
    assert json.loads((out / "results.json").read_text())["model"] == str(model)
    assert files_of(tmp_path / "model") == files_of(tiny_dirs["qwen3_5"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


@pytest.mark.parametrize("source, message", [
    ("missing.jsonl", "missing.jsonl: not found"),
    ("a-folder", "a-folder: not a source this command reads"),
    ("image.png", "image.png: not a source this command reads"),
])
def test_data_names_a_source_that_is_missing_or_not_a_source_and_leaves_nothing(tmp_path, capsys, source, message):
    from lt_opd_ray.cli.main import main

    (tmp_path / "a-folder").mkdir()
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["data", str(tmp_path / source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no out/, no out.incoming/


def test_a_new_study_needs_a_new_or_empty_out_and_a_folder_of_the_users_is_left_alone(tmp_path, capsys, monkeypatch):
    """`lt-opd ablation` writes its runs and report into --out as they finish: a new study never writes over another's
    results or anyone's files (refused before the teacher is evaluated); --resume continues a study."""
    from lt_opd_ray.cli.main import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    study = tmp_path / "study"
    study.mkdir()
    (study / "results.json").write_text('{"runs": []}')
    (tmp_path / "a-file").write_text("keep me too")
    before = files_of(tmp_path)
    for out, message in [(mine, f"{mine} holds files of its own (notes.txt first); a new study needs a new or empty --out"),
                         (study, f"{study} holds an earlier study (--resume continues it); a new study needs a new or empty --out"),
                         (tmp_path / "a-file", f"{tmp_path / 'a-file'} is a file; --out names the study's folder")]:
        assert main(["ablation", "jobs/toy_circles.yaml", "--out", str(out)]) == 2
        assert f"ablation: {message}" in capsys.readouterr().err
    assert files_of(tmp_path) == before


def test_a_run_folder_keeps_the_users_files_and_force_moves_an_earlier_run_aside_whole(tmp_path, capsys):
    """`lt-opd train` into checkpoint.dir: a folder without a run is used as it is (its files stay); one that holds an
    earlier run is refused, and with --force moved aside whole, every file in it byte for byte."""
    from lt_opd_ray.runtime.launch import RunFolderError, claim_run_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    claim_run_folder(run, resume=False, force=False)
    assert files_of(run) == {Path("notes.txt"): b"keep me"}
    (run / "steps.jsonl").write_text('{"step": 0}\n')
    (run / "run.json").write_text('{"run_id": "r1"}')
    before = files_of(run)
    with pytest.raises(RunFolderError, match="holds an earlier run"):
        claim_run_folder(run, resume=False, force=False)
    assert files_of(run) == before
    claim_run_folder(run, resume=False, force=True)
    assert not run.exists() and files_of(tmp_path / "run-r1") == before
    assert "moved the earlier run" in capsys.readouterr().out
