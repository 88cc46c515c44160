"""Image builds: an image is rebuilt only when what goes into it changes."""

from __future__ import annotations

from warmgate_devcluster import images


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
