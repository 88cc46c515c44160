"""Repository layout rules that, when broken, fail in confusing ways elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_operator_and_server_folders_are_not_packages():
    # A top-level `operator` package shadows the standard library and breaks `python -m`.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "server" / "__init__.py").exists()
    assert not (ROOT / "router" / "__init__.py").exists()


def test_python_dash_m_runs_each_part_from_any_folder(tmp_path):
    for module in (
        "warmgate_server",
        "warmgate_operator",
        "warmgate_router",
        "warmgate_devcluster",
    ):
        result = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout.lower()


def test_test_helpers_live_in_the_support_package():
    # Test files are named after what they test and imported by path (pytest's importlib
    # mode); whatever they share is in tests/support, importable as `support`.
    stray = [
        path.relative_to(ROOT / "tests")
        for path in (ROOT / "tests").rglob("*.py")
        if path.name != "conftest.py"
        and not path.name.startswith("test_")
        and "support" not in path.relative_to(ROOT / "tests").parts
    ]
    assert stray == []


PACKAGES = {
    "server": ROOT / "server" / "warmgate_server",
    "operator": ROOT / "operator" / "warmgate_operator",
    "contract": ROOT / "contract" / "warmgate_contract",
    "devcluster": ROOT / "devcluster" / "warmgate_devcluster",
    "router": ROOT / "router" / "warmgate_router",
    "kube": ROOT / "kube" / "warmgate_kube",
}
# Tests of more than one module, or of a file that is not a module; named for what they check.
ACROSS_MODULES = {
    "contract/test_agreement.py",  # the operator against the server (docs/contract.md)
    "operator/test_crd.py",  # the CRD file
    "operator/test_cluster_crd.py",  # the CRD on a real apiserver
    "operator/test_cluster_operator.py",  # the operator process on a real apiserver
    "router/test_activity.py",  # the router's activity stamps against the operator's idle.py
    "router/test_cluster_router.py",  # the router's watches and writes on a real apiserver
    "server/test_model_folders.py",  # model folders (layouts, checkpoints, refusals) over HTTP
    "server/test_models.py",  # the model families (docs/models.md): loading, head, packed, runner
    "server/test_requests.py",  # routes.py and schemas.py on one shared warm app (test_routes.py)
    "server/test_input_edges.py",  # pre.py's Tokenization on every tokenizer family (tokenizer.py)
    "server/test_out_of_memory.py",  # a CUDA OOM (faults.py) through warming.py and the scheduler
    "server/test_http_fuzz.py",  # raw bytes and any JSON over loopback: routes, schemas, aiohttp
}


def test_each_parts_test_files_are_named_after_the_module_they_test():
    # tests/server/test_cpus.py tests server/warmgate_server/cpus.py; test_main.py __main__.py;
    # a subfolder mirrors the package's (tests/server/models/test_bert.py: models/bert.py).
    misnamed = []
    for part, package in PACKAGES.items():
        for path in sorted((ROOT / "tests" / part).rglob("test_*.py")):
            module = path.stem.removeprefix("test_")
            module = "__main__" if module == "main" else module
            folder = path.parent.relative_to(ROOT / "tests" / part)
            name = (Path(part) / folder / path.name).as_posix()
            if not (package / folder / f"{module}.py").is_file() and name not in ACROSS_MODULES:
                misnamed.append(name)
    assert misnamed == [], "name each after its module, or add it to ACROSS_MODULES saying why"
