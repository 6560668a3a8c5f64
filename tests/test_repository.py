"""The repository itself: what a checkout carries, and that its code lints.

Every tracked file over 1 MB is a deliberate fixture named here; a wheel, a run's output or a model checkpoint
committed by accident fails the suite on the day it lands, with its path and size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 1 << 20

# The toy teachers the package ships (lt_opd_ray/sources/toy/teacher.py): trained fixtures, 2.4 MB each.
ALLOWED = {
    "lt_opd_ray/sources/toy/teachers/circles/model.safetensors",
    "lt_opd_ray/sources/toy/teachers/discs/model.safetensors",
}


def tracked_files() -> list[str]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [name for name in listing.stdout.decode().split("\0") if name]


def oversized(names: list[str], root: Path = REPO) -> list[str]:
    """'path (N bytes)' for each tracked file (a path under `root`) over the limit and outside the allow-list."""
    sizes = {name: (root / name).stat().st_size for name in names if (root / name).is_file()}
    return [f"{name} ({size} bytes)" for name, size in sorted(sizes.items()) if size > LIMIT_BYTES and name not in ALLOWED]


def test_no_tracked_file_over_1_mb_outside_the_fixtures():
    names = tracked_files()
    assert set(ALLOWED) <= set(names), "an allowed fixture is no longer tracked: shorten ALLOWED"
    assert oversized(names) == []


def test_the_checkout_passes_ruff_and_ruff_names_an_undefined_name(tmp_path):
    """`ruff check` with pyproject's rules over the whole checkout (the package, tests, benchmarks, dashboards,
    scripts); the same rules on a file that reads a name it never binds fail, naming the file and the rule."""
    ruff = [sys.executable, "-m", "ruff"]  # the dev extra's, from wherever this environment has it
    linted = subprocess.run([*ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert linted.returncode == 0, linted.stdout[-4000:] + linted.stderr[-2000:]
    (tmp_path / "broken.py").write_text("def f():\n    return engine\n")
    flagged = subprocess.run([*ruff, "check", "--no-cache", "--output-format", "concise", "--config", str(REPO / "pyproject.toml"),
                              "broken.py"], cwd=tmp_path, capture_output=True, text=True)
    assert flagged.returncode == 1 and "broken.py:2:12: F821 Undefined name `engine`" in flagged.stdout, flagged.stdout


def test_a_large_file_outside_the_allow_list_is_named(tmp_path):
    for name in ["weights/too_big.bin", *ALLOWED]:  # a checkout of its own: nothing is written into the repository
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"\0" * (LIMIT_BYTES + 1))
    assert oversized(["weights/too_big.bin", *sorted(ALLOWED)], root=tmp_path) == [f"weights/too_big.bin ({LIMIT_BYTES + 1} bytes)"]


def test_a_job_uploads_the_package_and_jobs_without_history_docs_or_tests(tmp_path):
    """`ray job submit --runtime-env cluster/runtime_env.yaml --working-dir .` zips the checkout with Ray's own packer:
    the package and the jobs go up; .git, docs and tests (29.5 MiB with them, 5.8 MiB without, 2026-12-04) do not."""
    import zipfile

    import yaml
    from ray._private.runtime_env.packaging import _zip_files

    excludes = yaml.safe_load((REPO / "cluster" / "runtime_env.yaml").read_text())["excludes"]
    package = tmp_path / "working_dir.zip"
    _zip_files(str(REPO), excludes, str(package), include_gitignore=True)
    top = {name.split("/")[0] for name in zipfile.ZipFile(package).namelist() if not name.endswith("/")}  # files, not empty folders
    assert {"lt_opd_ray", "jobs", "pyproject.toml"} <= top
    assert not top & {".git", ".venv", "docs", "tests", "runs", "build"}
    assert package.stat().st_size < 10 * 2**20
