"""Folders of regular files: what a checkpoint, a model export or a storage download may hold, and writes that
follow no link.

A link (dangling, to a file or to a folder), a FIFO (which blocks its reader), a socket or a device in such a folder
is refused by name; the folder is walked without following any link. `write_text_nofollow` replaces a file through a
fresh `<name>.tmp` created with O_EXCL | O_NOFOLLOW: a link planted at that name is removed, never written through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def kind_of(mode: int) -> str:
    """What a file of `mode` (from lstat) is, in words."""
    for test, name in ((stat.S_ISLNK, "a link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def irregular_entry(folder: Path) -> str | None:
    """The first entry under `folder` (itself included) that is neither a regular file nor a folder reached without
    a link, said in words; None when there is none. Walked without following any link."""
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):
        return f"{folder}: {kind_of(mode)}, not a folder"
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            mode = os.lstat(os.path.join(top, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"{os.path.join(top, name)}: {kind_of(mode)}; a checkpoint or model folder holds regular files and folders only"
    return None


def write_text_nofollow(path: Path, text: str) -> None:
    """Replace `path` whole with `text`, through `<name>.tmp` made afresh (O_EXCL | O_NOFOLLOW) and renamed over it."""
    staged = path.with_name(path.name + ".tmp")
    staged.unlink(missing_ok=True)  # a link planted there is removed, never written through
    with open(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        f.write(text)
    staged.replace(path)
