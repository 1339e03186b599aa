"""Model artefacts in the inference server's repository directory: `<repository>/<name>/`.

`storageUri` may be a local path or `file://` (a directory is hard-linked where the file system
allows, else copied; a file is copied), `http(s)://` (downloaded, size-bounded, by upstream/), or
any fsspec protocol such as `s3://` and `gs://` (when fsspec is installed). A downloaded or local
`.tar.gz`/`.tgz`/`.tar`/`.zip` is unpacked. Every fetch is staged beside its destination and swapped
in, so the server never loads half a model.

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
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from modelyard.agent.archives import ARCHIVES, unpack
from modelyard.errors import ModelyardError
from modelyard.upstream.download import download, fetch_with_fsspec

# In `<repository>/<name>/` when an agent fetched it: only such directories are ever deleted.
OWNED_MARKER = ".modelyard-agent"
_LEFTOVER = re.compile(r"^\..+\.(staging|old|prev|part)-[0-9a-f]{8}$")
_TRITON_COUNT = re.compile(r"\bcount\s*:\s*(\d+)")


class ArtefactError(ModelyardError):
    """A storageUri that could not be fetched into the repository."""


@dataclass(frozen=True)
class Placed:
    """Where a model's files are, and whether the agent put them there (and so deletes them)."""

    path: Path
    owned: bool
    previous: Path | None = None  # the files it replaced, kept aside when asked (`restore`, `discard`)


class Artefacts:
    def __init__(self, repository: Path, *, max_bytes: int, timeout: float) -> None:
        self.repository = repository
        self.max_bytes = max_bytes
        self.timeout = timeout

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
        the fetch is refused rather than swap it out (the server would lose the user's model)."""
        dest = self.path(name)
        local = _local_path(storage_uri)
        if local is not None and _within(local, dest):
            if not local.exists():
                raise ArtefactError(f"storageUri {storage_uri}: no such file or directory")
            return Placed(dest, owned=False)
        if local is not None and _within(self.repository, local):
            raise ArtefactError(f"storageUri {storage_uri} holds the repository {self.repository}")
        self._refuse_foreign(dest)
        await asyncio.to_thread(self.repository.mkdir, parents=True, exist_ok=True)
        staging = self.repository / f".{name}.staging-{uuid.uuid4().hex[:8]}"
        try:
            await self._fetch_into(storage_uri, staging, local)
            await asyncio.to_thread(_set_settings_name, staging, name)
            await asyncio.to_thread(_mark_owned, staging, storage_uri)
            previous = await asyncio.to_thread(self._swap_in, staging, dest, keep_previous)
        except ModelyardError:
            raise
        except OSError as error:
            raise ArtefactError(f"cannot fetch {storage_uri} into {dest}: {error}") from None
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        return Placed(dest, owned=True, previous=previous)

    def _refuse_foreign(self, dest: Path) -> None:
        if (dest.exists() or dest.is_symlink()) and not self.owns(dest.name):
            raise ArtefactError(
                f"{dest} exists and was not fetched by the agent: it is left alone (remove it, or "
                "set storageUri to it to serve it in place)"
            )

    async def _fetch_into(self, uri: str, staging: Path, local: Path | None) -> None:
        if local is not None:
            await asyncio.to_thread(_place_local, local, staging, self.max_bytes)
        elif urlsplit(uri).scheme.lower() in ("http", "https"):
            await asyncio.to_thread(staging.mkdir)
            basename = PurePosixPath(unquote(urlsplit(uri).path)).name or "model"
            file = await download(uri, staging / basename, max_bytes=self.max_bytes, deadline=self.timeout)
            if basename.endswith(ARCHIVES):
                await asyncio.to_thread(unpack, file, staging, max_bytes=self.max_bytes, remove=True)
        else:
            await fetch_with_fsspec(uri, staging, deadline=self.timeout, max_bytes=self.max_bytes)

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


def _local_path(uri: str) -> Path | None:
    """The local path a storageUri names (a bare path or file://), absolute; None if remote."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return Path(unquote(parts.path)).expanduser().absolute()
    if scheme == "":
        return Path(uri).expanduser().absolute()
    return None


def _within(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or under it, once both are resolved (links, `..`)."""
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def _place_local(source: Path, staging: Path, max_bytes: int) -> None:
    if not source.exists():
        raise ArtefactError(f"storageUri {source}: no such file or directory")
    if source.is_dir():
        shutil.copytree(source, staging, copy_function=_link_or_copy)
    elif source.name.endswith(ARCHIVES):
        staging.mkdir()
        unpack(source, staging, max_bytes=max_bytes)
    else:
        staging.mkdir()
        shutil.copy2(source, staging / source.name)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link (instant, no space) when src and dst share a file system; copy otherwise. Files
    we rewrite later (model-settings.json) are replaced, never written through the link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _mark_owned(model_dir: Path, storage_uri: str) -> None:
    """The marker that says an agent made this directory (so it, or a later agent, may delete
    it); written before the swap, so the directory never appears without it."""
    marker = model_dir / OWNED_MARKER
    fresh = model_dir / f"{OWNED_MARKER}.new"
    fresh.write_text(f"fetched by the modelyard agent from {storage_uri}\n")
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
