"""Warmup that fits the pod's memory (memory.py, warming.py): the limit read from the cgroup as
a container sees it, the prediction of each shape's peak from the smaller ones, and real server
processes, the real model, under a real cgroup v1 memory limit made here (the kernel kills a
process past it, as in a container): refuse fails before the shape that would not fit and stays
up, fit serves the shapes that fit and its batcher forms no other."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from warmgate_contract.names import REASON_MEMORY_EXCEEDED
from warmgate_contract.shapes import Shape
from warmgate_devcluster import cgroups
from warmgate_server.memory import (
    CODE_PAGES,
    Cgroup,
    ProcessProbe,
    anonymous_bytes,
    mapped_bytes,
    model_files,
)
from warmgate_server.memory_prediction import (
    ACTIVATION_FACTOR,
    ACTIVATION_SLACK,
    PassModel,
    predict,
    warm_order,
)
from warmgate_testkit.process import ServerProcess, minilm_path

MiB = 2**20
BIG_PLAN = [
    "--sequence-buckets", "32,64,128,256,512", "--warmup-batch-sizes", "1,8,32",
    "--max-batch-tokens", "16384", "--max-batch-size", "32",
]  # fmt: skip
"""15 shapes up to 32 x 512: about 0.65 GiB for the loaded model, 1.3 GiB at its peak here."""


# ------------------------------------------------------------------------- the limit
def fake_cgroup_files(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc)
    return tmp_path / "root", tmp_path / "self-cgroup"


def test_the_limit_is_read_from_cgroup_v1_or_v2_where_the_process_sees_it(tmp_path) -> None:
    # A process on a host: its cgroup's path under the v1 memory hierarchy.
    root, proc = fake_cgroup_files(
        tmp_path / "host",
        "12:memory:/pods/p1\n11:cpu,cpuacct:/pods/p1\n",
        {
            "root/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "root/memory/pods/p1/memory.limit_in_bytes": "314572800\n",
            "root/memory/pods/p1/memory.usage_in_bytes": "1000\n",
            "root/memory/pods/p1/memory.max_usage_in_bytes": "2000\n",
        },
    )
    group = Cgroup.find(root, proc)
    assert group is not None and group.limit().bytes == 300 * MiB
    assert group.limit().source == "cgroup v1 memory.limit_in_bytes"
    assert (group.usage(), group.peak()) == (1000, 2000)
    # A container: its own cgroup mounted at the root (the path in /proc is the host's).
    root, proc = fake_cgroup_files(
        tmp_path / "container",
        "0::/kubepods/pod1/c1\n",
        {"root/memory.max": "629145600\n", "root/memory.current": "5\n", "root/memory.peak": "7"},
    )
    group = Cgroup.find(root, proc)
    assert group is not None and group.limit().bytes == 600 * MiB
    assert (group.version, group.usage(), group.peak()) == (2, 5, 7)
    # No limit at all.
    root, proc = fake_cgroup_files(tmp_path / "free", "0::/\n", {"root/memory.max": "max\n"})
    assert Cgroup.find(root, proc).limit().bytes is None  # type: ignore[union-attr]


# ------------------------------------------------------------------------- the prediction
MINILM = PassModel(hidden=384, intermediate=1536, dtype_bytes=4, workers=2)


def test_shapes_warm_smallest_first_and_each_is_predicted_from_a_model_of_the_pass() -> None:
    plan = [Shape(32, 128), Shape(1, 32), Shape(8, 512), Shape(8, 64), Shape(1, 64)]
    assert warm_order(plan) == [
        Shape(1, 32),
        Shape(1, 64),
        Shape(8, 64),
        Shape(32, 128),  # of equal tokens, the bigger batch first: it measured larger
        Shape(8, 512),
    ]
    # MiniLM's MLP: 2 x (384 + 1536) floats a token, on two workers.
    assert MINILM.activation_bytes(Shape(8, 128)) == 2 * 4 * 1024 * 3840
    assert predict([], Shape(1, 32), MINILM) is None  # the loaded model is checked before it
    act = MINILM.activation_bytes
    measured = [(Shape(1, 32), 700 * MiB)]
    expected = 700 * MiB + ACTIVATION_FACTOR * (act(Shape(1, 64)) - act(Shape(1, 32)))
    assert predict(measured, Shape(1, 64), MINILM) == int(expected + ACTIVATION_SLACK)
    # The case: peaks that jump with the allocator, not with the shape. Two close
    # token counts 30 MiB apart made the old straight line predict 0.90 GiB for 8x128; the
    # model adds the growth of the shape's activations (a few MiB) to the largest need.
    measured = [(Shape(1, 32), 700 * MiB), (Shape(1, 64), 730 * MiB)]
    predicted = predict(measured, Shape(8, 128), MINILM)
    growth = act(Shape(8, 128)) - act(Shape(1, 64))
    assert predicted == int(730 * MiB + ACTIVATION_FACTOR * growth + ACTIVATION_SLACK)
    assert predicted < 850 * MiB  # the straight line: 0.90 GiB
    # The operator's default plan at its default 1536Mi limit (budget 1.35 GiB): 32x256 is
    # predicted from 32x128, the largest shape measured, not from the smallest one's need plus
    # the whole of its activations (which said 1.37 GiB; it needs about 1.1).
    measured = [(Shape(1, 32), 600 * MiB), (Shape(8, 256), 800 * MiB), (Shape(32, 128), 950 * MiB)]
    predicted = predict(measured, Shape(32, 256), MINILM)
    assert predicted == int(
        950 * MiB
        + ACTIVATION_FACTOR * (act(Shape(32, 256)) - act(Shape(32, 128)))
        + ACTIVATION_SLACK
    )
    assert predicted < 0.9 * 1536 * MiB
    # A shape no larger than one measured is predicted at the largest need, plus the slack.
    assert predict(measured, Shape(8, 32), MINILM) == 950 * MiB + ACTIVATION_SLACK


def test_the_pass_model_reads_each_familys_dimensions(tmp_path: Path) -> None:
    bert = {"hidden_size": 768, "intermediate_size": 3072}
    distilbert = {"model_type": "distilbert", "dim": 768, "hidden_dim": 3072}
    gemma = {"text_config": {"hidden_size": 768, "intermediate_size": 1152}}
    for config in (bert, distilbert):
        (tmp_path / "config.json").write_text(json.dumps(config))
        model = PassModel.of_folder(tmp_path, 2, workers=1)
        assert (model.hidden, model.intermediate, model.dtype_bytes) == (768, 3072, 2)
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    assert PassModel.of_folder(tmp_path, 4, workers=2).intermediate == 1152
    (tmp_path / "config.json").write_text("{}")  # nothing said: the loaded model's width
    assert PassModel.of_folder(tmp_path, 4, workers=1, hidden=384).intermediate == 4 * 384


# ------------------------------------------------------------------------- the measure
def test_mapped_file_pages_count_only_where_they_are_the_models(tmp_path: Path) -> None:
    """File pages are the kernel's to drop near the limit (a CUDA build of torch maps hundreds
    of MiB of libraries a CPU never runs), so reading a big file costs the need nothing; a
    model file the process maps counts in full."""
    import mmap

    import numpy as np

    model = tmp_path / "model"
    model.mkdir()
    blob = tmp_path / "blobs" / "3da0003"  # a hub cache: the snapshot links to its blob
    blob.parent.mkdir()
    blob.write_bytes(np.random.default_rng(0).bytes(64 * MiB))
    weights = model / "model.safetensors"
    weights.symlink_to(blob)
    other = tmp_path / "libsomething.so"
    other.write_bytes(np.random.default_rng(1).bytes(64 * MiB))
    probe = ProcessProbe(model_folder=model)
    before = probe.current()
    with open(weights, "rb") as w, open(other, "rb") as o:
        mapped = [mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) for f in (w, o)]
        try:
            probe.reset_peak()
            for view in mapped:
                assert sum(view[::4096]) > 0  # every page touched: resident
            need = probe.peak()
            assert mapped_bytes(model_files(model)) == 64 * MiB
            assert probe.working_file == CODE_PAGES + 64 * MiB
            # The other file is not counted: anonymous memory moved by noise only.
            assert abs(need - before - 64 * MiB) < 16 * MiB, (need - before) / MiB
        finally:
            for view in mapped:
                view.close()


def test_a_passing_peak_of_anonymous_memory_is_sampled() -> None:
    """An allocation freed before the peak is read (an activation of one layer) still counts."""
    import numpy as np

    probe = ProcessProbe(model_folder=None)
    probe.reset_peak()
    start = anonymous_bytes()
    block = np.ones(200 * MiB // 8)  # written: resident
    time.sleep(0.05)
    del block
    time.sleep(0.01)
    assert anonymous_bytes() - start < 100 * MiB  # returned to the system
    assert probe.peak() - CODE_PAGES - start > 190 * MiB


# ------------------------------------------------------------------------- real processes
def ready_report(server: ServerProcess, timeout: float = 600) -> dict:
    """The /ready report once the start has ended (/started 200), warm or failed."""
    server.wait_for_port(120)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process is not None and server.process.poll() is None, server.log()
        if get(server, "/started")[0] == 200:
            return get(server, "/ready")[1]
        time.sleep(0.5)
    raise AssertionError(f"not started in {timeout}s:\n{server.log()[-3000:]}")


def get(server: ServerProcess, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def unlimited() -> dict:
    """The big plan's /ready report with nothing limiting the process: every shape's peak."""
    with ServerProcess(["--model", str(minilm_path()), "--device", "cpu", *BIG_PLAN]) as server:
        report = ready_report(server)
    assert report["phase"] == "ready", report["error"]
    return report["memory"]


@pytest.mark.slow
def test_each_predicted_peak_is_within_its_stated_error_of_the_measured_one(
    unlimited: dict, report
) -> None:
    """The prediction errs high, never more than a few percent low: the 10% margin covers
    that (docs/server.md has the table). Within 7% over up to 32 x 256 here; 59% over at
    32 x 512, where the growth of the activations goes back to the system at once instead of
    staying in the allocator."""
    errors = []
    for item in unlimited["shapes"]:
        if item["predicted_bytes"] is not None:
            errors.append((item["predicted_bytes"] - item["peak_bytes"]) / item["peak_bytes"])
            label = f"{item['batch_size']}x{item['seq_len']}"
            report(
                f"{label}: peak {item['peak_bytes'] / MiB:.0f} MiB, predicted "
                f"{item['predicted_bytes'] / MiB:.0f} MiB ({errors[-1]:+.1%})"
            )
    assert len(errors) == len(unlimited["shapes"]) - 1  # all but the smallest
    assert min(errors) > -0.05 and max(errors) < 1.0, errors
    assert unlimited["limit_bytes"] is None and unlimited["cut"] is None


@pytest.fixture
def limited(unlimited: dict) -> Iterator[tuple[Path, int]]:
    """A fresh memory cgroup whose budget (its limit less 10%) lies halfway between the loaded
    model and the big plan's peak: the smaller half of the plan fits, the bigger does not."""
    budget = (unlimited["loaded_bytes"] + unlimited["peak_bytes"]) // 2
    limit = int(budget / 0.9)
    with cgroups.memory_limited(f"warmgate-test-{time.monotonic_ns()}", limit) as group:
        yield group, limit


