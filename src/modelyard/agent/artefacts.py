"""Model artefacts in the inference server's repository directory: `<repository>/<name>/`.

`storageUri` may be a local path or `file://` (a directory is hard-linked where the file system
allows, else copied; a file is copied), `http(s)://` (downloaded, size-bounded, by upstream/), or
any fsspec protocol such as `s3://` and `gs://` (when fsspec is installed). A downloaded or local
`.tar.gz`/`.tgz`/`.tar`/`.zip` is unpacked. Every fetch is staged beside its destination and swapped
in, so the server never loads half a model.

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
import tarfile
import uuid
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from modelyard.errors import ModelyardError
from modelyard.upstream.download import download, fetch_with_fsspec

_ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
_TRITON_COUNT = re.compile(r"\bcount\s*:\s*(\d+)")


class ArtefactError(ModelyardError):
    """A storageUri that could not be fetched into the repository."""


class Artefacts:
    def __init__(self, repository: Path, *, max_bytes: int, timeout: float) -> None:
        self.repository = repository
        self.max_bytes = max_bytes
        self.timeout = timeout

    def path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ArtefactError(f"model name {name!r} cannot be a repository directory")
        return self.repository / name

    async def fetch(self, name: str, storage_uri: str) -> Path:
        """Put `storage_uri`'s files at `<repository>/<name>/`, replacing what was there."""
        dest = self.path(name)
        self.repository.mkdir(parents=True, exist_ok=True)
        staging = self.repository / f".{name}.staging-{uuid.uuid4().hex[:8]}"
        try:
            await self._fetch_into(storage_uri, staging)
            await asyncio.to_thread(_set_settings_name, staging, name)
            await asyncio.to_thread(_swap_in, staging, dest)
        except ModelyardError:
            raise
        except OSError as error:
            raise ArtefactError(f"cannot fetch {storage_uri} into {dest}: {error}") from None
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        return dest

    async def _fetch_into(self, uri: str, staging: Path) -> None:
        parts = urlsplit(uri)
        scheme = parts.scheme.lower()
        if scheme in ("", "file"):
            await asyncio.to_thread(_place_local, unquote(parts.path) if scheme == "file" else uri, staging)
        elif scheme in ("http", "https"):
            await asyncio.to_thread(staging.mkdir)
            basename = PurePosixPath(unquote(parts.path)).name or "model"
            file = await download(uri, staging / basename, max_bytes=self.max_bytes, deadline=self.timeout)
            if basename.endswith(_ARCHIVES):
                await asyncio.to_thread(_unpack, file, staging, remove=True)
        else:
            await fetch_with_fsspec(uri, staging, deadline=self.timeout)

    def remove(self, name: str) -> None:
        """Delete the model's directory, if any (after an unload or a failed load)."""
        shutil.rmtree(self.path(name), ignore_errors=True)


def _place_local(path: str, staging: Path) -> None:
    source = Path(path).expanduser()
    if not source.exists():
        raise ArtefactError(f"storageUri {path}: no such file or directory")
    if source.is_dir():
        shutil.copytree(source, staging, copy_function=_link_or_copy)
    elif source.name.endswith(_ARCHIVES):
        staging.mkdir()
        _unpack(source, staging)
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


def _unpack(archive: Path, into: Path, *, remove: bool = False) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zipped:
            for member in zipped.namelist():  # refuse paths that climb out, as tarfile's data filter does
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ArtefactError(f"{archive.name}: unsafe path {member!r} in the archive")
            zipped.extractall(into)
    else:
        with tarfile.open(archive) as tarred:
            try:
                tarred.extractall(into, filter="data")
            except tarfile.FilterError as error:
                raise ArtefactError(f"{archive.name}: {error}") from None
    if remove:
        archive.unlink()
    # An archive of one top-level directory (model/...) holds the model inside it.
    entries = [p for p in into.iterdir() if p != archive]
    if len(entries) == 1 and entries[0].is_dir():
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(into / child.name)
        inner.rmdir()


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


def _swap_in(staging: Path, dest: Path) -> None:
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


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
