"""CUDA graphs for the warmed plan (graphs.py), checked on the CPU.

No GPU is here, so a CUDA graph cannot be captured: these tests stand `graphs.replay_eagerly`
in for `graphs.cuda_capture` (the same static buffers and output; a replay runs the captured
function again on them). Everything but the capture itself is real: the static pass a graph
captures (`PackedBert.dense`) against sentence-transformers, buffer reuse between batches of
different sizes, which shapes a graph serves, cold counting, the fallback when a capture fails,
and the settings. bench/server/gpu_bench.sh runs the real capture on a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from support.server import QUICK_SETTLE, dense_pooled, padded_batch, pooled

from warmgate_contract.report import WARMING
from warmgate_contract.shapes import Shape
from warmgate_server.backends import graph_forward
from warmgate_server.backends.graphs import GraphCaptureError, GraphSet, replay_eagerly
from warmgate_server.config import ConfigError, parse_config
from warmgate_server.head import Head
from warmgate_server.lifecycle import Lifecycle
from warmgate_server.loading import LoadedModel, load_model
from warmgate_server.memory import ProcessProbe
from warmgate_server.metrics import Metrics
from warmgate_server.models.bert import PackedBert
from warmgate_server.runner import ModelRunner
from warmgate_server.warming import Warmup
from warmgate_server.workers import Workers

TEXTS = [
    "hi",
    "A man is eating food.",
    "The new movie is awesome and everyone should see it at least once this week.",
    "Kubernetes readiness gates keep a pod out of the endpoints until a custom condition "
    "turns true, which lets an operator verify that every shape of the model is warm.",
]


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 0.99999), (torch.bfloat16, 0.995)]
)
def test_the_static_pass_a_graph_captures_equals_sentence_transformers(
    minilm_dir, loaded_minilm, sentence_transformer, dtype, tolerance
) -> None:
    """`PackedBert.dense` (padded, static shapes, pooled on the device) gives
    sentence-transformers' vectors at fp32 and bf16, with padding rows and padded tokens."""
    packed = PackedBert.from_folder(minilm_dir, dtype)
    tokenizer = loaded_minilm.tokenizer
    token_lists = tokenizer(TEXTS)["input_ids"]
    ids, mask = padded_batch(token_lists, 8, 64, loaded_minilm.pad_token_id, 101)
    with torch.inference_mode():
        vectors = dense_pooled(packed, ids, mask, "mean")[: len(TEXTS)].numpy()
    reference = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    assert _cosine(vectors, reference).min() >= tolerance


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_the_static_pass_pools_as_the_packed_pass(loaded_minilm, pooling: str) -> None:
    """mean, cls and last-token pooling of the static pass equal the padding-free pass's."""
    packed = loaded_minilm.packed
    token_lists = loaded_minilm.tokenizer(TEXTS)["input_ids"]
    ids, mask = padded_batch(token_lists, 4, 64, loaded_minilm.pad_token_id, 101)
    with torch.inference_mode():
        dense = dense_pooled(packed, ids, mask, pooling).numpy()
        packed_vectors = pooled(packed, token_lists, 64, 4, pooling).numpy()
    np.testing.assert_allclose(dense, packed_vectors, atol=2e-5, rtol=1e-4)


def _graph_set(loaded: LoadedModel, pooling: str = "mean", capture=replay_eagerly) -> GraphSet:
    return GraphSet(
        graph_forward(loaded, Head((pooling,), (), loaded.hidden_size, loaded.device)),
        loaded.device,
        loaded.pad_token_id,
        loaded.cls_token_id,
        capture=capture,
    )


def test_a_graph_reused_for_batches_of_every_size_keeps_nothing_of_the_last(
    loaded_minilm, sentence_transformer
) -> None:
    """One graph (static buffers) serves a full batch of long inputs, then one short input,
    then two: each result equals sentence-transformers', nothing left from an earlier batch."""
    graphs = _graph_set(loaded_minilm)
    shape = Shape(4, 64)
    graphs.capture(shape, worker=0)
    assert graphs.has(shape, 0) and not graphs.has(shape, 1) and not graphs.has(Shape(1, 64), 0)
    reference = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    token_lists = loaded_minilm.tokenizer(TEXTS)["input_ids"]
    for picked in ([3, 2, 1, 0], [0], [2, 0]):
        vectors = graphs.run([token_lists[index] for index in picked], shape, worker=0)
        assert vectors.shape == (len(picked), 384) and vectors.dtype == np.float32
        assert _cosine(vectors, reference[picked]).min() >= 0.99999
    assert graphs.stats.captured == 1