def in_group(group: Path, policy: str) -> ServerProcess:
    args = ["--model", str(minilm_path()), "--device", "cpu", *BIG_PLAN, "--memory-policy", policy]
    return ServerProcess(args, prefix=cgroups.launch_in(group, []))


@pytest.mark.slow
def test_refuse_fails_before_the_shape_that_would_not_fit_and_stays_up(limited) -> None:
    group, limit = limited
    with in_group(group, "refuse") as server:
        report = ready_report(server)
        assert report["phase"] == "failed" and report["failure_reason"] == REASON_MEMORY_EXCEEDED
        error = report["error"]
        assert f"{limit / 2**30:.2f} GiB" in error and "cgroup v1 memory.limit_in_bytes" in error
        for field in ("batching.maxBatchTokens", "resources.limits.memory", "memoryPolicy: fit"):
            assert field in error, error
        # Up, answering, out of rotation: nothing for kubelet to restart.
        time.sleep(2)
        assert server.process is not None and server.process.poll() is None
        assert get(server, "/healthz")[0] == 200 and get(server, "/started")[0] == 200
        assert get(server, "/ready")[0] == 503
        assert report["memory"]["peak_bytes"] <= report["memory"]["budget_bytes"]
    assert cgroups.oom_kills(group) == 0


@pytest.mark.slow
def test_fit_serves_the_shapes_that_fit_and_its_batcher_forms_no_other(limited) -> None:
    group, _ = limited
    with in_group(group, "fit") as server:
        report = ready_report(server)
        assert report["phase"] == "ready", report["error"]
        cut = report["memory"]["cut"]
        assert cut is not None and cut["shapes"], report["memory"]
        kept = {(s["batch_size"], s["seq_len"]) for s in report["planned_shapes"]}
        assert kept == {(s["batch_size"], s["seq_len"]) for s in report["warmed_shapes"]}
        assert all(b * s <= cut["max_batch_tokens"] for b, s in kept)
        assert not kept & {(s["batch_size"], s["seq_len"]) for s in cut["shapes"]}
        # The largest requests there are, from several clients at once: 32 inputs each as
        # long as the model takes (MiniLM: 256 tokens), batched within the cut budget.
        text = "warm gate " * 300  # truncated to the model's limit
        body = json.dumps({"inputs": [text] * 32, "truncate": True}).encode()

        def send(_: int) -> int:
            request = urllib.request.Request(
                server.url + "/embed", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                response.read()
                return response.status

        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(send, range(12))) == {200}
        _, profile = get(server, "/warmup/profile")
        served = {(s["batch_size"], s["seq_len"]) for s in profile["shapes"]}
        longest = max(seq_len for _, seq_len in served)
        widest = max(batch for batch, seq_len in kept if seq_len == longest)
        assert served <= kept and (widest, longest) in served, (served, kept)
        assert server.process is not None and server.process.poll() is None
    assert cgroups.oom_kills(group) == 0


