"""The operator's pod client against real server processes: the warm gate's timed verification
request goes to the route of the server's task (an embedder's /embed, a re-ranker's /rerank, a
classifier's /predict, a SPLADE model's /embed_sparse), so a re-ranker's or a sparse encoder's
pod is verified like an embedder's (issue 43)."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from warmgate_operator import gate
from warmgate_operator.metrics import Metrics
from warmgate_operator.podclient import PodClient
from warmgate_testkit import zoo
from warmgate_testkit.process import ServerProcess

PLAN = ["--sequence-buckets", "32", "--warmup-batch-sizes", "1,4"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("podclient-models")
    folders = {
        "rerank": zoo.cross_encoder("bert-mean", root, 1, "sigmoid"),
        "classify": zoo.cross_encoder("bert-mean", root, 2, None, seed=2),
        "sparse": zoo.splade("bert-mean", root),
    }
    started = {
        task: ServerProcess(["--model", str(folder), *PLAN]) for task, folder in folders.items()
    }
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            assert server.wait_ready(300)["phase"] == "ready"
        yield started
    finally:
        for server in started.values():
            server.kill()


async def test_the_timed_request_takes_the_route_of_the_server_s_task(servers) -> None:
    client = PodClient(Metrics())
    try:
        for task, server in servers.items():
            status, report = await client.get_json("127.0.0.1", server.port, "/ready")
            assert status == 200
            settings = report["model_settings"]
            verdict = gate.Verdict(
                True, "", "", task=settings["task"], outputs=tuple(settings["outputs"])
            )
            assert verdict.verification == task
            inputs = ["a short verification text"] * 4
            assert await client.time_request("127.0.0.1", server.port, inputs, task) > 0
            # The embedder's route on a re-ranker or classifier is refused: timed there, the
            # gate would never pass the pod.
            with pytest.raises(aiohttp.ClientResponseError) as refused:
                await client.time_request("127.0.0.1", server.port, inputs, "embed")
            assert refused.value.status == 424
    finally:
        await client.close()