def test_the_transformers_forward_can_be_captured_too(loaded_minilm_padded) -> None:
    """A model warmgate has no own pass for: the graph runs transformers' forward and pools."""
    graphs = _graph_set(loaded_minilm_padded, pooling="cls")
    shape = Shape(2, 16)
    graphs.capture(shape, worker=0)
    tokens = loaded_minilm_padded.tokenizer(["a warm graph"])["input_ids"]
    runner = ModelRunner(loaded_minilm_padded, "cls", 64, packed=False)
    eager = runner.execute(tokens, shape).vectors
    np.testing.assert_allclose(graphs.run(tokens, shape, 0), eager, atol=1e-5, rtol=1e-4)


def test_planned_shapes_run_by_their_graph_and_others_eagerly_and_cold(loaded_minilm) -> None:
    """With graphs, a planned shape is served by its graph (warm once the graph ran); a shape
    without a graph runs the eager pass and is cold the first time, as is /embed_all's
    unpooled pass of a shape whose pooled pass has a graph."""
    runner = ModelRunner(loaded_minilm, "mean", 64)
    runner.graphs = _graph_set(loaded_minilm)
    planned, unplanned = Shape(2, 16), Shape(3, 16)
    runner.capture(planned, 0)
    tokens = runner.tokenize(["a warm graph", "and another"])
    first = runner.execute(tokens, planned)
    again = runner.execute(tokens, planned)
    assert first.first_time and not again.first_time  # warmup's first replay is the cold one
    eager = runner.execute(tokens, unplanned)
    assert eager.first_time and not runner.execute(tokens, unplanned).first_time
    np.testing.assert_allclose(first.vectors, eager.vectors, atol=2e-5, rtol=1e-4)
    states = runner.execute(tokens, planned, pool=False)
    assert states.first_time and [len(s) for s in states.vectors] == [len(t) for t in tokens]


def test_graph_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="--cuda-graphs on needs a CUDA device"):
        parse_config(["--model", "m", "--device", "cpu", "--cuda-graphs", "on"])
    with pytest.raises(ConfigError, match="--cuda-graphs 'yes': use one of auto, on, off"):
        parse_config(["--model", "m", "--cuda-graphs", "yes"])
    with pytest.raises(ConfigError, match="--tokenization-workers 0"):
        parse_config(["--model", "m", "--tokenization-workers", "0"])
    assert parse_config(["--model", "m"]).cuda_graphs == "auto"


PLAN = (Shape(1, 16), Shape(2, 16), Shape(1, 32))


@pytest.fixture
def make_workers(minilm_dir, loaded_minilm: LoadedModel) -> Iterator[Callable[..., Workers]]:
    """One model worker on the shared model, as an engine builds it for these flags."""
    threads: list[ThreadPoolExecutor] = []

    def make(*args: str) -> Workers:
        config = parse_config(["--model", str(minilm_dir), "--sequence-buckets", "16,32", *args])
        threads.append(ThreadPoolExecutor(1))
        runner = ModelRunner(loaded_minilm, "mean", 32)
        return Workers(config, loaded_minilm, runner, threads[-1:])

    yield make
    for thread in threads:
        thread.shutdown()


def _warm(workers: Workers, graphs_required: bool = False) -> Lifecycle:
    """Run the warmup of PLAN on `workers`; the lifecycle it filled in."""
    lifecycle = Lifecycle("m", "main", "m", "cpu", "float32", PLAN)
    lifecycle.enter(WARMING)
    warmup = Warmup(workers, PLAN, Metrics(), ProcessProbe(), graphs_required=graphs_required)
    asyncio.run(warmup.run(lifecycle, QUICK_SETTLE))
    return lifecycle


