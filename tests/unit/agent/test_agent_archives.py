"""Archives unpacked into a model directory: size bound, unsafe members, top-directory flattening."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile

import pytest

from modelyard.agent.archives import ArchiveError
from modelyard.agent.artefacts import Artefacts, FetchPolicy


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = b"\0" * n
        self.left -= n
        return n


def _sources_in(root):
    """The agent's policy when the test's sources are under `root` (beside the repository)."""
    return FetchPolicy(roots=(root,))


def _tar(path, *members, mode="w"):
    """members: (name, bytes | int size of zeros) for files, (name, "->", target) for symlinks,
    (name, "=>", target) for hard links."""
    with tarfile.open(path, mode) as tar:
        for member in members:
            info = tarfile.TarInfo(member[0])
            if len(member) == 3:
                info.type = tarfile.SYMTYPE if member[1] == "->" else tarfile.LNKTYPE
                info.linkname = member[2]
                tar.addfile(info)
            elif isinstance(member[1], int):
                info.size = member[1]
                tar.addfile(info, io.BufferedReader(_Zeros(member[1])))
            else:
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return path


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".modelyard-agent")


async def test_an_archive_that_unpacks_over_the_bound_is_refused_before_writing(tmp_path):
    # 4 MiB of zeros compress to a few KiB: the download bound alone let it through (a bomb).
    archive = _tar(tmp_path / "bomb.tar.gz", ("big.bin", 4 << 20), mode="w:gz")
    assert archive.stat().st_size < 64 << 10
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    with pytest.raises(ArchiveError, match="over the limit of 1048576"):
        await artefacts.fetch("iris", str(archive))
    assert os.listdir(tmp_path / "repo") == []  # staging gone, nothing written

    zipped = tmp_path / "bomb.zip"
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("big.bin", b"\0" * (4 << 20))
    with pytest.raises(ArchiveError, match="over the limit"):
        await artefacts.fetch("iris", str(zipped))


@pytest.mark.parametrize(
    "member",
    [
        ("../escape", b"x"),
        ("/abs", b"x"),
        ("link", "->", "../../outside"),
        ("sub/link", "->", "/etc/passwd"),
        ("hard", "=>", "../outside"),
    ],
)
async def test_members_that_would_land_outside_the_model_are_refused(tmp_path, member):
    archive = _tar(tmp_path / "evil.tar", ("ok", b"x"), member)
    with pytest.raises(ArchiveError):
        await Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)).fetch(
            "iris", str(archive)
        )
    assert os.listdir(tmp_path / "repo") == []
    assert not (tmp_path / "escape").exists()


async def test_links_inside_the_model_are_kept(tmp_path):
    archive = _tar(
        tmp_path / "m.tar", ("a/weights", b"w"), ("a/link", "->", "weights"), ("b", "=>", "a/weights")
    )
    placed = await Artefacts(
        tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)
    ).fetch("iris", str(archive))
    assert (placed.path / "a" / "link").read_bytes() == b"w" and (placed.path / "b").read_bytes() == b"w"


async def test_a_zip_member_climbing_out_is_refused(tmp_path):
    zipped = tmp_path / "evil.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("../escape", b"x")
    with pytest.raises(ArchiveError, match="unsafe path"):
        await Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)).fetch(
            "iris", str(zipped)
        )


async def test_a_single_top_directory_is_flattened_only_when_it_is_the_model_root(tmp_path):
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    # Triton's version directory is part of the model: before, `1/` was flattened away.
    triton = await artefacts.fetch("densenet", str(_tar(tmp_path / "t.tar", ("1/model.onnx", b"onnx"))))
    assert _tree(triton.path) == ["1", "1/model.onnx"]
    # A wrapper holding a child of its own name: before, ENOTEMPTY.
    wrapped = _tar(tmp_path / "m.tar", ("model/model/weights", b"w"), ("model/config.pbtxt", b'name: "m"'))
    placed = await artefacts.fetch("mm", str(wrapped))
    assert _tree(placed.path) == ["config.pbtxt", "model", "model/weights"]
    # A single directory that is not a model root stays.
    plain = await artefacts.fetch("pp", str(_tar(tmp_path / "p.tar", ("model/model/weights", b"w"))))
    assert _tree(plain.path) == ["model", "model/model", "model/model/weights"]
