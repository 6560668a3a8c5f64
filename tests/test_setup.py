"""scripts/setup.sh: checkouts share the cached dependencies but each imports its own code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout_copy(target: Path) -> Path:
    """The repository's tracked files (as they are in this working tree) in a folder of their own."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    return target


def test_two_checkouts_each_import_their_own_code(tmp_path):
    checkouts = [checkout_copy(tmp_path / name) for name in ("one", "two")]
    for checkout in checkouts:
        done = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for checkout in checkouts:  # after both set up: the first is not re-pointed at the second
        bin_dir = checkout / ".venv" / "bin"
        where = subprocess.run([str(bin_dir / "python"), "-c", "import lt_opd_ray; print(lt_opd_ray.__file__)"], cwd=tmp_path,
                               capture_output=True, text=True)
        assert where.returncode == 0 and where.stdout.strip() == str(checkout / "lt_opd_ray" / "__init__.py"), where.stderr[-2000:]
        for command in (["lt-opd", "--help"], ["ray", "--version"]):  # its own commands, and the shared ones run by its python
            ran = subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=tmp_path, capture_output=True, text=True)
            assert ran.returncode == 0, ran.stderr[-2000:]