def _failing_capture(forward, ids, mask, pool_mask, pool):
    if ids.shape[1] == 32:
        raise RuntimeError("operation not permitted when stream is capturing")
    return replay_eagerly(forward, ids, mask, pool_mask, pool)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_capture_that_fails_serves_eagerly_or_fails_the_warmup(
    make_workers, loaded_minilm, mode: str
) -> None:
    """auto: the graphs already captured are dropped, every shape warms eagerly, /ready says
    why, and the planned shapes are served by the eager pass, warm; on: warmup fails with the
    reason. (A stand-in, the narrowest seam there is: on a CPU the workers build no GraphSet,
    which only a CUDA device gets, and no CUDA capture can fail here, so the test hands them
    a graph set of `replay_eagerly` whose third capture raises.)"""
    from warmgate_server.errors import ModelLoadError

    if mode == "on":  # --device auto that found no GPU: refused at start, never served eagerly
        with pytest.raises(ModelLoadError, match="--cuda-graphs on: the device is cpu"):
            make_workers("--cuda-graphs", "on")
    workers = make_workers()
    assert workers.forward_report()["cuda_graphs"] == {
        "mode": "off",
        "reason": "the device is cpu",
    }
    workers.runner.graphs = _graph_set(loaded_minilm, capture=_failing_capture)
    workers.graphs_mode, workers.graphs_reason = "on", ""
    if mode == "on":
        with pytest.raises(ModelLoadError, match=r"--cuda-graphs on: cannot capture .* 1x32"):
            _warm(workers, graphs_required=True)
        return
    lifecycle = _warm(workers)
    report = workers.forward_report()["cuda_graphs"]
    assert report["mode"] == "off" and "stream is capturing" in report["reason"]
    assert workers.runner.graphs is None
    assert set(lifecycle.warmed) == set(PLAN)
    shape = Shape(2, 16)  # its graph was captured, then dropped
    tokens = workers.runner.tokenize(["a warm graph", "and another"])
    served = asyncio.run(workers.execute(tokens, shape, 0))
    assert not served.first_time  # the warmup settled the eager pass, not the graph
    eager = ModelRunner(loaded_minilm, "mean", 32).execute(tokens, shape).vectors
    np.testing.assert_allclose(served.vectors, eager, atol=2e-5, rtol=1e-4)


def test_graphs_captured_during_warmup_serve_the_plan(make_workers, loaded_minilm) -> None:
    """Every planned shape gets its graph before any is settled; the report counts them."""
    workers = make_workers()
    graphs = workers.runner.graphs = _graph_set(loaded_minilm)
    workers.graphs_mode, workers.graphs_reason = "on", ""
    lifecycle = _warm(workers)
    report = workers.forward_report()["cuda_graphs"]
    assert report["mode"] == "on" and report["captured"] == len(PLAN)
    assert all(graphs.has(shape, 0) for shape in PLAN)
    assert set(lifecycle.warmed) == set(PLAN)


def test_capture_errors_name_the_shape(loaded_minilm) -> None:
    graphs = _graph_set(loaded_minilm, capture=_failing_capture)
    with pytest.raises(GraphCaptureError, match="shape 1x32: RuntimeError: operation not"):
        graphs.capture(Shape(1, 32), 0)
    assert not graphs.has(Shape(1, 32), 0)


def test_the_cpu_loader_still_picks_the_packed_pass(minilm_dir) -> None:
    loaded = load_model(parse_config(["--model", str(minilm_dir), "--device", "cpu"]))
    assert loaded.packed is not None and loaded.packed.varlen is None


def test_a_graph_leaves_a_prompt_out_of_pooling_as_the_packed_pass_does(loaded_minilm) -> None:
    """Inputs whose first tokens pooling leaves out (a prompt, include_prompt: false) get the
    same vectors from a graph's static pooling mask as from the padding-free pass, and not
    the vectors of their whole inputs."""
    from warmgate_server.pre import TokenIds

    shape = Shape(4, 32)
    graphs = _graph_set(loaded_minilm)
    graphs.capture(shape, worker=0)
    runner = ModelRunner(loaded_minilm, "mean", 64)
    whole = runner.tokenize(["query: a warm graph", "query: and another, longer one"])
    prompted = [TokenIds(ids, 4) for ids in whole]  # [CLS] query : ... stays out
    by_graph = graphs.run(prompted, shape, 0).copy()  # the CPU stand-in reuses its output
    packed = runner.execute(prompted, shape).vectors
    np.testing.assert_allclose(by_graph, packed, atol=2e-5, rtol=1e-4)
    assert _cosine(by_graph, graphs.run(whole, shape, 0)).max() < 0.999
