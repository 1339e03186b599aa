"""Unpacking a model archive (`.tar.gz`, `.tgz`, `.tar`, `.zip`) into a staging directory, safely.

An archive is an untrusted input (anyone who can set a storageUri can hand one over), so:
- its unpacked size is bounded by `max_bytes` (the same bound as a download) before anything is
  written, from the sizes the members declare; tarfile and zipfile never write more than a
  member declares, so a small archive cannot fill the disk (a decompression bomb);
- a member may not land outside the directory: absolute paths, `..`, links pointing out, device
  files are refused (tarfile's "data" filter does this where Python has it, 3.11.4+; the checks
  here hold on older Pythons too). Zip members are never links (zipfile writes them as files).

An archive holding one top-level directory is flattened only when that directory is the model
root (it holds `model-settings.json` or `config.pbtxt`): `1/model.onnx` (a Triton version
directory) stays as it is.
"""

from __future__ import annotations

import os
import tarfile
import uuid
import zipfile
from pathlib import Path, PurePosixPath

from modelyard.errors import ModelyardError

ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_MEMBERS = 100_000  # a bound on entries too: a million empty files is a bomb of another kind
_MODEL_ROOT_FILES = ("model-settings.json", "config.pbtxt")


class ArchiveError(ModelyardError):
    """An archive that is unsafe or too large to unpack."""


def unpack(archive: Path, into: Path, *, max_bytes: int, remove: bool = False) -> None:
    """Unpack `archive` into the existing directory `into` (which holds nothing else but, maybe,
    the archive itself); `remove` deletes the archive once unpacked."""
    if archive.name.endswith(".zip"):
        _unzip(archive, into, max_bytes)
    else:
        _untar(archive, into, max_bytes)
    if remove:
        archive.unlink()
    _flatten_model_root(into, archive)


def _check_name(archive: Path, name: str) -> None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise ArchiveError(f"{archive.name}: unsafe path {name!r} in the archive")


def _check_total(archive: Path, count: int, total: int, max_bytes: int) -> None:
    if count > MAX_MEMBERS:
        raise ArchiveError(f"{archive.name}: more than {MAX_MEMBERS} entries")
    if total > max_bytes:
        raise ArchiveError(f"{archive.name}: unpacks to {total} bytes, over the limit of {max_bytes}")


def _unzip(archive: Path, into: Path, max_bytes: int) -> None:
    with zipfile.ZipFile(archive) as zipped:
        members = zipped.infolist()
        for member in members:
            _check_name(archive, member.filename)
        _check_total(archive, len(members), sum(m.file_size for m in members), max_bytes)
        zipped.extractall(into)


def _untar(archive: Path, into: Path, max_bytes: int) -> None:
    with tarfile.open(archive) as tarred:
        members = tarred.getmembers()  # headers only: reading them writes nothing
        for member in members:
            _check_tar_member(archive, member)
        _check_total(archive, len(members), sum(m.size for m in members if m.isfile()), max_bytes)
        try:
            if hasattr(tarfile, "data_filter"):
                tarred.extractall(into, members=members, filter="data")
            else:  # pragma: no cover - Python < 3.11.4: the checks above stand in for the filter
                tarred.extractall(into, members=members)
        except tarfile.TarError as error:  # FilterError and friends
            raise ArchiveError(f"{archive.name}: {error}") from None


def _check_tar_member(archive: Path, member: tarfile.TarInfo) -> None:
    _check_name(archive, member.name)
    if member.isfile() or member.isdir():
        return
    if member.issym() or member.islnk():
        # a symlink's target is relative to its own directory, a hard link's to the archive root
        base = PurePosixPath(member.name).parent if member.issym() else PurePosixPath()
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or not _stays_inside(base / target):
            raise ArchiveError(f"{archive.name}: link {member.name!r} points outside the model")
        return
    raise ArchiveError(f"{archive.name}: {member.name!r} is not a file, directory or link")


def _stays_inside(path: PurePosixPath) -> bool:
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return False
    return True


def _flatten_model_root(into: Path, archive: Path) -> None:
    entries = [p for p in into.iterdir() if p != archive]
    if len(entries) != 1 or not entries[0].is_dir() or entries[0].is_symlink():
        return
    inner = entries[0]
    if not any((inner / name).is_file() for name in _MODEL_ROOT_FILES):
        return  # e.g. Triton's version directory `1/`: part of the model, not a wrapper
    # Move it aside first so a child with the same name as the wrapper (model/model/...) has room.
    aside = into / f".flatten-{uuid.uuid4().hex[:8]}"
    inner.rename(aside)
    for child in aside.iterdir():
        os.rename(child, into / child.name)
    aside.rmdir()