# ------------------------------------------------------------------------- before loading
def test_a_limit_below_what_loading_takes_is_refused_with_the_image_measurement(
    tmp_path: Path,
) -> None:
    from warmgate_server.errors import MemoryExceeded
    from warmgate_server.memory import Limit
    from warmgate_server.preflight import check_loading_fits, loading_need

    runtime = tmp_path / "runtime-memory.json"
    runtime.write_text(json.dumps({"resident_bytes": 560 * MiB, "torch": "2.15.0"}))
    assert loading_need(90 * MiB, runtime) is not None
    assert loading_need(90 * MiB, tmp_path / "absent.json") is None  # not in its image
    with pytest.raises(MemoryExceeded) as refused:
        check_loading_fits(Limit(300 * MiB, "cgroup v1 memory.limit_in_bytes"), 90 * MiB, runtime)
    message = str(refused.value)
    assert "loading needs about 0.63 GiB" in message and "0.29 GiB" in message, message
    assert "raise resources.limits.memory" in message
    check_loading_fits(Limit(1 << 30, "cgroup v1 memory.limit_in_bytes"), 90 * MiB, runtime)
    check_loading_fits(Limit(None, "no limit"), 90 * MiB, runtime)


@pytest.mark.slow
def test_a_process_under_a_limit_too_small_to_load_says_so_and_stays_up(tmp_path: Path) -> None:
    """300 MiB, the issue's example: below what importing this torch alone takes here. The
    measurement is made as the image's build makes it (python -m warmgate_server.preflight)."""
    runtime = tmp_path / "runtime-memory.json"
    subprocess.run([sys.executable, "-m", "warmgate_server.preflight", str(runtime)], check=True)
    args = ["--model", str(minilm_path()), "--device", "cpu"]
    with cgroups.memory_limited(f"warmgate-test-{time.monotonic_ns()}", 300 * MiB) as group:
        env = {"WARMGATE_RUNTIME_MEMORY": str(runtime)}
        with ServerProcess(args, env=env, prefix=cgroups.launch_in(group, [])) as server:
            report = ready_report(server, timeout=120)
            assert report["phase"] == "failed", report
            assert report["failure_reason"] == REASON_MEMORY_EXCEEDED
            assert "loading needs about" in report["error"], report["error"]
            time.sleep(1)
            assert server.process is not None and server.process.poll() is None
            assert get(server, "/healthz")[0] == 200
        assert cgroups.oom_kills(group) == 0


