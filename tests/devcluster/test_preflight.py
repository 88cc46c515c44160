"""The preflight (preflight.py): a machine that cannot run the real node is told what it needs,
by `make up` and `make test` before they build anything, and by `DevCluster.up`."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from warmgate_devcluster import preflight
from warmgate_devcluster.config import repo_root

ROOT = repo_root()
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def as_a_user_without_root(argv: list[str]) -> list[str]:
    """`argv` run as a user who is not root: `nobody`, by setpriv, when this test runs as root;
    as is otherwise (the user running it is already not root). Nothing is faked: the make and
    the Python that run are the real ones, only without root's rights."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) runs the command as nobody"
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *argv]


@pytest.mark.parametrize("target", ["up", "test"])
def test_make_tells_a_user_without_root_what_the_node_needs_before_building(target):
    python = shutil.which("python3", path=SYSTEM_PATH)
    assert python, "the system's python3 runs the preflight (no venv yet)"
    # A venv folder nobody may create: were the prerequisites (`install`) reached, it would
    # fail there, saying so, instead of with the preflight's message.
    make = ["make", "-C", str(ROOT), target, f"PYTHON={python}", "VENV=/proc/no-venv-here"]
    result = subprocess.run(
        as_a_user_without_root(make),
        env={"PATH": SYSTEM_PATH, "HOME": "/nonexistent", "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"make {target}: the devcluster's real node needs: root" in result.stderr
    assert "Installing into a real cluster" in result.stderr
    assert ("make test-unit" in result.stderr) == (target == "test")
    # Nothing of the prerequisites ran: no venv, no pip, no build scripts.
    assert "no-venv-here" not in result.stderr + result.stdout
    assert "tools/" not in result.stdout, result.stdout


def test_a_machine_that_is_not_linux_is_told_it_needs_linux(monkeypatch, capsys):
    # Faked: the operating system's name. This machine is Linux and no other is at hand; the
    # check asks platform.system(), so that answer is replaced.
    monkeypatch.setattr(preflight.platform, "system", lambda: "Darwin")
    assert preflight.main(["--target", "up"]) == 2
    assert "Linux (this is Darwin)" in capsys.readouterr().err
    with pytest.raises(preflight.NodeUnsupported, match="Linux"):
        preflight.check()


def test_a_user_without_root_is_told_to_use_root_or_a_cluster_of_their_own(monkeypatch):
    # Faked: the user id (so that the check for root is exercised on a machine run as root).
    monkeypatch.setattr(preflight.platform, "system", lambda: "Linux")
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 1000)
    with pytest.raises(preflight.NodeUnsupported, match="root") as raised:
        preflight.check()
    assert "Installing into a real cluster" in str(raised.value)


def test_a_cache_folder_on_a_disk_without_room_is_told_how_much_it_needs(tmp_path):
    # Real filesystems: tmpfs mounts whose sizes are what statvfs reports as free.
    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, "64m"), (large, f"{preflight.FIRST_RUN_FREE_GIB + 1}g")):
        folder.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
        subprocess.run(mount, check=True)
    try:
        first = preflight.disk_shortfall(small / "warmgate")
        assert first is not None
        assert f"{preflight.FIRST_RUN_FREE_GIB} GiB of free disk for a first run" in first
        assert str(small / "warmgate") in first and "WARMGATE_CACHE" in first
        # Once the images are built, a run needs less.
        (small / "warmgate" / "buildah").mkdir(parents=True)
        later = preflight.disk_shortfall(small / "warmgate")
        assert later is not None and f"{preflight.LATER_RUN_FREE_GIB} GiB" in later
        assert preflight.disk_shortfall(large / "warmgate") is None
    finally:
        for folder in (small, large):
            subprocess.run(["umount", str(folder)], check=True)
