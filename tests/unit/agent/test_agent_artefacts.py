"""Artefacts: local storageUri into <repository>/<name>/, archives, model-settings name, instance count."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from modelyard.agent.artefacts import ArtefactError, Artefacts, instance_count


def _model_dir(root, name="src", settings_name="something-else"):
    src = root / name
    src.mkdir()
    (src / "model.joblib").write_bytes(b"weights")
    (src / "model-settings.json").write_text(json.dumps({"name": settings_name, "parallel_workers": 3}))
    return src


async def test_a_local_dir_lands_under_the_model_name_with_its_settings_renamed(tmp_path):
    src = _model_dir(tmp_path)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10)
    dest = await artefacts.fetch("iris", str(src))
    assert dest == tmp_path / "repo" / "iris"
    assert (dest / "model.joblib").read_bytes() == b"weights"
    assert json.loads((dest / "model-settings.json").read_text())["name"] == "iris"
    # the source is untouched, even where the copy is a hard link
    assert json.loads((src / "model-settings.json").read_text())["name"] == "something-else"
    assert instance_count(dest) == 3
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["iris"]  # no staging left


async def test_file_uri_and_replacing_an_existing_model(tmp_path):
    src = _model_dir(tmp_path)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10)
    stale = tmp_path / "repo" / "iris"
    stale.mkdir(parents=True)
    (stale / "old-file").write_text("v1")
    dest = await artefacts.fetch("iris", src.as_uri())
    assert not (dest / "old-file").exists()
    assert (dest / "model.joblib").exists()
    artefacts.remove("iris")
    assert not dest.exists()


async def test_a_tarball_with_one_top_directory_is_unpacked_into_the_model_dir(tmp_path):
    src = _model_dir(tmp_path, name="packed")
    archive = tmp_path / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="packed")
    dest = await Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10).fetch("iris", str(archive))
    assert sorted(os.listdir(dest)) == ["model-settings.json", "model.joblib"]


async def test_missing_sources_and_bad_names_are_clear_errors(tmp_path):
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10)
    with pytest.raises(ArtefactError, match="no such file"):
        await artefacts.fetch("iris", str(tmp_path / "nope"))
    with pytest.raises(ArtefactError, match="cannot be a repository directory"):
        await artefacts.fetch("../escape", str(tmp_path))


async def test_s3_without_fsspec_says_what_to_install(tmp_path):
    try:
        import fsspec  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("fsspec is installed")
    with pytest.raises(Exception, match="fsspec"):
        await Artefacts(tmp_path / "repo", max_bytes=1, timeout=10).fetch("iris", "s3://bucket/iris")


def test_instance_count_from_triton_config_or_unknown(tmp_path):
    (tmp_path / "config.pbtxt").write_text(
        'name: "m"\ninstance_group [\n  { count: 2 kind: KIND_GPU },\n  { count: 1 kind: KIND_CPU }\n]\n'
    )
    assert instance_count(tmp_path) == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    assert instance_count(empty) == 0