@pytest.mark.slow
def test_an_onnx_export_that_would_pass_the_limit_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    """--backend onnxruntime exports the model at the start of the warmup, which takes about
    4x the weights on top of what the process holds. Under a real cgroup limit that holds the
    loaded model but not the export's peak, the server refuses with the numbers before
    exporting (no OOM kill, no restart into the same end); under one that holds it, the export
    runs and the server turns ready, the container's peak within the limit. The export it
    stored in its --compile-cache then lets the same server start under the lower limit: a
    cache hit has no export peak."""
    args = ["--model", str(minilm_path()), "--device", "cpu", "--backend", "onnxruntime",
            "--sequence-buckets", "16,32", "--warmup-batch-sizes", "1,4"]  # fmt: skip
    cache = ["--compile-cache", str(tmp_path / "compiled")]
    # The lower limit comes from what this machine's process holds once loaded (its torch and
    # libraries' resident pages differ from one CPU and build to another): 64 MiB above it
    # after the 10% margin, which holds a cache hit's warmup but not the export's peak (about
    # 4.5x MiniLM's 0.09 GiB of weights above what is held).
    runs: list[tuple[int | None, list[str], bool]] = [
        (2048 * MiB, cache, True),
        (None, [], False),
        (None, cache, True),
    ]
    low = 0
    for limit, extra, ready in runs:
        limit = limit or low
        with cgroups.memory_limited(f"warmgate-test-{time.monotonic_ns()}", limit) as group:
            with ServerProcess(args + extra, prefix=cgroups.launch_in(group, [])) as server:
                report = ready_report(server)
                if ready:
                    assert report["phase"] == "ready", report["error"]
                    assert report["forward"]["backend"] == "onnxruntime"
                    state = report["forward"]["onnxruntime"]["cache"]
                    assert state == ("hit" if limit < 2048 * MiB else "miss"), report["forward"]
                    # The process's own peak (the container's counts reclaimable page cache).
                    assert report["memory"]["peak_bytes"] < limit, report["memory"]
                    if not low:
                        low = int((report["memory"]["loaded_bytes"] + 64 * MiB) / 0.9)
                        assert low < 2048 * MiB, report["memory"]
                else:
                    assert report["phase"] == "failed", report
                    assert report["failure_reason"] == REASON_MEMORY_EXCEEDED
                    error = report["error"]
                    assert "exporting the model to ONNX takes about" in error, error
                    assert "resources.limits.memory" in error, error
                    assert "runtime.backend torch" in error, error
                    assert "exported" not in server.log()
                    assert server.process is not None and server.process.poll() is None
            assert cgroups.oom_kills(group) == 0, (limit, server.log()[-2000:])


