"""The operator and the server agree, checked one against the other running for real.

For EmbeddingService specs drawn over the CRD's range (`support.crd_specs`: every field that
reaches a server flag, its bounds read from the CRD itself), the operator builds its pod; the
server parses that pod's arguments with its own `parse_config` and builds its app, whose `/ready`
report lists the plan it will warm. Every spec within the CRD must start a server, the server
must run with every setting the warm gate reads from the pod, and the plan the gate expects
from the pod must be the plan that server reports: in process, and over HTTP from real server
processes. With the devcluster, the real apiserver judges (a server-side dry run: the CEL rules
judge each spec, as `kubectl apply` would) and defaults the specs first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.crd_specs import (
    CONSTRAINED,
    SAMPLE_STRINGS,
    free_field_values,
    pattern_ok,
    schema_fields,
    server_fields,
    specs,
    undrawable,
    written_flags,
)

from warmgate_contract.flags import FLAGS, read_args
from warmgate_contract.flags import settings as flag_settings
from warmgate_contract.names import GROUP, PLURAL, VERSION
from warmgate_contract.shapes import Shape
from warmgate_operator import gate
from warmgate_operator.builders import LEFT_OUT_AT_DEFAULT, Owner, build_pod_template
from warmgate_operator.spec import SpecError, parse_spec
from warmgate_server.app import create_app
from warmgate_server.config import ConfigError, parse_config
from warmgate_server.context import RUNTIME
from warmgate_testkit.process import ServerProcess, minilm_path

OWNER = Owner(name="agree", namespace="default", uid="00000000-0000-4000-8000-000000000001")


def server_pod(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod spec the operator builds for `spec`, and its server container."""
    template = build_pod_template(parse_spec(spec), OWNER, "img")
    (container,) = template["spec"]["containers"]
    return {"spec": template["spec"], "container": container}


def check_agreement(spec: dict[str, Any]) -> None:
    """The server starts from the operator's pod and plans what the gate expects of it."""
    args: list[str] = []
    try:
        pod = server_pod(spec)
        args = pod["container"]["args"]
        # The server reads exactly what the operator wrote, or refuses to start.
        config = parse_config(args, environ={})
    except (SpecError, ConfigError) as error:
        side = "operator" if isinstance(error, SpecError) else "server"
        pytest.fail(
            f"the {side} refuses a spec within the CRD: {error}\nspec: {spec}\nargs: {args}\n"
            "Either the CRD lacks a rule the operator and server have, or support.crd_specs "
            "draws what the CRD refuses (the apiserver test tells which)."
        )
    # The gate judges a pod by the settings it reads from the pod: the server's own.
    read = flag_settings(read_args(args))
    differ = {
        flag.dest: (read[flag.dest], getattr(config, flag.dest))
        for flag in FLAGS
        if read[flag.dest] != getattr(config, flag.dest)
    }
    assert not differ, (differ, args)
    report = create_app(config)[RUNTIME].lifecycle.report()
    expected = gate.expectation_for({"spec": pod["spec"]})
    assert expected is not None, args
    assert expected.required_shapes == {Shape.from_json(s) for s in report["planned_shapes"]}, args
    model = report["model"]
    assert (expected.model_id, expected.revision) == (model["id"], model["revision"]), args


def test_a_flag_left_out_is_its_default_to_the_server_itself() -> None:
    """What `render_args` leaves out at a flag's default (the operator's LEFT_OUT_AT_DEFAULT)
    the server's own parser reads as that default: its configuration is the same either way."""
    without = parse_config(["--model=m"], environ={})
    for flag in FLAGS:
        if flag.default is None:
            continue
        assert getattr(without, flag.dest) == flag.default, flag.name
        assert parse_config(["--model=m", flag.render(flag.default)], environ={}) == without
    assert set(LEFT_OUT_AT_DEFAULT) <= {flag.dest for flag in FLAGS if flag.default is not None}


