"""Unpacking a model archive (`.tar.gz`, `.tgz`, `.tar`, `.zip`) into a staging directory, safely.

An archive is an untrusted input (anyone who can set a storageUri can hand one over), so it is
unpacked here, member by member, never by tarfile's or zipfile's own extraction (tarfile's "data"
filter was bypassed with over-long paths, CVE-2025-4517, and is absent before Python 3.11.4):
- only regular files and directories are written; a symbolic link, a hard link, a device or a
  FIFO anywhere in the archive fails it (tar and zip alike: a zip member whose Unix mode says
  link is one too). A link that points inside the model today is a link an attacker can chain
  (`B -> .`, `A -> B/..`, `A/x`), so none is made;
- each member's name is split on `/` (and `\\`), `.` and empty parts dropped; an absolute name,
  a `..` part or a NUL fails the archive. Every directory is made and entered with `mkdir` and
  `open(O_DIRECTORY | O_NOFOLLOW)` relative to its parent's descriptor, and every file is created
  with `open(O_CREAT | O_EXCL | O_NOFOLLOW)` the same way, so nothing is written through a link,
  whether the archive or anyone else put it there, and no path is ever resolved by name;
- its unpacked size is bounded by `max_bytes` (the same bound as a download), counted as it is
  written: a member whose declared size would pass the bound is refused before it is written,
  and the bytes actually read are counted too (a decompression bomb cannot fill the disk);
  `MAX_MEMBERS` bounds the entries and `MAX_DEPTH` how deep a path may be;
- `check` (the fetch's stop signal and deadline) is called before each member and each chunk,
  so an unload stops the writing within a chunk (1 MiB).

An archive holding one top-level directory is flattened only when that directory is the model
root (it holds `model-settings.json` or `config.pbtxt`): `1/model.onnx` (a Triton version
directory) stays as it is.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import uuid
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

from modelyard.errors import ModelyardError

ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_MEMBERS = 100_000  # a bound on entries too: a million empty files is a bomb of another kind
# Directories deep, at most: a model is a few levels (a Hugging Face snapshot, a Triton version
# directory); thousands of levels would unpack, then break every recursive walk of it (removal
# raises RecursionError, and a leftover the agent cannot clear stops it starting).
MAX_DEPTH = 64
CHUNK = 1 << 20
_MODEL_ROOT_FILES = ("model-settings.json", "config.pbtxt")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What a broken or hostile archive raises while it is read (the writing's own errors are ours).
_UNREADABLE = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)


class ArchiveError(ModelyardError):
    """An archive that is unsafe or too large to unpack."""


def _nothing() -> None:
    return None


def unpack(
    archive: Path,
    into: Path,
    *,
    max_bytes: int,
    remove: bool = False,
    check: Callable[[], None] = _nothing,
) -> None:
    """Unpack `archive` into the existing directory `into` (which holds nothing else but, maybe,
    the archive itself); `remove` deletes the archive (once it is open: a member may have its
    name). `check` raises to stop the unpacking (a cancelled fetch, its deadline passed)."""
    with open(archive, "rb") as source:
        if remove:
            archive.unlink()
        root = os.open(into, _DIR_FLAGS)
        try:
            writer = _Writer(archive.name, root, max_bytes, check)
            try:
                if archive.name.endswith(".zip"):
                    _unzip(source, writer)
                else:
                    _untar(source, writer)
            except _UNREADABLE as error:
                raise ArchiveError(f"{archive.name}: not a readable archive ({error})") from None
        finally:
            os.close(root)
    _flatten_model_root(into, archive)


def _unzip(source: IO[bytes], writer: _Writer) -> None:
    with zipfile.ZipFile(source) as zipped:
        members = zipped.infolist()
        # The central directory is read already: a bomb is refused before anything is written.
        writer.declared(len(members), sum(m.file_size for m in members))
        for member in members:
            parts = writer.entry(member.filename)
            mode = member.external_attr >> 16  # the Unix mode, when a Unix zip wrote one (else 0)
            if stat.S_ISLNK(mode):
                raise writer.link(member.filename)
            kind = stat.S_IFMT(mode)
            if member.is_dir():
                writer.directory(parts)
            elif kind in (0, stat.S_IFREG):
                with zipped.open(member) as data:
                    writer.file(parts, member.file_size, data, stat.S_IMODE(mode) or 0o644)
            else:
                raise writer.special(member.filename)


def _untar(source: IO[bytes], writer: _Writer) -> None:
    # Stream mode: members are read in order, once; nothing seeks back (a gzip seek decompresses).
    with tarfile.open(fileobj=source, mode="r|*") as tarred:
        for member in tarred:
            parts = writer.entry(member.name)
            if member.issym() or member.islnk():
                raise writer.link(member.name)
            if member.isdir():
                writer.directory(parts)
            elif member.isfile():
                data = tarred.extractfile(member)
                assert data is not None  # a regular file always has its data
                with data:
                    writer.file(parts, member.size, data, member.mode)
            else:
                raise writer.special(member.name)


class _Writer:
    """Writes members under the directory `root` (a descriptor), never following a link."""

    def __init__(self, archive: str, root: int, max_bytes: int, check: Callable[[], None]) -> None:
        self._archive = archive
        self._root = root
        self._max_bytes = max_bytes
        self._check = check
        self._entries = 0
        self._written = 0

    def declared(self, count: int, total: int) -> None:
        if count > MAX_MEMBERS:
            raise ArchiveError(f"{self._archive}: more than {MAX_MEMBERS} entries")
        self._over(total)

    def _over(self, total: int) -> None:
        if total > self._max_bytes:
            raise ArchiveError(
                f"{self._archive}: unpacks to at least {total} bytes, over the limit of {self._max_bytes}"
            )

    def entry(self, name: str) -> tuple[str, ...]:
        """The next member's path, as parts; after `check`, and counted against MAX_MEMBERS."""
        self._check()
        self._entries += 1
        if self._entries > MAX_MEMBERS:
            raise ArchiveError(f"{self._archive}: more than {MAX_MEMBERS} entries")
        text = name.replace("\\", "/")
        parts = tuple(part for part in text.split("/") if part not in ("", "."))
        if text.startswith("/") or ".." in parts or "\0" in text:
            raise ArchiveError(f"{self._archive}: unsafe path {name!r} in the archive")
        if len(parts) - 1 > MAX_DEPTH:  # the directories it is in (a directory entry counts as one)
            raise ArchiveError(f"{self._archive}: {name[:80]!r}... is more than {MAX_DEPTH} directories deep")
        return parts

    def link(self, name: str) -> ArchiveError:
        return ArchiveError(f"{self._archive}: {name!r} is a link; links in archives are refused")

    def special(self, name: str) -> ArchiveError:
        return ArchiveError(
            f"{self._archive}: {name!r} is not a regular file or directory (device, FIFO?); refused"
        )

    def directory(self, parts: tuple[str, ...]) -> None:
        os.close(self._enter(parts))

    def file(self, parts: tuple[str, ...], size: int, data: IO[bytes], mode: int) -> None:
        if not parts:
            raise ArchiveError(f"{self._archive}: a file without a name in the archive")
        self._over(self._written + size)  # refused before a byte of it is written
        # Permissions as tarfile's "data" filter keeps them: no set-id or sticky bits, no
        # group or other write, the owner may read and write, executable only if the owner may.
        mode = mode & 0o755 | 0o600
        if not mode & 0o100:
            mode &= ~0o111
        parent = self._enter(parts[:-1])
        try:
            fd = self._create(parent, parts)
        finally:
            os.close(parent)
        with open(fd, "wb") as out:
            while chunk := data.read(CHUNK):
                self._check()
                self._written += len(chunk)
                self._over(self._written)  # counted as written: a member longer than declared
                out.write(chunk)
            os.fchmod(out.fileno(), mode)

    def _enter(self, parts: tuple[str, ...]) -> int:
        """A descriptor of the directory `parts` under the root, made where missing; each step
        relative to the one before, none through a link."""
        fd = os.dup(self._root)
        done = 0
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):  # entered below only if a directory
                    os.mkdir(part, 0o755, dir_fd=fd)
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
                done += 1
        except OSError as error:
            os.close(fd)
            raise self._cannot(parts[: done + 1], error) from None
        return fd

    def _create(self, parent: int, parts: tuple[str, ...]) -> int:
        name = parts[-1]
        try:
            try:
                return os.open(name, _NEW_FILE, 0o600, dir_fd=parent)
            except FileExistsError:
                # A name given twice (tar appends): the later member wins, as with tar; unlink
                # removes a link itself, never what it points to, and fails on a directory.
                os.unlink(name, dir_fd=parent)
                return os.open(name, _NEW_FILE, 0o600, dir_fd=parent)
        except OSError as error:
            raise self._cannot(parts, error) from None

    def _cannot(self, parts: tuple[str, ...], error: OSError) -> ArchiveError:
        return ArchiveError(f"{self._archive}: cannot write {'/'.join(parts)!r}: {error.strerror or error}")


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