# ------------------------------------------------------------------------- the shipped examples
EXAMPLE_STARTS = 30
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULTS_NAME = "the operator's defaults"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _bge_small(folder: Path) -> Path:
    """A stand-in of examples/model-from-pvc.yaml's bge-small-en-v1.5 (no hub here): MiniLM's
    folder with bge-small's twelve layers of the same width, random weights."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    if (folder / "model.safetensors").is_file():
        return folder
    shutil.copytree(minilm_path(), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 12
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    BertModel(BertConfig(**config), add_pooling_layer=False).save_pretrained(folder)
    return folder


def _example_servers(scratch: Path) -> dict[tuple[str, ...], tuple[int, list[str]]]:
    """Each CPU example's server, as the operator starts it (its flags from the operator's own
    builder), under the memory limit of its manifest, with a local folder for its model:
    {flags: (limit, the examples that start it)}. Examples whose flags differ only in the
    model's names (minilm, model-baked, model-from-image: the same MiniLM, plan and limit)
    start the same process, so it is started once for all of them."""
    import yaml

    from warmgate_operator.apply import parse_quantity
    from warmgate_operator.builders import resources, server_args
    from warmgate_operator.spec import parse_spec

    servers: dict[tuple[str, ...], tuple[int, list[str]]] = {}
    # A user's first manifest names a model and nothing else: the operator's default plan
    # (1, 8, 32 x 32 to 256) under its default limit.
    defaults = {"kind": "EmbeddingService", "spec": {"model": {"id": MINILM_ID}}}
    documents = [(DEFAULTS_NAME, defaults)] + [
        (manifest.name, document)
        for manifest in sorted(EXAMPLES.glob("*.yaml"))
        for document in yaml.safe_load_all(manifest.read_text())
    ]
    for name, document in documents:
        if not document or document.get("kind") != "EmbeddingService":
            continue
        spec = parse_spec(document["spec"])
        if spec.runtime.device != "cpu":
            continue  # the GPU example needs a GPU
        limit = int(parse_quantity(resources(spec)["limits"]["memory"]))
        model = minilm_path() if "MiniLM" in spec.model.id else _bge_small(scratch)
        flags = [
            arg
            for arg in server_args(spec)
            # Pacing (--warmup-cpus) changes when the warmup's passes run, not what they hold:
            # left out, so that two starts at once (each the other's busy neighbour) are not
            # held to the examples' 100m each.
            if not arg.startswith(
                ("--model=", "--port=", "--warmup-profile=", "--served-model-name=")
            )
            and not arg.startswith(("--model-revision=", "--warmup-cpus="))
        ]
        key = (f"--model={model}", *flags)
        servers.setdefault(key, (limit, []))[1].append(name)
    return servers


@pytest.mark.slow
def test_every_shipped_example_starts_30_times_within_its_limit_never_refused_or_killed(
    tmp_path: Path, report
) -> None:
    """The issue's false refusal: examples/minilm.yaml's 1 GiB pods were refused at 0.90 GiB
    "needed" while other processes loaded the cores, and a manifest of a model id alone (the
    operator's default plan and 1536Mi limit) at 32x256, "about 1.37 GiB" of a 1.35 GiB
    budget, where it needs 1.1-1.2. Each CPU example's server (and the defaults') starts 30
    times, two at once (both cores busy, as in a rollout), each in a fresh memory cgroup of
    its manifest's limit: every start turns ready with its whole plan, none is refused, and
    the kernel kills none."""
    servers = _example_servers(tmp_path / "bge-small")
    assert {name for _, names in servers.values() for name in names} >= {
        "minilm.yaml", "model-baked.yaml", "model-from-image.yaml", "model-from-pvc.yaml",
        DEFAULTS_NAME,
    }  # fmt: skip

    def start(key: tuple[str, ...], limit: int, run: int) -> dict:
        name = f"warmgate-example-{run}-{time.monotonic_ns()}"
        with cgroups.memory_limited(name, limit) as group:
            with ServerProcess(list(key), prefix=cgroups.launch_in(group, [])) as server:
                ready = ready_report(server)
            return {"report": ready, "oom_kills": cgroups.oom_kills(group), "log": server.log()}

    for key, (limit, names) in servers.items():
        with ThreadPoolExecutor(2) as pool:
            runs = range(EXAMPLE_STARTS)
            starts = list(pool.map(start, [key] * len(runs), [limit] * len(runs), runs))
        refused = [s["report"]["error"] for s in starts if s["report"]["phase"] != "ready"]
        killed = sum(s["oom_kills"] for s in starts)
        needs = [s["report"]["memory"]["peak_bytes"] for s in starts]
        budget = starts[0]["report"]["memory"]["budget_bytes"]
        report(
            f"{', '.join(names)} ({limit / 2**30:.2f} GiB): {len(starts)} starts, "
            f"{len(refused)} refused, {killed} killed; need {min(needs) / MiB:.0f}-"
            f"{max(needs) / MiB:.0f} MiB of a {budget / MiB:.0f} MiB budget"
        )
        assert not refused and killed == 0, (refused[:2], killed)
        planned = {len(s["report"]["planned_shapes"]) for s in starts}
        warmed = {len(s["report"]["warmed_shapes"]) for s in starts}
        assert planned == warmed and len(planned) == 1, (planned, warmed)