# ------------------------------------------------------------------ the drawn specs
def test_every_crd_field_that_reaches_a_server_flag_is_drawn() -> None:
    found = server_fields()
    # Fields known to reach the server: the search must find them (a search that went blind
    # would leave them undrawn); specs() draws whatever it finds.
    assert {
        "model.id", "model.revision", "model.servedName", "model.pooling", "model.normalize",
        "model.maxInputLength", "model.autoTruncate", "model.openaiTokenIds",
        "model.trustRemoteCode",
        "model.source.volume", "model.source.volume.path", "model.source.volume.layout",
        "model.source.image", "model.source.image.path", "model.source.baked.path",
        "model.volume", "model.volume.path", "model.volume.layout",
        "runtime.device", "runtime.dtype",
        "batching.maxBatchSize", "batching.maxBatchTokens", "batching.maxWaitMilliseconds",
        "batching.maxClientBatchSize", "batching.maxConcurrentRequests",
        "batching.payloadLimitBytes", "batching.padBatch", "batching.requestTimeoutSeconds",
        "batching.bodyTimeoutSeconds",
        "warmup.enabled", "warmup.batchSizes", "warmup.sequenceBuckets",
        "rollout.drainSeconds",
        "probes.forwardTimeoutSeconds", "probes.faultThreshold", "probes.faultRestartSeconds",
    } <= found  # fmt: skip
    # Pod settings, not the server's: their values never reach its command line.
    assert not {"replicas", "probes.periodSeconds", "model.source.volume.claimName"} & found
    assert found >= CONSTRAINED
    assert undrawable() == [], "add valid values for these to SAMPLE_STRINGS"


def test_the_strings_drawn_are_ones_the_crd_accepts() -> None:
    fields = set(schema_fields())
    for path, values in SAMPLE_STRINGS.items():
        assert path in fields, f"{path} is not a CRD field"
        for value in values:
            assert pattern_ok(path, value), (path, value)


def test_every_server_flag_is_set_from_the_spec_or_left_to_the_server() -> None:
    """A new server flag is either written by the operator from a spec field or named here as
    the server's own choice (a user cannot set it through an EmbeddingService)."""
    written = written_flags()
    left_to_the_server = {
        "host",  # the pod IP, from WARMGATE_HOST
        "model_workers", "torch_threads",  # from the CPUs the pod may use
        # The server's own settings: kept at their defaults in a pod (fault injection by the
        # twin a spec's env may set, for chaos drills).
        "linear", "log_level", "termination_log", "runtime_memory", "fault_injection",
    }  # fmt: skip
    assert written | left_to_the_server == {flag.dest for flag in FLAGS}
    assert not written & left_to_the_server


@settings(max_examples=300, deadline=None)
@given(spec=specs())
def test_every_spec_within_the_crd_starts_a_server_that_plans_what_the_gate_expects(
    spec: dict[str, Any],
) -> None:
    check_agreement(spec)


# ------------------------------------------------------------------ real server processes
LOCAL_INPUT_LIMIT = 512
"""all-MiniLM-L6-v2's positions: a longer input limit is the model's to refuse, not the CRD's."""


