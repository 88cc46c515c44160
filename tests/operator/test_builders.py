"""The pure builders: the objects an EmbeddingService turns into."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from warmgate_operator import builders
from warmgate_operator.builders import Owner, build_children
from warmgate_operator.config import DEFAULT_SERVER_IMAGE
from warmgate_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
OWNER = Owner(name="minilm", namespace="default", uid="0c5e3a8e-1111-4222-8333-944455556666")
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def example_spec(**overrides: Any) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())["spec"]
    for path, value in overrides.items():
        node = raw
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


def children(**overrides: Any) -> builders.DesiredChildren:
    return build_children(parse_spec(example_spec(**overrides)), OWNER, DEFAULT_SERVER_IMAGE)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    return server


def check_golden(name: str, obj: dict[str, Any]) -> None:
    path = GOLDEN / name
    text = yaml.safe_dump(obj, sort_keys=False, width=100)
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{name} is missing; UPDATE_GOLDEN=1 writes it"
    assert yaml.safe_load(path.read_text()) == obj, f"{name} differs; UPDATE_GOLDEN=1 rewrites it"


def test_a_standby_pool_adds_pods_and_the_service_selects_serving_ones() -> None:
    plain = children()
    assert "warmgate.dev/role" not in plain.service["spec"]["selector"]
    pooled = children(standbyReplicas=1)
    assert pooled.deployment["spec"]["replicas"] == 3
    assert pooled.service["spec"]["selector"]["warmgate.dev/role"] == "serving"
    # The pods' template carries no role: the operator gives each Ready pod its own.
    labels = pooled.deployment["spec"]["template"]["metadata"]["labels"]
    assert "warmgate.dev/role" not in labels
    assert pooled.deployment["spec"]["selector"] == plain.deployment["spec"]["selector"]
    autoscaled = children(
        standbyReplicas=2,
        **{"autoscaling.enabled": True, "autoscaling.minReplicas": 3, "replicas": 1},
    )
    assert autoscaled.deployment["spec"]["replicas"] == 5


def test_deployment_matches_golden_file() -> None:
    check_golden("deployment-minilm.yaml", children().deployment)


def test_autoscaled_children_match_golden_file() -> None:
    desired = children(
        **{
            "autoscaling.enabled": True,
            "autoscaling.minReplicas": 2,
            "autoscaling.maxReplicas": 6,
            "autoscaling.targetCPUUtilizationPercentage": 60,
            "autoscaling.podsMetric": {"name": "warmgate_queue_depth", "averageValue": "8"},
            "autoscaling.scaleUp": {"stabilizationWindowSeconds": 0, "maxPodsPerPeriod": 2},
            "autoscaling.scaleDown": {"stabilizationWindowSeconds": 600, "maxPercentPerPeriod": 50},
        }
    )
    check_golden("hpa-minilm.yaml", desired.hpa)


def test_probes_split_liveness_readiness_and_startup() -> None:
    server = container(children().deployment)
    assert server["livenessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "http",
        "scheme": "HTTP",
    }
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    # 200 once the start has ended, warm or failed for good (a plan too big for the pod's
    # memory): such a pod then stays up, not Ready, instead of being restarted over and over.
    assert server["startupProbe"]["httpGet"]["path"] == "/started"
    # examples/minilm.yaml: startupTimeoutSeconds 300, periodSeconds 2 -> 150 tries of 2 s.
    assert server["startupProbe"]["periodSeconds"] == 2
    assert server["startupProbe"]["failureThreshold"] == 150
    assert server["readinessProbe"]["periodSeconds"] == 2


def test_startup_threshold_rounds_up() -> None:
    server = container(
        children(**{"probes.startupTimeoutSeconds": 601, "probes.periodSeconds": 5}).deployment
    )
    assert server["startupProbe"]["failureThreshold"] == 121


def test_warm_gate_adds_the_readiness_gate_and_can_be_turned_off() -> None:
    pod = children().deployment["spec"]["template"]["spec"]
    assert pod["readinessGates"] == [{"conditionType": "warmgate.dev/warmed"}]
    pod = children(**{"rollout.warmGate": False}).deployment["spec"]["template"]["spec"]
    assert "readinessGates" not in pod


def test_rolling_update_defaults_keep_full_capacity() -> None:
    raw = example_spec()
    del raw["rollout"]
    deployment = build_children(parse_spec(raw), OWNER, "img").deployment
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert deployment["spec"]["progressDeadlineSeconds"] == 300 + 600


def test_grace_period_outlasts_prestop_and_drain() -> None:
    deployment = children(**{"rollout.drainSeconds": 20}).deployment
    pod = deployment["spec"]["template"]["spec"]
    prestop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(prestop[1]) + 20
    assert "--drain-seconds=20" in container(deployment)["args"]


def test_restricted_security_context() -> None:
    deployment = children().deployment
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert isinstance(pod["securityContext"]["runAsUser"], int)
    assert server["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
    }
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert "emptyDir" in volumes[mounts["/var/cache/warmgate"]]
    assert pod["automountServiceAccountToken"] is False


def test_server_flags_follow_the_contract() -> None:
    args = container(children().deployment)["args"]
    assert args == [
        "--model=sentence-transformers/all-MiniLM-L6-v2",
        "--model-revision=main",
        "--port=8080",
        "--device=cpu",
        "--dtype=float32",
        "--max-input-length=128",
        "--max-batch-size=8",
        "--max-client-batch-size=2048",
        "--no-auto-truncate",
        "--openai-token-ids=cl100k_base",
        "--max-batch-tokens=1024",
        "--max-wait-ms=2",
        "--max-concurrent-requests=256",
        "--payload-limit=2000000",
        "--sequence-buckets=32,64,128",
        "--warmup-batch-sizes=1,8",
        "--warmup-profile=/etc/warmgate/profile/profile.json",
        "--pad-batch",
        "--warmup",
        "--drain-seconds=5",
        "--request-timeout=60",
        "--body-timeout=15",
        "--forward-timeout=30",
        "--fault-threshold=3",
        "--fault-restart-seconds=30",
        "--warm-state=/var/cache/warmgate/warm-state",
    ]


def test_pooling_and_normalize_are_passed_only_when_the_spec_sets_them() -> None:
    # Unset, the server follows the model folder's own configuration.
    args = container(children().deployment)["args"]
    assert not [a for a in args if a.startswith(("--pooling", "--normalize", "--no-normalize"))]
    args = container(children(**{"model.pooling": "cls", "model.normalize": False}).deployment)[
        "args"
    ]
    assert "--pooling=cls" in args and "--no-normalize" in args


def test_prompts_and_the_forward_pass_settings_reach_the_server() -> None:
    """Unset (auto, torch), packing, CUDA graphs and the backend are left to the server, so
    upgrading the operator rolls no pod; set, they and the prompt settings become flags the
    server reads."""
    args = container(children().deployment)["args"]
    assert not [
        a for a in args if a.startswith(("--packing", "--cuda-graphs", "--backend", "--default-"))
    ]
    args = container(
        children(
            **{
                "model.defaultPromptName": "query",
                "runtime.device": "cuda",
                "runtime.cudaGraphs": "on",
                "runtime.packing": "off",
                "runtime.tokenizationWorkers": 3,
            }
        ).deployment
    )["args"]
    for flag in (
        "--default-prompt-name=query",
        "--cuda-graphs=on",
        "--packing=off",
        "--tokenization-workers=3",
    ):
        assert flag in args
    args = container(children(**{"model.defaultPrompt": "query: "}).deployment)["args"]
    assert "--default-prompt=query: " in args
    onnx = container(children(**{"runtime.backend": "onnxruntime"}).deployment)
    assert "--backend=onnxruntime" in onnx["args"]
    # The export is kept in the pod's cache emptyDir, which a restarted container keeps.
    assert "--compile-cache=/var/cache/warmgate/compiled" in onnx["args"]
    cache = next(item for item in onnx["volumeMounts"] if item["name"] == "cache")
    assert "/var/cache/warmgate/compiled".startswith(cache["mountPath"] + "/")
    assert not any(
        arg.startswith("--compile-cache") for arg in container(children().deployment)["args"]
    )


def test_bind_address_and_pod_name_come_from_the_downward_api() -> None:
    env = {e["name"]: e for e in container(children().deployment)["env"]}
    assert env["WARMGATE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container(children().deployment)["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"}
    ]


def test_the_pull_policy_is_the_services_own_else_the_operators() -> None:
    """An EmbeddingService's imagePullPolicy wins; without one, the operator's
    --server-image-pull-policy decides (IfNotPresent unless configured)."""
    unset = parse_spec(example_spec())
    assert unset.image_pull_policy is None

    def policy(spec: Any, **operator: Any) -> str:
        return container(build_children(spec, OWNER, "img", **operator).deployment)[
            "imagePullPolicy"
        ]

    assert policy(unset) == "IfNotPresent"
    assert policy(unset, default_pull_policy="Never") == "Never"
    own = parse_spec(example_spec(imagePullPolicy="Always"))
    assert policy(own, default_pull_policy="Never") == "Always"


def pull_secret_template(*secrets: str) -> dict[str, Any]:
    spec = parse_spec(example_spec())
    return build_children(spec, OWNER, "img", image_pull_secrets=secrets).deployment["spec"][
        "template"
    ]


def test_server_pods_list_the_operators_pull_secrets_in_order() -> None:
    pod = pull_secret_template("regcred", "mirror")["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_no_pull_secrets_leave_the_pod_template_as_it_was() -> None:
    """An operator upgrade without pull secrets must not roll every server pod."""
    plain = build_children(parse_spec(example_spec()), OWNER, "img").deployment
    assert "imagePullSecrets" not in plain["spec"]["template"]["spec"]
    assert pull_secret_template() == plain["spec"]["template"]


def test_adding_a_pull_secret_changes_the_template_hash() -> None:
    """The secret is part of the pod template, so pods are rebuilt with it (and only then)."""
    plain, with_secret = pull_secret_template(), pull_secret_template("regcred")
    hashes = {
        template["metadata"]["annotations"][builders.SPEC_HASH_ANNOTATION]
        for template in (plain, with_secret)
    }
    assert len(hashes) == 2


def test_profile_is_mounted_from_the_configmap() -> None:
    desired = children()
    pod = desired.deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "warmup-profile"]
    assert volume["configMap"]["name"] == desired.configmap["metadata"]["name"]
    mount = [
        m for m in container(desired.deployment)["volumeMounts"] if m["name"] == "warmup-profile"
    ]
    assert mount[0]["mountPath"] == "/etc/warmgate/profile"
    assert json.loads(desired.configmap["data"]["profile.json"]) == {"shapes": []}


def test_profile_content_never_changes_the_pod_template() -> None:
    spec = parse_spec(example_spec())
    empty = build_children(spec, OWNER, "img")
    learned = build_children(spec, OWNER, "img", [{"batch_size": 8, "seq_len": 64, "count": 1532}])
    assert learned.configmap != empty.configmap
    assert json.loads(learned.configmap["data"]["profile.json"])["shapes"] == [
        {"batch_size": 8, "seq_len": 64, "count": 1532}
    ]
    assert learned.deployment == empty.deployment


def test_spec_hash_changes_only_with_the_pod_template() -> None:
    def spec_hash(desired: builders.DesiredChildren) -> str:
        return desired.deployment["spec"]["template"]["metadata"]["annotations"][
            "warmgate.dev/spec-hash"
        ]

    base = children()
    assert spec_hash(base) == spec_hash(children())
    # Not in the pod template: no new pods.
    for override in (
        {"replicas": 5},
        {"service.port": 8081},
        {"rollout.maxSurge": 2},
        {"autoscaling.enabled": True},
    ):
        assert spec_hash(children(**override)) == spec_hash(base), override
    # In the pod template: a rollout.
    for override in (
        {"model.revision": "v2"},
        {"batching.maxBatchSize": 16},
        {"image": "example.org/other:1"},
        {"probes.periodSeconds": 3},
    ):
        assert spec_hash(children(**override)) != spec_hash(base), override


def test_cuda_requests_one_gpu_unless_told_otherwise() -> None:
    server = container(
        children(**{"runtime.device": "cuda", "runtime.dtype": "float16"}).deployment
    )
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--dtype=float16" in server["args"]
    server = container(
        children(
            **{"runtime.device": "cuda", "resources.limits": {"nvidia.com/gpu": 2, "memory": "8Gi"}}
        ).deployment
    )
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # A GPU request alone: the limit is its count (Kubernetes refuses an extended resource
    # whose request and limit differ; the operator wrote "1" whatever the request).
    gpu_request = {"runtime.device": "cuda", "resources.requests": {"nvidia.com/gpu": 2}}
    server = container(children(**gpu_request).deployment)
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert server["resources"]["requests"]["nvidia.com/gpu"] in (2, "2")
    cpu_server = container(children().deployment)
    assert "nvidia.com/gpu" not in cpu_server["resources"].get("limits", {})


def test_default_requests_fill_only_missing_resources() -> None:
    raw = example_spec()
    del raw["resources"]
    server = container(build_children(parse_spec(raw), OWNER, "img").deployment)
    # Memory measured against a limit by default: a plan too big is refused or fitted by the
    # server, not discovered by the node running out of memory.
    assert server["resources"] == {
        "requests": {"cpu": "500m", "memory": "1536Mi"},
        "limits": {"memory": "1536Mi"},
    }
    server = container(children().deployment)
    assert server["resources"] == {
        "requests": {"cpu": "100m", "memory": "1Gi"},
        "limits": {"memory": "1Gi"},
    }
    raw = example_spec()
    raw["resources"] = {"requests": {"memory": "2Gi"}}  # a request, no limit: the user's call
    server = container(build_children(parse_spec(raw), OWNER, "img").deployment)
    assert server["resources"] == {"requests": {"memory": "2Gi", "cpu": "500m"}}


def test_labels_selector_and_owner_reference() -> None:
    desired = children()
    expected_labels = {
        "app.kubernetes.io/name": "warmgate-server",
        "app.kubernetes.io/instance": "minilm",
        "app.kubernetes.io/managed-by": "warmgate",
        "warmgate.dev/service": "minilm",
    }
    for child in (desired.deployment, desired.service, desired.configmap, desired.pdb):
        assert child["metadata"]["labels"] == expected_labels
        assert child["metadata"]["namespace"] == "default"
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "warmgate.dev/v1alpha1",
            "kind": "EmbeddingService",
            "name": "minilm",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    template_labels = desired.deployment["spec"]["template"]["metadata"]["labels"]
    assert template_labels == expected_labels
    selector = desired.deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template_labels.items()
    assert desired.service["spec"]["selector"] == selector


def test_service_forwards_its_port_to_http() -> None:
    service = children(**{"service.nodePort": 30080}).service
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "nodePort": 30080}
    ]
    assert "nodePort" not in children(**{"service.type": "ClusterIP"}).service["spec"]["ports"][0]


def test_the_hpa_scales_the_embedding_service_and_the_operator_sizes_the_deployment() -> None:
    off = children()
    assert off.deployment["spec"]["replicas"] == 2
    assert off.hpa is None
    on = children(**{"autoscaling.enabled": True, "autoscaling.minReplicas": 2})
    assert on.deployment["spec"]["replicas"] == 2
    assert on.hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "warmgate.dev/v1alpha1",
        "kind": "EmbeddingService",
        "name": "minilm",
    }
    assert on.hpa["spec"]["minReplicas"] == 2
    assert on.hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        }
    ]
    assert on.hpa["spec"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 300},
    }


def test_hpa_behaviour_policies() -> None:
    hpa = children(
        **{
            "autoscaling.enabled": True,
            "autoscaling.scaleUp": {
                "stabilizationWindowSeconds": 30,
                "maxPodsPerPeriod": 4,
                "maxPercentPerPeriod": 100,
                "periodSeconds": 15,
            },
        }
    ).hpa
    assert hpa["spec"]["behavior"]["scaleUp"] == {
        "stabilizationWindowSeconds": 30,
        "policies": [
            {"type": "Pods", "value": 4, "periodSeconds": 15},
            {"type": "Percent", "value": 100, "periodSeconds": 15},
        ],
        "selectPolicy": "Max",
    }


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"replicas": 1}, None),
        ({"replicas": 2}, {"maxUnavailable": 1}),
        ({"replicas": 3, "disruptionBudget.minAvailable": 2}, {"minAvailable": 2}),
        ({"replicas": 3, "disruptionBudget.enabled": False}, None),
        (
            {"replicas": 1, "autoscaling.enabled": True, "autoscaling.minReplicas": 2},
            {"maxUnavailable": 1},
        ),
        ({"replicas": 5, "autoscaling.enabled": True, "autoscaling.minReplicas": 1}, None),
    ],
)
def test_disruption_budget_only_with_more_than_one_pod(
    overrides: dict, expected: dict | None
) -> None:
    pdb = children(**overrides).pdb
    if expected is None:
        assert pdb is None
    else:
        assert pdb["apiVersion"] == "policy/v1"
        assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "minilm"


def test_model_from_a_volume() -> None:
    desired = children(**{"model.volume": {"claimName": "models", "path": "minilm"}})
    server = container(desired.deployment)
    assert "--model=/var/lib/warmgate/models/minilm" in server["args"]
    pod = desired.deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_builders_are_deterministic() -> None:
    assert children() == children()
    assert builders.content_hash(children().deployment) == builders.content_hash(
        children().deployment
    )


# ------------------------------------------------------------------ the startup probe's budget
def startup_probe_budget(deployment: dict[str, Any]) -> int:
    probe = container(deployment)["startupProbe"]
    return probe["failureThreshold"] * probe["periodSeconds"]


def budget_children(
    startup_seconds: float | None, live: dict[str, Any] | None, **overrides: Any
) -> builders.DesiredChildren:
    spec = parse_spec(example_spec(**{"probes.startupTimeoutSeconds": None, **overrides}))
    return build_children(
        spec, OWNER, DEFAULT_SERVER_IMAGE, startup_seconds=startup_seconds, live_deployment=live
    )


@pytest.mark.parametrize(
    ("measured", "budget"),
    [(None, 600), (0.5, 120), (39.5, 120), (50, 180), (400, 1200), (2e4, 3600)],
)
def test_an_unset_startup_timeout_is_three_times_the_measured_start(measured, budget) -> None:
    assert builders.measured_startup_budget(measured) == budget
    first = budget_children(measured, live=None).deployment
    assert startup_probe_budget(first) == budget
    assert first["spec"]["progressDeadlineSeconds"] == budget + 600


def test_a_measurement_alone_does_not_roll_the_pods_to_a_smaller_budget() -> None:
    live = budget_children(None, live=None).deployment  # created before any pod had started
    assert startup_probe_budget(live) == 600
    # The pods started in 12 s: 3 x 12 s rounds to 2 minutes, but nothing else changed, so the
    # template (and every running pod) stays as it is.
    kept = budget_children(12, live).deployment
    assert kept["spec"]["template"] == live["spec"]["template"]
    # The next rollout for another reason (a new revision) takes the measured budget along.
    reload = budget_children(12, live, **{"model.revision": "v2"}).deployment
    assert startup_probe_budget(reload) == 120


def test_a_start_close_to_the_budget_raises_it_at_once() -> None:
    live = budget_children(None, live=None).deployment
    raised = budget_children(250, live).deployment  # 3 x 250 s: 13 minutes > 10
    assert startup_probe_budget(raised) == 780


def test_an_explicit_startup_timeout_wins_and_the_deadline_bounds_the_measured_one() -> None:
    explicit = budget_children(500, None, **{"probes.startupTimeoutSeconds": 90}).deployment
    assert startup_probe_budget(explicit) == 90
    capped = budget_children(500, None, **{"rollout.progressDeadlineSeconds": 900}).deployment
    assert startup_probe_budget(capped) == 898  # whole probe periods (2 s) within the deadline
    assert capped["spec"]["progressDeadlineSeconds"] == 900


def test_placement_and_pod_extras_pass_through_without_replacing_warmgates_own() -> None:
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            }
        }
    }
    deployment = children(
        **{
            "tolerations": [gpu_taint],
            "affinity": affinity,
            "priorityClassName": "inference",
            "podLabels": {"team": "search", "app.kubernetes.io/name": "mine"},
            "podAnnotations": {"prometheus.io/scrape": "true"},
            "env": [
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
            ],
            "volumes": [{"name": "extra", "configMap": {"name": "x"}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
        }
    ).deployment
    template = deployment["spec"]["template"]
    pod, server = template["spec"], container(deployment)
    assert pod["tolerations"] == [gpu_taint] and pod["affinity"] == affinity
    assert pod["priorityClassName"] == "inference"
    labels = template["metadata"]["labels"]
    assert labels["team"] == "search"
    assert labels["app.kubernetes.io/name"] == "warmgate-server"  # the selector's, not the user's
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    names = [e["name"] for e in server["env"]]
    assert names[0] == "WARMGATE_HOST" and names[-1] == "HF_TOKEN"
    assert {"name": "extra", "mountPath": "/etc/extra", "readOnly": True} in server["volumeMounts"]
    assert {"name": "extra", "configMap": {"name": "x"}} in pod["volumes"]


def test_a_volume_named_like_warmgates_own_is_refused() -> None:
    from warmgate_operator.spec import SpecError

    with pytest.raises(SpecError, match="tmp is the name of a volume warmgate mounts"):
        parse_spec(example_spec(volumes=[{"name": "tmp", "emptyDir": {}}]))


def test_the_gpu_example_selects_and_tolerates_the_gpu_node_pool() -> None:
    raw = yaml.safe_load((ROOT / "examples" / "gpu-fp16-autoscaling.yaml").read_text())["spec"]
    pod = build_children(parse_spec(raw), OWNER, DEFAULT_SERVER_IMAGE).deployment["spec"][
        "template"
    ]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")


def env_of(server: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in server["env"]}


def test_each_model_source_gives_the_server_its_files():
    """Hub (the default) downloads into the pod's cache; a hub cache claim is shared; the
    other sources are read offline from a claim, an image volume or the image itself."""
    hub = children().deployment
    server, pod = container(hub), hub["spec"]["template"]["spec"]
    assert "--model=sentence-transformers/all-MiniLM-L6-v2" in server["args"]
    env = env_of(server)
    assert env["HF_HUB_OFFLINE"] == "0" and env["HF_HOME"] == builders.HF_CACHE_DIR
    assert "HF_ENDPOINT" not in env and "HF_TOKEN" not in env
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "cache", "warmup-profile"]

    private = {
        "hub": {
            "endpoint": "https://hf-mirror.internal",
            "tokenSecret": {"name": "hf"},
            "cacheClaimName": "hf-cache",
        }
    }
    deployment = children(**{"model.source": private}).deployment
    server, pod = container(deployment), deployment["spec"]["template"]["spec"]
    env = env_of(server)
    assert env["HF_ENDPOINT"] == "https://hf-mirror.internal"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_HOME"] == builders.HF_CLAIM_DIR
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]

    # The operator's --hub-endpoint stands in when the spec names none.
    spec = parse_spec(example_spec())
    mirrored = build_children(spec, OWNER, "img", hub_endpoint="http://10.200.1.1:8000")
    assert env_of(container(mirrored.deployment))["HF_ENDPOINT"] == "http://10.200.1.1:8000"

    image = {"image": {"reference": "registry.example.com/models/minilm:1", "path": "minilm"}}
    deployment = children(**{"model.source": image}).deployment
    server, pod = container(deployment), deployment["spec"]["template"]["spec"]
    assert f"--model={builders.MODELS_DIR}/minilm" in server["args"]
    # A folder is still called by the model's id.
    assert "--served-model-name=sentence-transformers/all-MiniLM-L6-v2" in server["args"]
    assert env_of(server)["HF_HUB_OFFLINE"] == "1"
    volume = {"reference": "registry.example.com/models/minilm:1", "pullPolicy": "IfNotPresent"}
    assert {"name": "model", "image": volume} in pod["volumes"]
    assert {"name": "model", "mountPath": builders.MODELS_DIR, "readOnly": True} in server[
        "volumeMounts"
    ]

    cache_claim = {"volume": {"claimName": "models", "path": "hf", "layout": "hubCache"}}
    server = container(children(**{"model.source": cache_claim}).deployment)
    assert "--model=sentence-transformers/all-MiniLM-L6-v2" in server["args"]
    assert env_of(server)["HF_HOME"] == f"{builders.MODELS_DIR}/hf"
    assert env_of(server)["HF_HUB_OFFLINE"] == "1"

    # The older spelling still works, as a folder on the claim.
    old = container(children(**{"model.volume": {"claimName": "models", "path": "m"}}).deployment)
    assert f"--model={builders.MODELS_DIR}/m" in old["args"]

    baked = container(children(**{"model.source": {"baked": {}}}).deployment)
    assert "--model=sentence-transformers/all-MiniLM-L6-v2" in baked["args"]
    assert env_of(baked)["HF_HUB_OFFLINE"] == "1" and "HF_HOME" not in env_of(baked)
    baked = container(children(**{"model.source": {"baked": {"path": "/models/m"}}}).deployment)
    assert "--model=/models/m" in baked["args"]


SCALE_TO_ZERO = {
    "autoscaling.enabled": True,
    "autoscaling.minReplicas": 0,
    "autoscaling.maxReplicas": 4,
    "autoscaling.scaleToZero": {"idleSeconds": 60},
}


def test_at_zero_the_deployment_runs_no_pod_and_the_hpa_keeps_one_to_max() -> None:
    """The HPA cannot scale to or from zero: it owns 1..max (at 0 replicas of its target it
    stops acting), while the operator sizes the Deployment at 0, the standby pool too."""
    asleep = children(replicas=0, standbyReplicas=2, **SCALE_TO_ZERO)
    assert asleep.deployment["spec"]["replicas"] == 0
    assert asleep.hpa["spec"]["minReplicas"] == 1
    assert asleep.hpa["spec"]["maxReplicas"] == 4
    assert asleep.pdb is None  # at most one pod is the fewest it runs
    awake = children(replicas=1, standbyReplicas=2, **SCALE_TO_ZERO)
    assert awake.deployment["spec"]["replicas"] == 1 + 2
    assert awake.hpa == asleep.hpa
    # Asleep and awake run the same pods: waking starts no new template.
    assert awake.deployment["spec"]["template"] == asleep.deployment["spec"]["template"]


def test_with_pace_request_a_cpu_pod_warms_within_its_cpu_request() -> None:
    """The warmup of a pod without a CPU limit would take every idle core of the node from the
    pods serving beside it: with warmup.pace request the server is told the pod's request
    (server: pacing.py). The default (none) tells it nothing: a scale-out under load is when
    the node is busy, and its new pod's capacity is what the load waits for."""

    def cpus(**spec: dict) -> list[str]:
        raw = example_spec()
        raw.update(spec)
        args = container(build_children(parse_spec(raw), OWNER, "img").deployment)["args"]
        return [arg for arg in args if arg.startswith("--warmup-cpus")]

    paced = {"pace": "request"}
    assert cpus() == []  # the default: unpaced
    assert cpus(warmup=paced) == ["--warmup-cpus=0.1"]  # the example's 100m request
    assert cpus(warmup=paced, resources={}) == ["--warmup-cpus=0.5"]  # the default request
    # A limit alone is the request too (Kubernetes fills the request in from it).
    limit = {"limits": {"cpu": "2", "memory": "1Gi"}}
    assert cpus(warmup=paced, resources=limit) == ["--warmup-cpus=2"]
    assert cpus(warmup=paced, resources={"requests": {"cpu": "1500m"}}) == ["--warmup-cpus=1.5"]
    assert cpus(warmup={"pace": "none"}) == []
    # A GPU's warmup waits on the device.
    assert cpus(warmup=paced, runtime={"device": "cuda"}) == []


def test_the_task_is_passed_only_when_the_spec_decides_it() -> None:
    # Unset (auto), the server reads it from the model's folder.
    args = container(children().deployment)["args"]
    assert not [a for a in args if a.startswith("--task")]
    args = container(children(**{"model.task": "rerank"}).deployment)["args"]
    assert "--task=rerank" in args
