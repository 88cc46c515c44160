"""The operator's RBAC rules, read from `rbac.yaml` next to this module (their one home)."""

from __future__ import annotations

import sys
from functools import cache
from importlib import resources
from typing import Any

import yaml

from warmgate_contract.names import NAME_LABEL, OPERATOR_NAME

ROLE_NAME = OPERATOR_NAME


@cache
def _rules() -> dict[str, list[dict[str, Any]]]:
    text = resources.files(__package__).joinpath("rbac.yaml").read_text()
    return yaml.safe_load(text)


def namespaced_rules() -> list[dict[str, Any]]:
    """Rules the operator needs in every namespace it watches."""
    return [dict(rule) for rule in _rules()["namespaced"]]


def leader_election_rules() -> list[dict[str, Any]]:
    """Rules in the operator's own namespace for its leader Lease."""
    return [dict(rule) for rule in _rules()["leaderElection"]]


def cluster_role(name: str = ROLE_NAME) -> dict[str, Any]:
    """A ClusterRole with every rule, for an operator that watches all namespaces."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {NAME_LABEL: OPERATOR_NAME}},
        "rules": namespaced_rules(),
    }


def main() -> None:
    yaml.safe_dump(cluster_role(), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