def for_this_machine(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` as a server on this machine can run it: the model from a Hugging Face cache
    (the hub source), the CPU, an input limit within MiniLM's positions, and no warmup (the
    plan may hold shapes of a million tokens, more than this machine's memory)."""
    model = spec["model"]
    model.pop("source", None)
    model.pop("volume", None)
    model.pop("defaultPromptName", None)  # MiniLM has no prompts of its own to name
    if model.get("task") in ("rerank", "classify"):  # MiniLM embeds: the model's to refuse
        model["task"] = "embed"
    largest_bucket = spec["warmup"]["sequenceBuckets"][-1]
    limit = model.get("maxInputLength", LOCAL_INPUT_LIMIT)
    model["maxInputLength"] = min(limit, LOCAL_INPUT_LIMIT, largest_bucket)
    runtime = spec.setdefault("runtime", {})
    runtime["device"] = "cpu"
    if runtime.get("dtype") == "float16":
        runtime["dtype"] = "float32"
    if runtime.get("cudaGraphs") == "on":
        del runtime["cudaGraphs"]
    spec.setdefault("warmup", {})["enabled"] = False
    return spec


def hub_cache(home: Path, model_id: str, revision: str) -> Path:
    """A Hugging Face cache (HF_HOME) holding MiniLM's files as `model_id` at `revision`."""
    repo = home / "hub" / ("models--" + model_id.replace("/", "--"))
    is_commit = re.fullmatch(r"[0-9a-f]{40}", revision) is not None
    commit = revision if is_commit else "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for item in minilm_path().iterdir():
        if not (snapshot / item.name).exists():
            (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir(exist_ok=True)
    if not is_commit:
        (repo / "refs" / revision).write_text(commit)
    return home


@pytest.mark.slow
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(spec=specs().map(for_this_machine))
def test_a_real_server_reports_over_http_the_plan_and_settings_the_operator_asked_for(
    spec: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    pod = server_pod(spec)
    typed = parse_spec(spec)
    home = hub_cache(tmp_path_factory.mktemp("hf"), typed.model.id, typed.model.revision)
    # The pod's own arguments; only the port is this machine's (any free one).
    args = [arg for arg in pod["container"]["args"] if not arg.startswith("--port=")]
    expected = gate.expectation_for({"spec": pod["spec"]})
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(args, env={"HF_HOME": str(home)}, log_path=log) as server:
        report = server.wait_ready(180)
        status, info = server.get_json("/info")
    assert status == 200
    assert {Shape.from_json(item) for item in report["planned_shapes"]} == expected.required_shapes
    assert (report["model"]["id"], report["model"]["revision"]) == (
        expected.model_id,
        expected.revision,
    )
    served = typed.model.served_name or typed.model.id.split("/")[-1]
    assert report["model"]["served_name"] == info["served_model_name"] == served
    batching = typed.batching
    assert {
        "max_batch_tokens": info["max_batch_tokens"],
        "max_batch_requests": info["max_batch_requests"],
        "max_client_batch_size": info["max_client_batch_size"],
        "max_concurrent_requests": info["max_concurrent_requests"],
        "pad_batch": info["pad_batch"],
        "sequence_buckets": tuple(info["sequence_buckets"]),
        "auto_truncate": info["auto_truncate"],
        "openai_token_ids": info["openai_token_ids"],
        "max_input_length": info["max_input_length"],
    } == {
        "max_batch_tokens": batching.max_batch_tokens,
        "max_batch_requests": batching.max_batch_size,
        "max_client_batch_size": batching.max_client_batch_size,
        "max_concurrent_requests": batching.max_concurrent_requests,
        "pad_batch": batching.pad_batch,
        "sequence_buckets": typed.warmup.sequence_buckets,
        "auto_truncate": typed.model.auto_truncate,
        "openai_token_ids": typed.model.openai_token_ids,
        "max_input_length": typed.model.max_input_length,
    }


# ------------------------------------------------------------------ the real apiserver
@pytest.fixture(scope="module")
def custom(devcluster: Any) -> client.CustomObjectsApi:
    from warmgate_devcluster.testkit import install_crd

    install_crd(devcluster)
    return client.CustomObjectsApi(devcluster.api_client())


def admitted(custom: client.CustomObjectsApi, spec: dict[str, Any]) -> tuple[dict | None, str]:
    """What the apiserver would store (defaults applied), or None and why it refuses."""
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "EmbeddingService",
        "metadata": {"name": "agree", "namespace": "default"},
        "spec": spec,
    }
    try:
        stored = custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, body, dry_run="All"
        )
    except ApiException as error:
        if error.status == 422:
            return None, str(error.body)
        raise
    return stored, ""


def loosened(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = spec
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return spec


FREE = free_field_values()
one_free_field = st.sampled_from(sorted(FREE)).flatmap(
    lambda path: st.tuples(st.just(path), FREE[path])
)


@pytest.mark.cluster
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(spec=specs(), free=one_free_field)
def test_the_apiserver_admits_every_drawn_spec_and_each_spec_it_admits_starts_a_server(
    custom: client.CustomObjectsApi, spec: dict[str, Any], free: tuple[str, Any]
) -> None:
    stored, refusal = admitted(custom, spec)
    assert stored is not None, f"specs() drew a spec the CRD refuses: {refusal}"
    check_agreement(stored["spec"])
    # One field the CRD's cross-field rules tie to others, anywhere in its own range: the
    # apiserver judges, and whatever it admits must still start a server.
    stored, _ = admitted(custom, loosened(spec, *free))
    if stored is not None:
        check_agreement(stored["spec"])


@pytest.mark.cluster
@pytest.mark.slow
def test_a_real_server_passes_the_gate_built_from_the_operators_own_pod(
    custom: client.CustomObjectsApi, tmp_path: Path
) -> None:
    spec = {
        "model": {"id": "sentence-transformers/all-MiniLM-L6-v2", "revision": "r7"},
        "batching": {"maxBatchSize": 4, "maxBatchTokens": 128},
        "warmup": {"batchSizes": [1, 4], "sequenceBuckets": [16, 32]},
    }
    stored, refusal = admitted(custom, spec)
    assert stored is not None, refusal
    pod = server_pod(stored["spec"])
    home = hub_cache(tmp_path / "hf", "sentence-transformers/all-MiniLM-L6-v2", "r7")
    args = [arg for arg in pod["container"]["args"] if not arg.startswith("--port=")]
    expected = gate.expectation_for({"spec": pod["spec"]})
    assert expected is not None
    with ServerProcess(args, env={"HF_HOME": str(home)}, log_path=tmp_path / "log") as server:
        report = server.wait_ready(300)
    verdict = gate.evaluate_report(report, expected)
    assert verdict.passed, (verdict.message, json.dumps(report)[:2000])
