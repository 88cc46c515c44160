"""Image builds: an image is rebuilt only when what goes into it changes, and copied into a
node only when the node does not hold it with the same inputs."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from warmgate_devcluster import images
from warmgate_devcluster.testkit import wait_until

ROOT = Path(__file__).resolve().parents[2]


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


def pip_installed(dockerfile: Path) -> set[str]:
    """The packages a Dockerfile's `pip install` commands name (options and their values left
    out), normalized as pip compares names."""
    text = dockerfile.read_text().replace("\\\n", " ")
    named: set[str] = set()
    for line in text.splitlines():
        for command in line.split("&&"):
            words = command.split()
            if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
                continue
            skip_next = False
            for word in words[2:]:
                if skip_next:
                    skip_next = False
                elif word in ("-c", "--index-url", "--extra-index-url", "-r"):
                    skip_next = True
                elif not word.startswith("-"):
                    named.add(word.lower().replace("_", "-"))
    return named


def test_the_wheelhouse_holds_what_every_dockerfile_installs():
    # The devcluster builds with pip offline (PIP_NO_INDEX, the wheelhouse): a package a
    # Dockerfile names and the wheelhouse lacks fails the build only there, minutes in.
    wheelhouse = {name.lower().replace("_", "-") for name in images.WHEELHOUSE_REQUIREMENTS}
    dockerfiles = sorted(ROOT.glob("*/Dockerfile"))
    assert {path.parent.name for path in dockerfiles} >= {"operator", "router", "server"}
    for dockerfile in dockerfiles:
        installed = pip_installed(dockerfile)
        assert installed, f"{dockerfile}: no pip install found"
        assert installed <= wheelhouse, (dockerfile, installed - wheelhouse)


def test_the_router_image_is_rebuilt_when_any_file_it_copies_changes(tmp_path, monkeypatch):
    assert images.ROUTER.name == images.ROUTER_IMAGE == "ghcr.io/warmgate/warmgate-router:0.1.0"
    assert images.ROUTER in images.APP_IMAGES and images.ROUTER.depends == (images.BASE,)
    dockerfile = (ROOT / "router" / "Dockerfile").read_text()
    copied = [
        line.split()[1]
        for line in dockerfile.splitlines()
        if line.startswith("COPY ") and not line.startswith("COPY --from")
    ]
    sources = {
        "constraints.txt",
        "contract/warmgate_contract",
        "kube/warmgate_kube",
        "router/warmgate_router",
    }
    assert set(copied) == sources
    for relative in ("router/Dockerfile", ".dockerignore", *copied):
        source, copy = ROOT / relative, tmp_path / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy)
    monkeypatch.setattr(images, "repo_root", lambda: tmp_path)
    before = images.ROUTER.inputs()
    for relative in copied:
        copy = tmp_path / relative
        edited = copy if copy.is_file() else sorted(copy.rglob("*.py"))[0]
        original = edited.read_text()
        edited.write_text(original + "\n# edited\n")
        assert images.ROUTER.inputs() != before, f"an edit to {relative} went unnoticed"
        edited.write_text(original)
    assert images.ROUTER.inputs() == before


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
        # Pinned: kubelet's image garbage collection (a disk nearly full) leaves it, where the
        # node has no registry to pull it back from.
        assert images.node_images(socket)[image.name].labels[images.PINNED_LABEL] == "pinned"
        logged = log.read_text()

        # The node holds it with the same inputs: nothing is built, exported or imported.
        assert images.import_images(socket, [image], log, say=lambda *_: None) == {}
        assert log.read_text() == logged
        assert builds == [image.name]

        # Imported before images were pinned: pinned, not imported again.
        unpin = ["images", "label", image.name, f"{images.PINNED_LABEL}="]
        subprocess.run(images.ctr_argv(socket, *unpin), capture_output=True, check=True)
        assert images.PINNED_LABEL not in images.node_images(socket)[image.name].labels
        assert images.import_images(socket, [image], log, say=lambda *_: None) == {}
        assert images.node_images(socket)[image.name].labels[images.PINNED_LABEL] == "pinned"
        logged = log.read_text()

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
