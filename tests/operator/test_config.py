"""The operator's configuration: flags, environment twins, and clear errors."""

from __future__ import annotations

import pytest

from warmgate_operator.__main__ import main
from warmgate_operator.config import DEFAULT_SERVER_IMAGE, ConfigError, OperatorConfig, load_config


def test_defaults() -> None:
    config = load_config([], env={})
    assert config == OperatorConfig()
    assert config.default_image == DEFAULT_SERVER_IMAGE == "ghcr.io/warmgate/warmgate-server:0.1.0"
    assert config.clusterwide
    assert config.log_format == "text"


def test_environment_twins_and_flags() -> None:
    env = {
        "WARMGATE_OPERATOR_NAMESPACES": "team-a, team-b",
        "WARMGATE_OPERATOR_LOG_FORMAT": "json",
        "WARMGATE_OPERATOR_DEFAULT_IMAGE": "registry.example/warmgate-server:2",
        "WARMGATE_OPERATOR_RESYNC_SECONDS": "30",
    }
    config = load_config([], env=env)
    assert config.namespaces == ("team-a", "team-b")
    assert not config.clusterwide
    assert config.log_format == "json"
    assert config.default_image == "registry.example/warmgate-server:2"
    assert config.resync_seconds == 30
    # A flag wins over its twin.
    config = load_config(["--namespace", "only", "--resync-seconds", "5"], env=env)
    assert config.namespaces == ("only",)
    assert config.resync_seconds == 5


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--log-level", "LOUD"], "--log-level"),
        (["--resync-seconds", "0"], "--resync-seconds"),
        (["--workers", "0"], "--workers"),
        (["--default-image", ""], "--default-image"),
    ],
)
def test_bad_values_say_what_to_change(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(argv, env={})


def test_server_image_pull_policy_flag_and_twin() -> None:
    """Server pods pull IfNotPresent unless the operator is told otherwise (a local cluster
    whose nodes were loaded with the image says Never); the flag wins over its twin."""
    assert load_config([], env={}).server_image_pull_policy == "IfNotPresent"
    env = {"WARMGATE_OPERATOR_SERVER_IMAGE_PULL_POLICY": "Never"}
    assert load_config([], env=env).server_image_pull_policy == "Never"
    flagged = load_config(["--server-image-pull-policy=Always"], env=env)
    assert flagged.server_image_pull_policy == "Always"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--server-image-pull-policy", "never"], {}),
        ([], {"WARMGATE_OPERATOR_SERVER_IMAGE_PULL_POLICY": "Sometimes"}),
    ],
)
def test_an_unknown_pull_policy_names_the_flag_and_the_choices(
    argv: list[str], env: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match=r"--server-image-pull-policy .* IfNotPresent, Always"):
        load_config(argv, env=env)


def test_server_image_pull_secrets_flag_is_repeatable_and_wins_over_its_twin() -> None:
    """The chart's `serverImagePullSecrets` reach the operator as this flag (or its twin)."""
    env = {"WARMGATE_OPERATOR_SERVER_IMAGE_PULL_SECRETS": "from-env, other-env"}
    assert load_config([], env={}).server_image_pull_secrets == ()
    assert load_config([], env=env).server_image_pull_secrets == ("from-env", "other-env")
    config = load_config(
        ["--server-image-pull-secret=regcred", "--server-image-pull-secret", "mirror.creds"],
        env=env,
    )
    assert config.server_image_pull_secrets == ("regcred", "mirror.creds")


@pytest.mark.parametrize("name", ["RegCred", "reg_cred", "-regcred", "a" * 254])
def test_a_pull_secret_name_that_cannot_be_a_secret_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="--server-image-pull-secret"):
        load_config([f"--server-image-pull-secret={name}"], env={})


def test_a_pull_secret_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        load_config(["--server-image-pull-secret=a", "--server-image-pull-secret=a"], env={})


def test_main_exits_2_on_a_bad_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "100"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_rbac_rules_cover_every_kind_the_operator_touches() -> None:
    from warmgate_operator import rbac

    granted = {
        (group, resource): set(rule["verbs"])
        for rule in rbac.namespaced_rules()
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    apply_verbs = {"get", "create", "patch"}
    for key in [
        ("apps", "deployments"),
        ("", "services"),
        ("", "configmaps"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("policy", "poddisruptionbudgets"),
    ]:
        assert apply_verbs | {"delete"} <= granted[key], key
    assert {"list", "watch"} <= granted[("warmgate.dev", "embeddingservices")]
    assert "patch" in granted[("warmgate.dev", "embeddingservices/status")]
    assert {"list", "watch"} <= granted[("", "pods")]
    assert granted[("", "pods/status")] == {"patch"}
    assert "create" in granted[("", "events")]
    role = rbac.cluster_role()
    assert role["kind"] == "ClusterRole"
    assert not any("*" in rule["verbs"] for rule in role["rules"])


def test_leader_election_and_http_settings() -> None:
    config = load_config(
        ["--leader-elect", "--lease-seconds", "16", "--http-address", "0.0.0.0:9100"],
        env={"POD_NAMESPACE": "warmgate-system"},
    )
    assert config.leader_elect and config.lease_namespace == "warmgate-system"
    assert config.lease_name == "warmgate-operator"
    # The leader stops writing well before the Lease can expire for the others.
    assert config.retry_seconds == 2.0 and config.renew_deadline_seconds == 10.0
    assert config.http_bind == ("0.0.0.0", 9100)
    assert not load_config([], env={}).leader_elect
    with pytest.raises(ConfigError, match="--lease-seconds"):
        load_config(["--lease-seconds", "1"], env={})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config(["--http-address", "nowhere"], env={})
    kopf_probe = load_config([], env={"WARMGATE_OPERATOR_KOPF_PROBE_ADDRESS": "127.0.0.1:8082"})
    assert kopf_probe.kopf_probe_address == "127.0.0.1:8082"
    with pytest.raises(ConfigError, match="--kopf-probe-address 'x' must be HOST:PORT"):
        load_config(["--kopf-probe-address", "x"], env={})


def test_leader_election_rules_are_the_lease_only() -> None:
    from warmgate_operator import rbac

    (rule,) = rbac.leader_election_rules()
    assert rule == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    }
