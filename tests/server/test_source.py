"""Where the model comes from (source.py): a hub id is downloaded at the asked revision, with
progress in `/ready`, and served offline from the cache afterwards; a plain folder is read as it
is; the report names the commit and the weights' digest that were loaded.

No hub can be reached from here: the hub is `warmgate_devcluster.hubmirror`, a local HTTP server
that speaks the Hugging Face hub's file protocol, started by these tests on loopback and seeded
with two revisions of all-MiniLM-L6-v2 whose weights differ (`main`, and `v2` with nudged
weights). The server downloads from it with huggingface_hub, as it would from huggingface.co.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from warmgate_devcluster import hubmirror
from warmgate_devcluster.models import MINILM_ID, minilm_folder, minilm_v2_folder, seed_hub
from warmgate_server.errors import ModelLoadError
from warmgate_server.source import locate, weights_digest
from warmgate_testkit.process import ServerProcess

QUICK = ["--device", "cpu", "--warmup-batch-sizes", "1", "--sequence-buckets", "16"]
TOKEN = "hf_test_token"
TEXTS = ["a cat sits on the mat", "the stock market fell sharply today"]


@pytest.fixture(scope="module")
def commits() -> dict[str, str]:
    return seed_hub()


@pytest.fixture
def hub(commits):
    """The mirror, private (a token is needed) and slowed to 30 MB/s so a download lasts long
    enough to be watched."""
    server = hubmirror.serve(seed_hub_root(), "127.0.0.1", 0, token=TOKEN, rate=30e6)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def seed_hub_root() -> Path:
    from warmgate_devcluster.models import hub_root

    return hub_root()


def endpoint(server) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def embed(server: ServerProcess) -> np.ndarray:
    request = urllib.request.Request(
        server.url + "/embed",
        data=json.dumps({"inputs": TEXTS}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return np.array(json.loads(response.read()))


def reference(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(TEXTS, normalize_embeddings=True)


def test_a_hub_revision_is_downloaded_reported_and_then_served_offline(
    hub, commits, tmp_path
) -> None:
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": endpoint(hub),
        "HF_TOKEN": TOKEN,
    }
    args = ["--model", MINILM_ID, "--model-revision", "v2", *QUICK]
    with ServerProcess(args, env=env) as server:
        server.wait_for_port(120)
        seen: list[dict] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status, report = server.get_json("/ready")
            seen.append(report)
            if status == 200 or report["phase"] == "failed":
                break
            time.sleep(0.1)
        assert report["phase"] == "ready", report.get("error")
        downloading = [r for r in seen if r["phase"] == "downloading"]
        assert downloading, [r["phase"] for r in seen]
        total = report["download"]["total_bytes"]
        assert total > 90e6  # the weights (about 91 MB) and the small files
        # Progress moved while it downloaded, and ended complete.
        partial = [r["download"]["done_bytes"] for r in downloading if r["download"]]
        assert any(0 < done < total for done in partial), partial
        assert report["download"]["done_bytes"] == total
        assert "downloading sentence-transformers/all-MiniLM-L6-v2" in server.log()
        # What it loaded: the commit `v2` named, and the digest of v2's weights.
        assert report["model"]["revision"] == "v2"
        assert report["model"]["commit"] == commits["v2"]
        assert report["model"]["weights_digest"] == weights_digest(minilm_v2_folder())
        status, info = server.get_json("/info")
        assert info["model_sha"] == commits["v2"]
        vectors = embed(server)
    np.testing.assert_allclose(vectors, reference(minilm_v2_folder()), atol=2e-4)
    assert np.abs(vectors - reference(minilm_folder())).max() > 1e-2  # not main's weights

    # From the cache, offline: nothing is asked of the hub.
    asked = len(hub.hub.requests)
    with ServerProcess(args, env={**env, "HF_HUB_OFFLINE": "1"}) as server:
        report = server.wait_ready(300)
        assert report["model"]["commit"] == commits["v2"]
        assert report["download"] is None
        np.testing.assert_allclose(embed(server), vectors, atol=1e-6)
    assert len(hub.hub.requests) == asked


def test_a_hub_that_refuses_fails_the_start_and_says_why(hub, tmp_path) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint(hub)}
    # No token for a private repository, then a revision that does not exist.
    for revision, extra, expected in (
        ("main", {}, "cannot download it from"),
        ("v9", {"HF_TOKEN": TOKEN}, "at revision 'v9'"),
    ):
        args = ["--model", MINILM_ID, "--model-revision", revision, *QUICK]
        with ServerProcess(args, env={**env, **extra}) as server:
            code = server.wait(timeout=120)
        assert code != 0
        assert expected in server.log() and endpoint(hub) in server.log(), server.log()[-2000:]


def test_a_folder_is_read_as_it_is_and_its_digest_follows_the_weights(tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(minilm_folder(), copy)
    source = locate(str(copy), "main")
    assert source.commit is None and source.folder == copy.resolve()
    # The same weights under another folder: the same digest; other weights: another.
    assert source.digest == weights_digest(minilm_folder())
    assert source.digest != weights_digest(minilm_v2_folder())
    (copy / "README.md").write_text("not a weight")
    assert weights_digest(copy) == source.digest
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        locate(str(tmp_path), "main")
