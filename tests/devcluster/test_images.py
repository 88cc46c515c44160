"""Image builds: an image is rebuilt only when what goes into it changes, and copied into a
node only when the node does not hold it with the same inputs."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from warmgate_devcluster import images
from warmgate_devcluster.testkit import wait_until


def test_an_image_is_rebuilt_only_when_what_goes_into_it_changes(tmp_path, monkeypatch):
    (tmp_path / "constraints.txt").write_text("torch==2\n")
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(images, "repo_root", lambda: tmp_path)
    _build, inputs = images._dockerfile_image("Dockerfile", ("constraints.txt", "pkg"))
    first = inputs()
    # Caches the build leaves out do not count.
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert inputs() == first
    (package / "a.py").write_text("x = 2\n")
    assert inputs() != first
    (package / "a.py").write_text("x = 1\n")
    assert inputs() == first
    (package / "a.py").chmod(0o755)
    assert inputs() != first


# ------------------------------------------------------------------ the cache, for real
def throwaway_image(tag: str, builds: list[str], changed: str = "") -> images.Image:
    """A real one-binary image (the pause binary, by images.py's own recipe) under a name no
    cluster uses, whose builds are counted; `changed` stands for an edit to what goes into it."""
    build, inputs = images._binary_image("pause", ["/pause"], "65535:65535")

    def counted(image: images.Image, log: Path) -> None:
        builds.append(image.name)
        build(image, log)

    return images.Image(
        name=f"localhost/warmgate/test-cache:{tag}",
        build=counted,
        inputs=lambda: inputs() + changed,
    )


def stored_id(name: str) -> str:
    result = subprocess.run(
        images.buildah_argv("inspect", "--type", "image", "--format", "{{.FromImageID}}", name),
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def in_buildah(image_id: str) -> bool:
    result = subprocess.run(
        images.buildah_argv("inspect", "--type", "image", image_id), capture_output=True
    )
    return result.returncode == 0


def remove_from_buildah(name: str) -> None:
    subprocess.run(images.buildah_argv("rmi", "--force", name), capture_output=True)


@pytest.mark.cluster  # buildah and the node's binaries, as the devcluster builds with them
def test_ensure_built_runs_no_build_when_nothing_changed(tmp_path):
    builds: list[str] = []
    log = tmp_path / "images.log"
    image = throwaway_image(uuid.uuid4().hex[:12], builds)
    try:
        assert images.ensure_built(image, log, say=lambda *_: None) == image.input_hash()
        assert builds == [image.name]
        stored = stored_id(image.name)
        logged = log.read_text()

        said: list[str] = []
        assert images.ensure_built(image, log, say=said.append) == image.input_hash()
        # No build ran: the recipe was not called, nothing was said or run into the log, and
        # buildah holds the very image it held.
        assert builds == [image.name] and said == []
        assert log.read_text() == logged
        assert stored_id(image.name) == stored

        edited = throwaway_image(image.name.rpartition(":")[2], builds, changed="edited")
        assert images.ensure_built(edited, log, say=said.append) == edited.input_hash()
        assert builds == [image.name, image.name]
        assert stored_id(image.name) != stored
        assert edited.built_hash() == edited.input_hash() != image.input_hash()
        # The old version, nameless now, is gone from buildah's storage, not left to pile up.
        assert not in_buildah(stored)
    finally:
        remove_from_buildah(image.name)


@pytest.mark.cluster
def test_import_images_copies_an_image_only_when_the_node_lacks_it(devcluster, tmp_path):
    socket = devcluster.cluster.paths.containerd_socket
    builds: list[str] = []
    log = tmp_path / "images.log"
    image = throwaway_image(uuid.uuid4().hex[:12], builds)
    try:
        took = images.import_images(socket, [image], log, say=lambda *_: None)
        assert list(took) == [image.name]
        assert images.containerd_inputs(socket)[image.name] == image.input_hash()
        logged = log.read_text()

        # The node holds it with the same inputs: nothing is built, exported or imported.
        assert images.import_images(socket, [image], log, say=lambda *_: None) == {}
        assert log.read_text() == logged
        assert builds == [image.name]

        # The node holds it with other inputs (an older build): it is imported again.
        relabel = ["images", "label", image.name, f"{images.INPUTS_LABEL}=older"]
        subprocess.run(images.ctr_argv(socket, *relabel), capture_output=True, check=True)
        took = images.import_images(socket, [image], log, say=lambda *_: None)
        assert list(took) == [image.name]
        assert images.containerd_inputs(socket)[image.name] == image.input_hash()
        assert builds == [image.name]  # buildah's copy was current: only the import ran

        # A new version under the same name: the node keeps it and drops the old one, whose id
        # CRI had named it by (that name would keep the old layers for good).
        old_id = f"sha256:{stored_id(image.name)}"
        wait_until(
            lambda: old_id in images.node_images(socket), what="CRI naming the image by its id"
        )
        edited = throwaway_image(image.name.rpartition(":")[2], builds, changed="edited")
        assert list(images.import_images(socket, [edited], log, say=lambda *_: None)) == [
            image.name
        ]
        held = images.node_images(socket)
        assert old_id not in held
        assert held[image.name].labels[images.INPUTS_LABEL] == edited.input_hash()
    finally:
        subprocess.run(images.ctr_argv(socket, "images", "rm", image.name), capture_output=True)
        images.remove_orphan_ids(socket, log)
        remove_from_buildah(image.name)
