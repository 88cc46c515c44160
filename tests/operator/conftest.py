"""Shared helpers for the operator tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# The helper modules next to the tests (operator_fakes, cluster_helpers), whatever import mode.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# Until the project is installed editable, make `warmgate_operator` importable from the folder.
if str(ROOT / "operator") not in sys.path:
    try:
        import warmgate_operator  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "operator"))
