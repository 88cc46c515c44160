"""Server image pull secrets: the chart's `serverImagePullSecrets` reach every server pod through
the operator's `--server-image-pull-secret` flag (or its environment twin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmgate_operator.builders import Owner, build_children
from warmgate_operator.config import ConfigError, load_config
from warmgate_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="minilm", namespace="team-a", uid="0000-1111")
SPEC = parse_spec({"model": {"id": "sentence-transformers/all-MiniLM-L6-v2"}})


def test_flag_is_repeatable_and_wins_over_its_environment_twin() -> None:
    env = {"WARMGATE_OPERATOR_SERVER_IMAGE_PULL_SECRETS": "from-env, other-env"}
    assert load_config([], env={}).server_image_pull_secrets == ()
    assert load_config([], env=env).server_image_pull_secrets == ("from-env", "other-env")
    config = load_config(
        ["--server-image-pull-secret=regcred", "--server-image-pull-secret", "mirror.creds"],
        env=env,
    )
    assert config.server_image_pull_secrets == ("regcred", "mirror.creds")


@pytest.mark.parametrize("name", ["RegCred", "reg_cred", "-regcred", "a" * 254])
def test_a_name_that_cannot_be_a_secret_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="--server-image-pull-secret"):
        load_config([f"--server-image-pull-secret={name}"], env={})


def test_a_secret_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        load_config(["--server-image-pull-secret=a", "--server-image-pull-secret=a"], env={})


def template(*secrets: str) -> dict:
    deployment = build_children(SPEC, OWNER, "img", image_pull_secrets=secrets).deployment
    return deployment["spec"]["template"]


def test_server_pods_list_the_pull_secrets_in_order() -> None:
    pod = template("regcred", "mirror")["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_no_pull_secrets_leave_the_pod_template_as_it_was() -> None:
    """An operator upgrade without pull secrets must not roll every server pod."""
    plain = build_children(SPEC, OWNER, "img").deployment["spec"]["template"]
    assert "imagePullSecrets" not in plain["spec"]
    assert template() == plain


def test_adding_a_pull_secret_changes_the_template_hash() -> None:
    """The secret is part of the pod template, so pods are rebuilt with it (and only then)."""
    hash_key = "warmgate.dev/spec-hash"
    plain, with_secret = template(), template("regcred")
    assert (
        plain["metadata"]["annotations"][hash_key]
        != with_secret["metadata"]["annotations"][hash_key]
    )


async def test_the_reconciled_deployment_carries_the_configured_pull_secrets() -> None:
    import copy

    import yaml
    from support.fakes import FakeClient

    from warmgate_operator.config import OperatorConfig
    from warmgate_operator.events import EventRecorder
    from warmgate_operator.kube import DEPLOYMENT, EMBEDDING_SERVICE
    from warmgate_operator.reconcile import Reconciler

    client = FakeClient()
    body = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    body["metadata"].update(namespace="default", generation=1)
    client.put(EMBEDDING_SERVICE, body)
    reconciler = Reconciler(
        client=client,
        config=OperatorConfig(server_image_pull_secrets=("regcred",)),
        recorder=EventRecorder(client),
        clock=lambda: "2026-11-29T22:00:00Z",
    )
    await reconciler(copy.deepcopy(client.find(EMBEDDING_SERVICE, "default", "minilm")))
    deployment = client.find(DEPLOYMENT, "default", "minilm")
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
