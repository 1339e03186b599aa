"""Archives unpacked into a model directory: size bound, unsafe members, top-directory flattening."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from modelyard.agent.archives import ArchiveError, unpack
from modelyard.agent.artefacts import ArtefactError, Artefacts, FetchPolicy


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


def _escape_by_long_paths(path, outside):
    """A tar that wrote outside the model on Python 3.11.7 (tarfile's "data" filter gives up on
    paths past PATH_MAX, CVE-2025-4517) though every link in it passed the lexical check: 16
    nested 247-character directories with a one-letter link to each, a link `../` x 16 at the
    bottom (lexically inside), and a link through it that climbs out to `outside`."""
    long_name = "d" * 247
    steps = "abcdefghijklmnop"
    with tarfile.open(path, "w") as tar:

        def add(name, kind, link="", data=None):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            if data is None:
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        here = ""
        for letter in steps:
            add(os.path.join(here, long_name), tarfile.DIRTYPE)
            add(os.path.join(here, letter), tarfile.SYMTYPE, long_name)
            here = os.path.join(here, long_name)
        bottom = os.path.join(*steps, "l" * 254)
        add(bottom, tarfile.SYMTYPE, "../" * len(steps))
        add("escape", tarfile.SYMTYPE, bottom + "/" + "../" * 15 + str(outside).lstrip("/"))
        add("escape/pwned.txt", tarfile.REGTYPE, data=b"written by a model archive\n")
        add("model-settings.json", tarfile.REGTYPE, data=b'{"name": "x"}')
    return path


async def test_an_archive_escaping_through_over_long_link_paths_is_refused(tmp_path):
    # Before: fetched "successfully", and OUTSIDE/pwned.txt was written (the review's d1).
    outside = tmp_path / "OUTSIDE"
    outside.mkdir()
    archive = _escape_by_long_paths(tmp_path / "evil.tar", outside)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 30, timeout=30, policy=_sources_in(tmp_path))
    with pytest.raises(ArchiveError, match="is a link; links in archives are refused"):
        await artefacts.fetch("evil", str(archive))
    assert os.listdir(outside) == []
    assert os.listdir(tmp_path / "repo") == []


async def test_an_archive_thousands_of_directories_deep_is_refused_and_the_agent_still_starts(tmp_path):
    # Before: 3,000 levels unpacked, then removing the staging raised RecursionError, and the
    # leftover stopped the next agent in clean_leftovers().
    deep = "/".join(["d"] * 3000) + "/weights.bin"
    archive = _tar(tmp_path / "deep.tar", ("model-settings.json", b"{}"), (deep, b"w"))
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=30, policy=_sources_in(tmp_path))
    with pytest.raises(ArchiveError, match="more than 64 directories deep"):
        await artefacts.fetch("deep", str(archive))
    assert os.listdir(tmp_path / "repo") == []
    assert artefacts.clean_leftovers() == []  # (a leftover it cannot remove stops the agent starting)

    # A file 64 directories down is as deep as it may be: it unpacks; one more is refused.
    fine = "/".join(["d"] * 64) + "/weights.bin"
    archive = _tar(tmp_path / "fine.tar", ("model-settings.json", b"{}"), (fine, b"w"))
    placed = await artefacts.fetch("fine", str(archive))
    assert (placed.path / fine).read_bytes() == b"w"
    archive = _tar(tmp_path / "over.tar", ("model-settings.json", b"{}"), ("d/" + fine, b"w"))
    with pytest.raises(ArchiveError, match="more than 64 directories deep"):
        await artefacts.fetch("over", str(archive))


def _nested(source: Path, levels: int) -> None:
    """`levels` directories `d/d/...` under `source`, a file in the deepest, made by descriptor
    (the path would pass PATH_MAX)."""
    fd = os.open(source, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("weights.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


async def test_a_source_directory_thousands_deep_is_refused(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "model-settings.json").write_text("{}")
    _nested(source, 200)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=30, policy=_sources_in(tmp_path))
    with pytest.raises(ArtefactError, match="more than 64 directories deep"):
        await artefacts.fetch("deep", str(source))
    assert os.listdir(tmp_path / "repo") == []


@pytest.mark.parametrize(("levels", "fetched"), [(64, True), (65, False)])
async def test_a_source_directory_64_deep_is_copied_and_65_is_not(tmp_path, levels, fetched):
    source = tmp_path / "model"
    source.mkdir()
    _nested(source, levels)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=30, policy=_sources_in(tmp_path))
    if fetched:
        placed = await artefacts.fetch("m", str(source))
        assert (placed.path / "/".join(["d"] * levels) / "weights.bin").exists()
    else:
        with pytest.raises(ArtefactError, match="more than 64 directories deep"):
            await artefacts.fetch("m", str(source))


@pytest.mark.parametrize(
    "members",
    [
        # a chain whose link texts each stay inside: B is the model, so B/.. is its parent
        [("B", "->", "."), ("A", "->", "B/.."), ("A/x", b"x")],
        [("a/weights", b"w"), ("a/link", "->", "weights")],
        [("a/weights", b"w"), ("b", "=>", "a/weights")],
    ],
)
async def test_links_are_refused_even_when_they_point_inside(tmp_path, members):
    archive = _tar(tmp_path / "m.tar", *members)
    with pytest.raises(ArchiveError, match="is a link; links in archives are refused"):
        await Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)).fetch(
            "iris", str(archive)
        )
    assert os.listdir(tmp_path / "repo") == []
    assert sorted(os.listdir(tmp_path)) == ["m.tar", "repo"]


async def test_a_zip_member_that_is_a_link_is_refused(tmp_path):
    # Before: zipfile wrote it as a file holding the link's text, and the fetch succeeded.
    zipped = tmp_path / "link.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("model-settings.json", b"{}")
        link = zipfile.ZipInfo("weights")
        link.create_system = 3  # Unix
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(link, "/etc/passwd")
    with pytest.raises(ArchiveError, match="'weights' is a link"):
        await Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)).fetch(
            "iris", str(zipped)
        )
    assert os.listdir(tmp_path / "repo") == []


@pytest.mark.parametrize("kind", [tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE])
def test_special_members_are_refused(tmp_path, kind):
    info = tarfile.TarInfo("dev")
    info.type = kind
    with tarfile.open(tmp_path / "m.tar", "w") as tar:
        tar.addfile(info)
    (tmp_path / "into").mkdir()
    with pytest.raises(ArchiveError, match="'dev' is not a regular file or directory"):
        unpack(tmp_path / "m.tar", tmp_path / "into", max_bytes=1 << 20)
    assert os.listdir(tmp_path / "into") == []


def test_nothing_is_written_through_a_link_someone_put_in_the_directory(tmp_path):
    # Another process that can write in the repository plants links in the staging directory:
    # a directory link fails the archive, a file link is replaced, never written through.
    outside = tmp_path / "outside"
    outside.mkdir()
    into = tmp_path / "into"
    into.mkdir()
    (into / "sub").symlink_to(outside)
    (into / "weights").symlink_to(outside / "weights")
    archive = _tar(tmp_path / "m.tar", ("weights", b"w"), ("sub/x", b"x"))
    with pytest.raises(ArchiveError, match="cannot write 'sub'"):
        unpack(archive, into, max_bytes=1 << 20)
    assert os.listdir(outside) == []
    assert not (into / "weights").is_symlink() and (into / "weights").read_bytes() == b"w"


def test_odd_names_are_normalised_or_refused(tmp_path):
    into = tmp_path / "into"
    into.mkdir()
    unpack(_tar(tmp_path / "ok.tar", ("./a//b/./c", b"c"), ("d\\e", b"e")), into, max_bytes=1 << 20)
    assert (into / "a" / "b" / "c").read_bytes() == b"c" and (into / "d" / "e").read_bytes() == b"e"
    for name in ("a/../../x", "..\\x", "/abs"):
        with pytest.raises(ArchiveError, match="unsafe path"):
            unpack(_tar(tmp_path / "bad.tar", (name, b"x")), into, max_bytes=1 << 20)


def test_permissions_are_kept_as_the_data_filter_keeps_them(tmp_path):
    path = tmp_path / "m.tar"
    with tarfile.open(path, "w") as tar:
        for name, mode in (("run.sh", 0o4777), ("weights", 0o666), ("secret", 0o400)):
            info = tarfile.TarInfo(name)
            info.mode, info.size = mode, 1
            tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "into").mkdir()
    unpack(path, tmp_path / "into", max_bytes=1 << 20)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "into").iterdir()}
    assert modes == {"run.sh": 0o755, "weights": 0o644, "secret": 0o600}


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
