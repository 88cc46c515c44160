"""Repository layout rules that, when broken, fail in confusing ways elsewhere."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_operator_and_server_folders_are_not_packages():
    # A top-level `operator` package shadows the standard library and breaks `python -m`.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "server" / "__init__.py").exists()


def test_python_dash_m_runs_each_part_from_any_folder(tmp_path):
    for module in ("warmgate_server", "warmgate_operator", "warmgate_devcluster"):
        result = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout.lower()


def test_test_module_names_are_unique():
    # pytest's default import mode imports test modules by basename.
    names = Counter(path.name for path in (ROOT / "tests").rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
