"""Model artefacts in the inference server's repository directory: `<repository>/<name>/`.

`storageUri` may be a local path or `file://` (copied; hard-linked instead when the source is
inside the repository and the file system allows), `http(s)://` (downloaded by upstream/), or an fsspec
protocol such as `s3://` and `gs://` (when fsspec is installed). A downloaded or local
`.tar.gz`/`.tgz`/`.tar`/`.zip` is unpacked. Every fetch is staged beside its destination and swapped
in, so the server never loads half a model.

A storageUri is untrusted input (whoever may apply a model writes it, and a fetch runs with the
agent's rights), so what it may name is the agent's to say (`FetchPolicy`, from the agent's
config), never the model's:
- schemes: `file`, `http`, `https`, `s3` and `gs` by default (`fetch_schemes`); chained fsspec
  URLs (`a::b`) and credentials in the URL (`user:password@`) are refused;
- local paths: only inside the repository or a root the agent names (`fetch_roots`), judged
  after `..` and every symbolic link are resolved, a link inside a copied directory included;
  never under /proc, /sys or /dev, whatever the roots; only regular files and directories are
  copied or linked (a device, FIFO or socket is refused before it is opened). What was judged is
  then opened by descriptors, never by path again (`_LocalCopy`): from the root that holds it,
  one directory at a time, each relative to the one before and none through a link
  (`O_NOFOLLOW`), and the tree under it walked the same way; so a directory swapped for a link
  after the check (by anyone who can write in the repository or a root) fails the fetch instead
  of redirecting it, and nothing outside the roots is ever read;
- hard links: only a source inside the repository is hard-linked (the repository is the
  server's to write already); a file from a `fetch_roots` directory is always copied, or a model
  that writes its own files would write through the link into the shared source;
- size: the model's files together at most `max_bytes`, counted as they are copied or arrive
  (a file that grows while it is copied is caught too), and an archive's unpacked size too;
- archives: unpacked member by member, links and special files refused (`archives.py`);
- time: `timeout` seconds in all; and a fetch stops when it is cancelled (an unload of the
  model): its worker thread checks between chunks, an archive's unpacking between members and
  chunks too, and its partial files are deleted;
- remote addresses, credentials, error texts: see `upstream/download.py`.
Every error names the storageUri without its userinfo, query or fragment (`redact`).

What the agent deletes: only directories it made. Each fetch writes a marker file
(`.modelyard-agent`) into the model directory before swapping it in; an unload or a failed load
deletes `<repository>/<name>/` only when it carries the marker. A `<repository>/<name>/` without
it is the user's: a storageUri that is that directory (or inside it) serves it in place, and a
fetch of any other storageUri over it is refused (LOAD_FAILED says why) rather than swapping it out.

Differs from Seldon (rclone into `<name>_<version>`): the directory is the model's own name, so
a new version replaces the old files; `model-settings.json`'s `name` is set to the model's name
(as Seldon rewrites it to the versioned name) so MLServer finds it whatever the artefact said.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from modelyard.agent.archives import ARCHIVES, MAX_DEPTH, MAX_MEMBERS, unpack
from modelyard.agent.config import AgentConfig
from modelyard.config import TlsClientConfig
from modelyard.errors import ConfigError, ModelyardError
from modelyard.security.tls import ClientTls, TlsError
from modelyard.upstream.addresses import AddressPolicy
from modelyard.upstream.download import (
    CHUNK,
    ArtefactTooLarge,
    FetchStopped,
    HostCredential,
    download,
    fetch_with_fsspec,
    in_thread,
    redact,
)

# In `<repository>/<name>/` when an agent fetched it: only such directories are ever deleted.
OWNED_MARKER = ".modelyard-agent"
_LEFTOVER = re.compile(r"^\..+\.(staging|old|prev|part)-[0-9a-f]{8}$")
_TRITON_COUNT = re.compile(r"\bcount\s*:\s*(\d+)")
T = TypeVar("T")
DEFAULT_SCHEMES = frozenset({"file", "http", "https", "s3", "gs"})
# Pseudo file systems: never a model, whatever the roots say (/proc/self/environ is a "regular" file).
_NEVER = (Path("/proc"), Path("/sys"), Path("/dev"))
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Never blocks on a FIFO, never takes a terminal, never follows a link (ELOOP): checked by fstat.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SPECIAL = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
}


class ArtefactError(ModelyardError):
    """A storageUri that could not be fetched into the repository."""


@dataclass(frozen=True)
class FetchPolicy:
    """What a storageUri may name, as the agent's config says (see the module's docstring)."""

    schemes: frozenset[str] = DEFAULT_SCHEMES
    roots: tuple[Path, ...] = ()  # local directories allowed beside the repository
    addresses: AddressPolicy = field(default_factory=AddressPolicy)
    credentials: tuple[HostCredential, ...] = ()
    tls: ClientTls | None = None  # how https stores are verified (None: the system's CAs)


@dataclass(frozen=True)
class Placed:
    """Where a model's files are, and whether the agent put them there (and so deletes them)."""

    path: Path
    owned: bool
    previous: Path | None = None  # the files it replaced, kept aside when asked (`restore`, `discard`)


