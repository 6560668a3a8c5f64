"""The folders a command writes (`--out`): never one it did not write, never half-written under the user's name.

A command's folder is assembled in a staging folder of its own beside the destination (a fresh name, never one
the user may hold) and renamed into place when it is whole, with a marker naming the command that wrote it. An
existing folder is replaced only with `--force`, and only when it holds that marker: a model, a data set or any
folder of the user's is refused by name, whatever the flags. Checked before any work, so a refusal costs nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = ".lt-opd-output.json"  # {"command": "eval"}: which command wrote the folder


class OutputFolderError(ValueError):
    """An --out the command may not write; the message names the folder and the way out."""


def written_by(folder: Path) -> str | None:
    """The command whose output `folder` is, or None (not ours, or no folder)."""
    try:
        return json.loads((folder / MARKER).read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class OutputFolder:
    """`lt-opd <command> ... --out path [--force]`."""

    path: Path
    command: str
    force: bool = False

    def __post_init__(self):  # the folder itself: `.` and a link name the folder they stand for
        object.__setattr__(self, "path", Path(self.path).resolve())

    def check(self) -> None:
        """Refuse, before any work, a destination the command may not write."""
        out = self.path
        here = Path.cwd().resolve()
        if out == here or out in here.parents:
            raise OutputFolderError(f"{out} is the working directory{'' if out == here else ' or holds it'}: --out names a folder"
                                    f" the command creates or replaces, such as ./{self.command}-out")
        if out.exists() and not out.is_dir():
            raise OutputFolderError(f"{out} is a file; --out names the folder `lt-opd {self.command}` writes")
        if not out.is_dir() or not any(out.iterdir()):
            return
        owner = written_by(out)
        if owner != self.command:
            whose = f"`lt-opd {owner}`'s output" if owner else "a folder lt-opd did not write"
            raise OutputFolderError(f"{out} is {whose} and is not empty: it is left alone (even with --force); choose a new folder for --out")
        if not self.force:
            raise OutputFolderError(f"{out} holds an earlier `lt-opd {self.command}` output; pass --force to replace it, or choose a new folder")

    def staging(self) -> Path:
        """A new empty folder beside the destination, for the command to assemble its output in."""
        self.check()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.incoming-", dir=self.path.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would make the published folder its owner's alone
        return staging

    def publish(self, staging: Path) -> Path:
        """Mark `staging` as this command's and rename it into place; an earlier output of the command (checked
        again: the folder may have changed during the work) is removed only once the new one is there."""
        self.check()
        (staging / MARKER).write_text(json.dumps({"command": self.command}) + "\n")
        earlier = None
        if self.path.is_dir() and any(self.path.iterdir()):
            earlier = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.replaced-", dir=self.path.parent))
            os.replace(self.path, earlier / "out")
        elif self.path.is_dir():
            self.path.rmdir()  # an empty folder the user made for it
        os.replace(staging, self.path)
        if earlier is not None:
            shutil.rmtree(earlier)
        return self.path

    def discard(self, staging: Path) -> None:
        """A failed command's staging folder, removed (it is the command's own)."""
        shutil.rmtree(staging, ignore_errors=True)
