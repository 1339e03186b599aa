"""Artefacts: local storageUri into <repository>/<name>/, archives, model-settings name, instance count."""

from __future__ import annotations

import importlib.util
import json
import os
import tarfile

import pytest

from modelyard.agent.artefacts import ArtefactError, Artefacts, FetchPolicy, instance_count


def _model_dir(root, name="src", settings_name="something-else"):
    src = root / name
    src.mkdir()
    (src / "model.joblib").write_bytes(b"weights")
    (src / "model-settings.json").write_text(json.dumps({"name": settings_name, "parallel_workers": 3}))
    return src


def _sources_in(root):
    """The agent's policy when the test's sources are under `root` (beside the repository)."""
    return FetchPolicy(roots=(root,))


async def test_a_local_dir_lands_under_the_model_name_with_its_settings_renamed(tmp_path):
    src = _model_dir(tmp_path)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    dest = (await artefacts.fetch("iris", str(src))).path
    assert dest == tmp_path / "repo" / "iris"
    assert (dest / "model.joblib").read_bytes() == b"weights"
    assert json.loads((dest / "model-settings.json").read_text())["name"] == "iris"
    # the source is untouched, even where the copy is a hard link
    assert json.loads((src / "model-settings.json").read_text())["name"] == "something-else"
    assert instance_count(dest) == 3
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["iris"]  # no staging left
    assert sorted(os.listdir(dest)) == [".modelyard-agent", "model-settings.json", "model.joblib"]


async def test_a_single_file_behind_a_link_keeps_the_name_the_storage_uri_gives_it(tmp_path):
    # A Hugging Face cache's snapshot: names are links to blobs named by their hash. Before, the
    # copy was named by the hash, and a linked archive was not unpacked.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "9f86d081").write_bytes(b"onnx weights")
    (tmp_path / "model.onnx").symlink_to(blobs / "9f86d081")
    with tarfile.open(blobs / "e3b0c442", "w:gz") as tar:
        tar.add(_model_dir(tmp_path, "packed"), arcname="packed")
    (tmp_path / "model.tar.gz").symlink_to(blobs / "e3b0c442")
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))

    dest = (await artefacts.fetch("onnx", str(tmp_path / "model.onnx"))).path
    assert sorted(os.listdir(dest)) == [".modelyard-agent", "model.onnx"]
    assert (dest / "model.onnx").read_bytes() == b"onnx weights"

    dest = (await artefacts.fetch("packed", str(tmp_path / "model.tar.gz"))).path
    assert (dest / "model.joblib").read_bytes() == b"weights"


async def test_file_uri_and_replacing_a_model_the_agent_fetched(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "old-file").write_text("v1")
    src = _model_dir(tmp_path)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    first = await artefacts.fetch("iris", str(old))
    assert first.owned and artefacts.owns("iris")
    placed = await artefacts.fetch("iris", src.as_uri())
    dest = placed.path
    assert placed.owned and not (dest / "old-file").exists()
    assert (dest / "model.joblib").exists()
    assert artefacts.remove("iris") is True
    assert not dest.exists()
    assert (old / "old-file").exists() and (src / "model.joblib").exists()  # sources untouched


def _user_model(repo, name="iris"):
    user = repo / name
    user.mkdir(parents=True)
    (user / "model-settings.json").write_text(json.dumps({"name": "user-named"}))
    (user / "weights.bin").write_bytes(b"the user's weights")
    return user


def _untouched(user):
    assert sorted(os.listdir(user)) == ["model-settings.json", "weights.bin"]
    assert (user / "weights.bin").read_bytes() == b"the user's weights"
    assert json.loads((user / "model-settings.json").read_text()) == {"name": "user-named"}


