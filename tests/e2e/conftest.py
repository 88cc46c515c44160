"""End-to-end fixtures: the CRD installed in the devcluster and the operator as a real process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.load import reference_vectors  # noqa: F401 - a fixture for the e2e tests
from support.tiktoken_cache import tiktoken_cache  # noqa: F401 - a fixture (LangChain)

from warmgate_devcluster.testkit import CRD_NAME, Kube, NamespacedOperator, install_crd


@pytest.fixture(scope="session")
def crd(devcluster) -> None:
    install_crd(devcluster)
    devcluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


@pytest.fixture
def kube(devcluster, namespace, crd) -> Kube:
    return Kube(devcluster, namespace)


@pytest.fixture
def operator(devcluster, namespace, crd, tmp_path) -> Iterator[NamespacedOperator]:
    process = NamespacedOperator(devcluster, namespace, tmp_path / "operator.log")
    process.start()
    try:
        yield process
    finally:
        process.stop()
        if process.returncode not in (None, 0, -15):
            print(process.log()[-5000:])