class Artefacts:
    def __init__(
        self, repository: Path, *, max_bytes: int, timeout: float, policy: FetchPolicy | None = None
    ) -> None:
        self.repository = repository
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.policy = policy if policy is not None else FetchPolicy()

    def path(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ArtefactError(f"model name {name!r} cannot be a repository directory")
        return self.repository / name

    def owns(self, name: str) -> bool:
        """Whether `<repository>/<name>/` was fetched by an agent (it carries the marker file)."""
        try:
            dest = self.path(name)
        except ArtefactError:
            return False
        return not dest.is_symlink() and (dest / OWNED_MARKER).is_file()

    async def fetch(self, name: str, storage_uri: str, *, keep_previous: bool = False) -> Placed:
        """Put `storage_uri`'s files at `<repository>/<name>/`, replacing what an agent put there.
        With `keep_previous` the files replaced are kept aside (`Placed.previous`) until the caller
        `restore`s them (the new version failed to load) or `discard`s them.

        A local source that is `<repository>/<name>` or inside it is used in place (nothing is
        copied or ever deleted). A `<repository>/<name>` the agent did not create is the user's:
        the fetch is refused rather than swap it out (the server would lose the user's model).

        Cancelling it (an unload) stops the transfer and deletes what it wrote. Once the files
        are complete, a cancellation no longer stops it: the swap (milliseconds) is finished and
        the fetch returns, and the caller, which asked for the cancellation, removes the files."""
        dest = self.path(name)
        shown = redact(storage_uri)
        local = self._local_path(storage_uri, shown)
        given = local.name if local is not None else ""  # a link's own name, not its target's
        if local is not None:
            local, in_place = await asyncio.to_thread(self._allowed_local, local, shown, dest)
            if in_place:
                return Placed(dest, owned=False)
        self._refuse_foreign(dest)
        await asyncio.to_thread(self.repository.mkdir, parents=True, exist_ok=True)
        staging = self.repository / f".{name}.staging-{uuid.uuid4().hex[:8]}"
        try:
            await self._fetch_into(storage_uri, shown, staging, local, given)
            finish = asyncio.to_thread(self._finish, staging, dest, name, shown, keep_previous)
            previous = await _completed(finish)
        except ArtefactTooLarge as error:
            raise ArtefactTooLarge(f"{error.message} (the agent's --max-artefact-bytes)") from None
        except ModelyardError:
            raise
        except OSError as error:
            raise ArtefactError(f"cannot fetch {shown} into {dest}: {error.strerror or error}") from None
        finally:
            await _uninterrupted(asyncio.to_thread(shutil.rmtree, staging, True))
        return Placed(dest, owned=True, previous=previous)

    def _local_path(self, uri: str, shown: str) -> Path | None:
        """The local path a storageUri names (a bare path or file://), absolute; None if it is
        remote. ArtefactError for a scheme this agent does not fetch, a chained fsspec URL,
        credentials in the URL, a file:// URL naming another host."""
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ArtefactError(f"storageUri {shown}: not a valid URL") from None
        scheme = parts.scheme.lower()
        allowed = ", ".join(sorted(self.policy.schemes))
        if scheme in ("", "file") and "file" not in self.policy.schemes:
            raise ArtefactError(f"storageUri {shown}: local files are not fetched here (allowed: {allowed})")
        if scheme == "":
            return Path(uri).expanduser().absolute()
        if scheme not in self.policy.schemes:
            raise ArtefactError(
                f"storageUri {shown}: {scheme}:// is not fetched by this agent (allowed: {allowed}; "
                "--fetch-schemes changes it)"
            )
        if "::" in uri and scheme not in ("http", "https", "file"):  # (http's may be an IPv6 address)
            raise ArtefactError(f"storageUri {shown}: chained URLs (::) are refused")
        if parts.username is not None or parts.password is not None:
            raise ArtefactError(
                f"storageUri {shown}: credentials in the URL are refused (the agent takes them from "
                "its environment or files: --fetch-bearer-token, --fetch-basic-auth, fsspec's own)"
            )
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ArtefactError(f"storageUri {shown}: a file:// URL names no host")
            return Path(unquote(parts.path)).expanduser().absolute()
        return None

    def roots(self) -> list[Path]:
        """The directories a local storageUri may be in, resolved: the repository, then the
        configured roots."""
        return [self.repository.resolve(), *(root.resolve() for root in self.policy.roots)]

    def _allowed_local(self, path: Path, shown: str, dest: Path) -> tuple[Path, bool]:
        """`path` resolved (`..` and links), once it is known to exist inside an allowed root and
        to be a regular file or a directory, and whether it is `dest` or inside it (served in
        place); ArtefactError otherwise, for a path holding the repository, and for an error of
        the file system (the path changed while it was checked, a name too long)."""
        try:
            resolved = self._checked_local(path, shown)
            if _within(resolved, dest):
                return resolved, True
            if _within(self.repository, resolved):
                raise ArtefactError(f"storageUri {shown} holds the repository {self.repository}")
        except OSError as error:
            raise ArtefactError(
                f"storageUri {shown}: cannot be checked: {error.strerror or error} (did it change meanwhile?)"
            ) from None
        return resolved, False

    def _checked_local(self, path: Path, shown: str) -> Path:
        if not path.exists():
            if path.is_symlink():
                raise ArtefactError(f"storageUri {shown}: a link to nothing")
            raise ArtefactError(f"storageUri {shown}: no such file or directory")
        resolved = path.resolve()
        _refuse_outside(resolved, self.roots(), shown, self.policy.roots)
        mode = os.stat(resolved).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ArtefactError(
                f"storageUri {shown}: {resolved} is a {_SPECIAL.get(stat.S_IFMT(mode), 'special file')}; "
                "only regular files and directories are fetched"
            )
        return resolved

    def _refuse_foreign(self, dest: Path) -> None:
        if (dest.exists() or dest.is_symlink()) and not self.owns(dest.name):
            raise ArtefactError(
                f"{dest} exists and was not fetched by the agent: it is left alone (remove it, or "
                "set storageUri to it to serve it in place)"
            )

    async def _fetch_into(
        self, uri: str, shown: str, staging: Path, local: Path | None, given: str = ""
    ) -> None:
        def clean() -> None:
            shutil.rmtree(staging, ignore_errors=True)

        until = time.monotonic() + self.timeout
        if local is not None:
            copy = _LocalCopy(self.roots(), self.policy.roots, self.max_bytes, self.timeout, shown)
            await in_thread(lambda stop: copy.place(local, staging, stop, given), cleanup=clean)
        elif urlsplit(uri).scheme.lower() in ("http", "https"):
            await asyncio.to_thread(staging.mkdir)
            basename = PurePosixPath(unquote(urlsplit(uri).path)).name or "model"
            file = await download(
                uri,
                staging / basename,
                max_bytes=self.max_bytes,
                deadline=self.timeout,
                addresses=self.policy.addresses,
                schemes=self.policy.schemes,
                credentials=self.policy.credentials,
                tls=self.policy.tls.context() if self.policy.tls is not None else None,
            )
            if basename.endswith(ARCHIVES):
                await in_thread(
                    lambda stop: unpack(
                        file,
                        staging,
                        max_bytes=self.max_bytes,
                        remove=True,
                        check=_checker(stop, until, self.timeout, shown),
                    ),
                    cleanup=clean,
                )
        else:
            await fetch_with_fsspec(uri, staging, deadline=self.timeout, max_bytes=self.max_bytes)

    def _finish(self, staging: Path, dest: Path, name: str, shown: str, keep: bool) -> Path | None:
        _set_settings_name(staging, name)
        _mark_owned(staging, shown)
        return self._swap_in(staging, dest, keep)

    def _swap_in(self, staging: Path, dest: Path, keep: bool) -> Path | None:
        self._refuse_foreign(dest)  # again: the user may have put files there while we fetched
        kind = "prev" if keep else "old"
        old = dest.with_name(f".{dest.name}.{kind}-{uuid.uuid4().hex[:8]}")
        if dest.exists():
            dest.rename(old)
        staging.rename(dest)
        if keep:
            return old if old.exists() else None
        shutil.rmtree(old, ignore_errors=True)
        return None

    def restore(self, name: str, previous: Path) -> None:
        """Put back the files a fetch kept aside: the version they replaced failed to load."""
        dest = self.path(name)
        if self.owns(name):
            shutil.rmtree(dest, ignore_errors=True)
        previous.rename(dest)

    def discard(self, previous: Path) -> None:
        shutil.rmtree(previous, ignore_errors=True)

    def remove(self, name: str) -> bool:
        """Delete the model's directory if an agent fetched it (after an unload or a failed
        load); a directory without the marker is the user's and stays. True if deleted."""
        if not self.owns(name):
            return False
        shutil.rmtree(self.path(name), ignore_errors=True)
        return True

    def clean_leftovers(self) -> list[str]:
        """Delete staging, swapped-out and partial-download directories left by an agent that was
        killed mid-fetch (their names are ours: `.<name>.staging-*`, `.old-*`, `.part-*`)."""
        if not self.repository.is_dir():
            return []
        removed = []
        for entry in self.repository.iterdir():
            if _LEFTOVER.match(entry.name) and not entry.is_symlink():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
        return sorted(removed)


async def _uninterrupted(work: asyncio.Future[T] | Coroutine[Any, Any, T]) -> T:
    """Await `work` to its end even when cancelled meanwhile (then the cancellation goes on once
    it has ended): a swap or a clean-up half done would leave the repository in between."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()
        raise


async def _completed(work: Coroutine[Any, Any, T]) -> T:
    """Await `work` to its end, a cancellation meanwhile withdrawn: what it does (a swap into
    place) must happen whole, and its result must reach the caller, who cleans up after it."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
        return await task


def _within(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or under it, once both are resolved (links, `..`)."""
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def _refuse_outside(resolved: Path, roots: list[Path], shown: str, configured: tuple[Path, ...]) -> None:
    """ArtefactError unless the resolved path lies in one of `roots` and outside /proc, /sys, /dev."""
    named = f"storageUri {shown}" + ("" if shown == str(resolved) else f" resolves to {resolved}, which")
    if any(resolved == never or never in resolved.parents for never in _NEVER):
        raise ArtefactError(f"{named} is in a special file system (never fetched)")
    if not any(resolved == root or root in resolved.parents for root in roots):
        where = f"the repository {roots[0]}" + "".join(f" or {root}" for root in configured)
        raise ArtefactError(
            f"{named} is outside the directories this agent fetches from ({where}; --fetch-root adds one)"
        )


def _checker(stop: threading.Event, until: float, timeout: float, shown: str) -> Callable[[], None]:
    """What a fetch's worker thread calls between chunks: raises once it is told to stop or its
    deadline (monotonic `until`) has passed."""

    def check() -> None:
        if stop.is_set():
            raise FetchStopped(f"fetch of {shown} stopped")
        if time.monotonic() > until:
            raise ArtefactError(f"fetch of {shown} took longer than {timeout:g}s")

    return check


@dataclass
class _Opened:
    """A source file or directory open for reading (`fd`, what fstat said of it); `link_from`
    is (the directory's descriptor, its name there) when it may be hard-linked (it is inside the
    repository), else None. `close` closes both."""

    fd: int
    info: os.stat_result
    in_repository: bool
    link_from: tuple[int, str] | None = None

    def close(self) -> None:
        os.close(self.fd)
        if self.link_from is not None:
            os.close(self.link_from[0])


class _LocalCopy:
    """One local source copied (or hard-linked) into a staging directory, in a worker thread:
    only regular files and directories, every link resolved and checked against the roots, at
    most `max_bytes` in all and `MAX_MEMBERS` entries, stopping when told or at the deadline.

    Everything is opened by descriptor: the source from the root that holds it, one component
    at a time with O_NOFOLLOW (`_open`), its entries relative to their directory's descriptor,
    and the copies likewise under the staging directory's. A link in the source is followed only
    as the path it resolves to, checked against the roots and opened the same way from its root.
    So what is read lies under a root, whatever is renamed or swapped for a link meanwhile: a
    swap makes an open fail (ELOOP, ENOTDIR) and the fetch is refused."""

    def __init__(
        self, roots: list[Path], configured: tuple[Path, ...], max_bytes: int, timeout: float, shown: str
    ) -> None:
        self._roots = roots
        self._configured = configured
        self._max_bytes = max_bytes
        self._until = time.monotonic() + timeout
        self._timeout = timeout
        self._shown = shown
        self._used = 0
        self._entries = 0
        self._stop = threading.Event()

    def place(self, source: Path, staging: Path, stop: threading.Event, given: str = "") -> None:
        """Copy `source` (resolved and checked by `_allowed_local`) into `staging` (made here). A
        single file is named `given`, the name in the storageUri: a link's target is often named
        by its hash (a Hugging Face cache's blobs), and the model needs the name it was given."""
        self._stop = stop
        name = given or source.name
        opened = self._open(source, str(source))
        try:
            staging.mkdir()
            target = os.open(staging, _DIR)
            try:
                if stat.S_ISDIR(opened.info.st_mode):
                    self._copy_dir(opened, target, source, "", set())
                    return
                self._copy_file(opened, target, name, name)
            finally:
                os.close(target)
        finally:
            opened.close()
        if name.endswith(ARCHIVES):
            unpack(staging / name, staging, max_bytes=self._max_bytes, remove=True, check=self._check)

    def _check(self) -> None:
        if self._stop.is_set():
            raise FetchStopped(f"fetch of {self._shown} stopped")
        if time.monotonic() > self._until:
            raise ArtefactError(f"fetch of {self._shown} took longer than {self._timeout:g}s")

    def _count(self, size: int) -> None:
        self._used += size
        if self._used > self._max_bytes:
            raise ArtefactTooLarge(
                f"storageUri {self._shown}: more than the limit of {self._max_bytes} bytes"
            )

    def _refuse_special(self, where: str, mode: int) -> None:
        kind = _SPECIAL.get(stat.S_IFMT(mode), "special file")
        raise ArtefactError(
            f"storageUri {self._shown}: {where} is a {kind}; only regular files and directories are fetched"
        )

    def _cannot(self, where: str, error: OSError) -> ArtefactError:
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EINVAL):
            return ArtefactError(
                f"storageUri {self._shown}: {where} changed while it was fetched (a link, a file or "
                "nothing where a directory or file was); refused"
            )
        return ArtefactError(f"storageUri {self._shown}: {where}: {error.strerror or error}")

    def _open(self, resolved: Path, where: str) -> _Opened:
        """`resolved` (every link resolved, checked to be inside a root) opened from the root
        that holds it, each step relative to the last with O_NOFOLLOW: ArtefactError if a step is
        a link or missing now, or the end is not a regular file or directory."""
        _refuse_outside(resolved, self._roots, f"{self._shown} ({where})", self._configured)
        index, root = next(
            (i, r) for i, r in enumerate(self._roots) if r == resolved or r in resolved.parents
        )
        parts = resolved.relative_to(root).parts
        try:
            parent = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the agent's own setting
        except OSError as error:
            raise self._cannot(where, error) from None
        try:
            if not parts:  # the root itself
                info = os.fstat(parent)
                fd, parent = parent, -1
                return _Opened(fd, info, in_repository=index == 0)
            for part in parts[:-1]:
                inner = os.open(part, _DIR, dir_fd=parent)
                os.close(parent)
                parent = inner
            last, parent = parent, -1  # taken over by _open_entry: closed, or kept in link_from
            return self._open_entry(last, parts[-1], where, in_repository=index == 0)
        except OSError as error:
            raise self._cannot(where, error) from None
        finally:
            if parent >= 0:
                os.close(parent)

    def _open_entry(self, directory: int, name: str, where: str, *, in_repository: bool) -> _Opened:
        """`name` in `directory` (a descriptor, taken over: closed, or kept in `link_from`),
        opened without following a link; a special file is refused before it is opened, and
        again on what was opened (it may have been swapped in between)."""
        try:
            mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                self._refuse_special(where, mode)
            fd = os.open(name, _READ, dir_fd=directory)
        except BaseException:
            os.close(directory)
            raise
        info = os.fstat(fd)
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            os.close(fd)
            os.close(directory)
            self._refuse_special(where, info.st_mode)
        if in_repository and stat.S_ISREG(info.st_mode):
            return _Opened(fd, info, in_repository, link_from=(directory, name))
        os.close(directory)
        return _Opened(fd, info, in_repository)

    def _child(self, directory: _Opened, path: Path, where: str) -> _Opened:
        """The entry `path.name` of `directory` (whose path, as walked, is `path.parent`)."""
        try:
            mode = os.stat(path.name, dir_fd=directory.fd, follow_symlinks=False).st_mode
        except OSError as error:
            raise self._cannot(where, error) from None
        if stat.S_ISLNK(mode):
            try:
                if not os.path.exists(path):
                    raise ArtefactError(f"storageUri {self._shown}: {where} is a link to nothing")
                resolved = Path(os.path.realpath(path))
            except OSError as error:  # EINVAL: no longer a link when it was read
                raise self._cannot(where, error) from None
            return self._open(resolved, where)
        try:
            return self._open_entry(
                os.dup(directory.fd), path.name, where, in_repository=directory.in_repository
            )
        except OSError as error:
            raise self._cannot(where, error) from None

    def _copy_dir(
        self, directory: _Opened, target: int, path: Path, where: str, seen: set[tuple[int, int]]
    ) -> None:
        """The entries of `directory` (walked as `path`; `where` is its place in the model, with
        a trailing `/`, or "" at the top) into the staging directory `target` (a descriptor)."""
        if where.count("/") > MAX_DEPTH:  # its entries would be more than MAX_DEPTH directories down
            raise ArtefactError(
                f"storageUri {self._shown}: {where[:80]}... is more than {MAX_DEPTH} directories deep"
            )
        key = (directory.info.st_dev, directory.info.st_ino)
        if key in seen:
            raise ArtefactError(f"storageUri {self._shown}: {path} links back into itself")
        seen = seen | {key}
        names = []
        with os.scandir(directory.fd) as scan:
            for entry in scan:
                self._entries += 1
                if self._entries > MAX_MEMBERS:
                    raise ArtefactError(f"storageUri {self._shown}: more than {MAX_MEMBERS} entries")
                names.append(entry.name)
        for name in sorted(names):
            self._check()
            child = self._child(directory, path / name, where + name)
            try:
                if stat.S_ISDIR(child.info.st_mode):
                    inner = _make_dir(target, name)
                    try:
                        self._copy_dir(child, inner, path / name, f"{where}{name}/", seen)
                    finally:
                        os.close(inner)
                else:
                    self._copy_file(child, target, name, where + name)
            finally:
                child.close()

    def _copy_file(self, source: _Opened, target: int, name: str, where: str) -> None:
        """Hard-link `source` at `name` in `target` when it may be (`link_from`) and shares its
        file system, else copy it chunk by chunk into a file made there (O_EXCL, O_NOFOLLOW).
        Files we rewrite later (model-settings.json) are replaced, never written through a link."""
        self._check()
        info = source.info
        if self._used + info.st_size > self._max_bytes:
            self._count(info.st_size)  # over: refused before anything is copied
        if source.link_from is not None and _linked(source.link_from, target, name, info):
            self._count(info.st_size)
            return
        try:
            out = os.open(name, _NEW_FILE, 0o666, dir_fd=target)
        except OSError as error:
            raise ArtefactError(f"cannot write {where} of {self._shown}: {error.strerror or error}") from None
        with open(out, "wb") as written:
            while chunk := os.read(source.fd, CHUNK):
                self._check()
                self._count(len(chunk))  # counted as read: a file that grows is caught too
                written.write(chunk)


def _make_dir(parent: int, name: str) -> int:
    """A new directory `name` in `parent`, opened (never through a link)."""
    os.mkdir(name, 0o777, dir_fd=parent)
    return os.open(name, _DIR, dir_fd=parent)


def _linked(source: tuple[int, str], target: int, name: str, opened: os.stat_result) -> bool:
    """Hard-link `source` (a directory's descriptor and a name in it) at `name` in `target` if
    it is still the file opened (same inode, not a link)."""
    directory, source_name = source
    try:
        os.link(source_name, name, src_dir_fd=directory, dst_dir_fd=target, follow_symlinks=False)
    except OSError:
        return False  # another file system, or a file of someone else's (protected_hardlinks)
    made = os.stat(name, dir_fd=target, follow_symlinks=False)
    if stat.S_ISREG(made.st_mode) and (made.st_dev, made.st_ino) == (opened.st_dev, opened.st_ino):
        return True
    os.unlink(name, dir_fd=target)
    return False


def _mark_owned(model_dir: Path, shown: str) -> None:
    """The marker that says an agent made this directory (so it, or a later agent, may delete
    it); written before the swap, so the directory never appears without it."""
    marker = model_dir / OWNED_MARKER
    fresh = model_dir / f"{OWNED_MARKER}.new"
    fresh.write_text(f"fetched by the modelyard agent from {shown}\n")
    os.replace(fresh, marker)  # a new inode: never written through a hard link to a source


def _set_settings_name(model_dir: Path, name: str) -> None:
    settings = model_dir / "model-settings.json"
    if not settings.is_file():
        return
    try:
        data = json.loads(settings.read_text())
    except (OSError, ValueError):
        return  # not ours to judge: the server reports what is wrong with it
    if not isinstance(data, dict) or data.get("name") == name:
        return
    data["name"] = name
    fresh = settings.with_name(".model-settings.json.new")
    fresh.write_text(json.dumps(data, indent=2))
    os.replace(fresh, settings)  # a new inode: a hard-linked source stays as it was


def instance_count(model_dir: Path) -> int:
    """Instances the server will run, when its settings say (0 = not known): MLServer's
    `parallel_workers` in model-settings.json, Triton's `instance_group` counts in config.pbtxt."""
    settings = model_dir / "model-settings.json"
    if settings.is_file():
        try:
            data = json.loads(settings.read_text())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            workers = data.get("parallel_workers")
            if isinstance(workers, int) and not isinstance(workers, bool) and workers > 0:
                return workers
    config = model_dir / "config.pbtxt"
    if config.is_file():
        try:
            text = config.read_text()
        except OSError:
            return 0
        group = text.find("instance_group")
        if group >= 0:
            return sum(int(n) for n in _TRITON_COUNT.findall(text[group:]))
    return 0


def fetch_policy(config: AgentConfig) -> FetchPolicy:
    """The agent's config as a FetchPolicy. ConfigError naming the file when a credential or CA
    file cannot be read: better at start than at the first download."""
    problems = []
    for credential in config.fetch_credentials:
        file = credential.bearer_token_file or credential.basic_auth_file
        if file is not None and not os.access(file, os.R_OK):
            why = "not readable" if file.exists() else "no such file"
            problems.append(f"credential for {credential.host}: {file}: {why}")
    tls = None
    if config.fetch_ca_file is not None:  # instead of the system's CAs, reloaded when it changes
        try:
            tls = ClientTls(TlsClientConfig(ca_file=str(config.fetch_ca_file)))
        except TlsError as error:
            problems.append(f"--fetch-ca-file: {error.message}")
    if problems:
        raise ConfigError("agent fetch options", problems)
    return FetchPolicy(
        schemes=frozenset(config.fetch_schemes),
        roots=config.fetch_roots,
        addresses=AddressPolicy(allow_private=config.allow_private_fetch, networks=config.fetch_networks),
        credentials=tuple(
            HostCredential(c.host, c.bearer_token_file, c.basic_auth_file) for c in config.fetch_credentials
        ),
        tls=tls,
    )