async def test_a_users_directory_in_the_repository_is_never_swapped_out_or_removed(tmp_path):
    repo = tmp_path / "repo"
    user = _user_model(repo)
    artefacts = Artefacts(repo, max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    with pytest.raises(ArtefactError, match="exists and was not fetched by the agent"):
        await artefacts.fetch("iris", str(_model_dir(tmp_path)))
    assert artefacts.remove("iris") is False
    _untouched(user)
    assert sorted(os.listdir(repo)) == ["iris"]


@pytest.mark.parametrize(
    "uri", ["{repo}/iris", "file://{repo}/iris", "{repo}/iris/weights.bin", "{repo}/../repo/iris"]
)
async def test_a_storage_uri_in_the_models_own_directory_is_used_in_place(tmp_path, uri):
    repo = tmp_path / "repo"
    user = _user_model(repo)
    artefacts = Artefacts(repo, max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    placed = await artefacts.fetch("iris", uri.format(repo=repo))
    assert placed.path == user and placed.owned is False
    assert artefacts.remove("iris") is False  # what an unload does: nothing to the user's files
    _untouched(user)


async def test_a_storage_uri_holding_the_repository_is_refused(tmp_path):
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    with pytest.raises(ArtefactError, match="holds the repository"):
        await artefacts.fetch("iris", str(tmp_path))


async def test_leftovers_of_an_interrupted_fetch_are_cleaned_and_nothing_else(tmp_path):
    repo = tmp_path / "repo"
    _user_model(repo)
    for leftover in (".iris.staging-0123abcd", ".iris.old-deadbeef", ".dotted.name.staging-00000000"):
        (repo / leftover).mkdir()
        (repo / leftover / "f").write_text("x")
    (repo / ".f.part-abcdef01").write_text("partial")
    (repo / ".keep").mkdir()
    (repo / ".iris.staging-notours").mkdir()
    removed = Artefacts(repo, max_bytes=1, timeout=1, policy=_sources_in(tmp_path)).clean_leftovers()
    assert len(removed) == 4
    assert sorted(os.listdir(repo)) == [".iris.staging-notours", ".keep", "iris"]


def test_a_name_the_repository_cannot_hold_is_never_removed(tmp_path):
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1, timeout=1, policy=_sources_in(tmp_path))
    assert artefacts.remove("../repo") is False and artefacts.owns(".hidden") is False


async def test_a_tarball_with_one_top_directory_is_unpacked_into_the_model_dir(tmp_path):
    src = _model_dir(tmp_path, name="packed")
    archive = tmp_path / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="packed")
    placed = await Artefacts(
        tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path)
    ).fetch("iris", str(archive))
    assert sorted(os.listdir(placed.path)) == [".modelyard-agent", "model-settings.json", "model.joblib"]


async def test_missing_sources_and_bad_names_are_clear_errors(tmp_path):
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    with pytest.raises(ArtefactError, match="no such file"):
        await artefacts.fetch("iris", str(tmp_path / "nope"))
    with pytest.raises(ArtefactError, match="cannot be a repository directory"):
        await artefacts.fetch("../escape", str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("fsspec") is not None, reason="fsspec is installed")
async def test_s3_without_fsspec_says_what_to_install(tmp_path):
    with pytest.raises(Exception, match="fsspec"):
        await Artefacts(tmp_path / "repo", max_bytes=1, timeout=10, policy=_sources_in(tmp_path)).fetch(
            "iris", "s3://bucket/iris"
        )


def test_instance_count_from_triton_config_or_unknown(tmp_path):
    (tmp_path / "config.pbtxt").write_text(
        'name: "m"\ninstance_group [\n  { count: 2 kind: KIND_GPU },\n  { count: 1 kind: KIND_CPU }\n]\n'
    )
    assert instance_count(tmp_path) == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    assert instance_count(empty) == 0


async def test_a_replace_can_keep_the_old_files_aside_then_restore_or_discard_them(tmp_path):
    first, second = tmp_path / "v1", tmp_path / "v2"
    for source, text in ((first, "one"), (second, "two")):
        source.mkdir()
        (source / "weights").write_text(text)
    artefacts = Artefacts(tmp_path / "repo", max_bytes=1 << 20, timeout=10, policy=_sources_in(tmp_path))
    await artefacts.fetch("m", str(first))
    placed = await artefacts.fetch("m", str(second), keep_previous=True)
    assert placed.previous is not None and (placed.previous / "weights").read_text() == "one"
    assert (placed.path / "weights").read_text() == "two"
    artefacts.restore("m", placed.previous)  # version 2 failed to load
    assert (tmp_path / "repo" / "m" / "weights").read_text() == "one"
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["m"]

    placed = await artefacts.fetch("m", str(second), keep_previous=True)
    assert placed.previous is not None
    artefacts.discard(placed.previous)  # version 2 loaded
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["m"]
    assert (tmp_path / "repo" / "m" / "weights").read_text() == "two"
