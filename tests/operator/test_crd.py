"""The CRD file, checked without a cluster: structure, descriptions, defaults, columns."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from support.tools import load_tool

from warmgate_contract import flags
from warmgate_operator import spec as spec_model
from warmgate_operator import spec_defaults
from warmgate_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text())
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """What the apiserver's defaulting does for the parts of the schema this CRD uses."""
    if isinstance(value, dict):
        for name, child in (node.get("properties") or {}).items():
            if name not in value and "default" in child:
                value[name] = yaml.safe_load(yaml.safe_dump(child["default"]))
            if name in value:
                value[name] = apply_defaults(child, value[name])
    return value


def test_names_scope_and_subresources() -> None:
    assert CRD["metadata"]["name"] == "embeddingservices.warmgate.dev"
    assert CRD["spec"]["group"] == "warmgate.dev"
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "EmbeddingService",
        "embeddingservices",
        ["emb"],
    )
    assert VERSION["name"] == "v1alpha1"
    assert VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == [
        "Model",
        "Revision",
        "Commit",
        "Task",
        "Ready",
        "Serving",
        "Standby",
        "Warmed",
        "Reason",
        "Age",
    ]
    assert columns["Serving"]["jsonPath"] == ".status.servingReplicas"
    assert columns["Standby"]["jsonPath"] == ".status.standbyReplicas"
    assert columns["Commit"]["jsonPath"] == ".status.model.commit"
    assert columns["Task"]["jsonPath"] == ".status.model.task"
    assert columns["Ready"]["jsonPath"] == ".status.readySummary"
    assert columns["Warmed"]["jsonPath"] == ".status.warmedReplicas"
    assert columns["Reason"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert columns["Age"]["type"] == "date"


def test_every_field_is_typed_and_described() -> None:
    missing_description, missing_type = [], []
    for path, node in walk(SCHEMA):
        if path in ("", ".metadata") or path.endswith("{}"):
            continue
        if not node.get("description"):
            missing_description.append(path)
        if "type" not in node and not node.get("x-kubernetes-int-or-string"):
            missing_type.append(path)
    assert missing_description == []
    assert missing_type == []


def test_every_validation_rule_has_a_message_naming_a_field() -> None:
    rules = [
        (path, rule)
        for path, node in walk(SCHEMA)
        for rule in node.get("x-kubernetes-validations") or []
    ]
    assert len(rules) >= 10
    for path, rule in rules:
        assert rule.get("message"), (path, rule["rule"])
        assert any(word in rule["message"] for word in ("metadata.name", ".", "warmup")), rule


def test_crd_defaults_agree_with_the_spec_model() -> None:
    spec_schema = SCHEMA["properties"]["spec"]
    defaulted = apply_defaults(spec_schema, {"model": {"id": "m"}})
    assert defaulted["warmup"]["observedTraffic"]["maxShapes"] == 16  # nested defaults reach down
    assert parse_spec(defaulted) == parse_spec({"model": {"id": "m"}})


def as_json(defaults: dict[str, Any]) -> dict[str, str]:
    """Defaults compared with their types (`false` is not `0`)."""
    return {path: json.dumps(value) for path, value in defaults.items()}


def test_every_default_is_the_spec_models_and_the_crd_declares_each_one() -> None:
    """One source: a field has a default in the CRD exactly when it has one in the spec model
    (spec.py), and the same one (tools/gen-crd-defaults.py writes them)."""
    spec_schema = SCHEMA["properties"]["spec"]
    declared, modelled = spec_defaults.crd_defaults(spec_schema), spec_defaults.model_defaults()
    assert as_json(declared) == as_json(modelled)
    assert len(declared) >= 50
    assert declared["autoscaling.scaleDown.stabilizationWindowSeconds"] == 300
    assert declared["model.source.hub.tokenSecret.key"] == "token"
    assert declared["model.volume.layout"] == "folder"  # the older spelling of source.volume
    # Objects default to {} only where the model defaults them too, so their fields' apply.
    assert spec_defaults.crd_objects(spec_schema) <= spec_defaults.model_objects()


def test_defaults_left_out_of_the_crd_on_purpose() -> None:
    """Tri-state and computed fields have no default in the schema: unset means something."""
    declared = spec_defaults.crd_defaults(SCHEMA["properties"]["spec"])
    for path in (
        "model.trustRemoteCode",  # unset: a model with code of its own is refused, asking
        "model.normalize",  # unset: as the model folder says
        "model.pooling",
        "probes.startupTimeoutSeconds",  # unset: sized from the measured startup
        "autoscaling.targetCPUUtilizationPercentage",  # 70 unless only podsMetric is given
        "autoscaling.scaleToZero",  # off unless asked for
    ):
        assert path not in declared, path
    spec = parse_spec({"model": {"id": "m"}})
    assert spec.model.trust_remote_code is None
    assert spec.autoscaling.target_cpu_utilization_percentage == 70


gen_crd_defaults = load_tool("gen-crd-defaults")


def test_the_crd_holds_what_the_generator_writes() -> None:
    text = (ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text()
    assert gen_crd_defaults.render(text) == text, "run tools/gen-crd-defaults.py"


def test_the_generator_brings_a_drifted_default_back_and_touches_nothing_else() -> None:
    text = (ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text()
    indent = " " * 22
    changed = text.replace(f"{indent}default: 16384\n", f"{indent}default: 1\n", 1)
    removed = text.replace(f"{indent}default: cl100k_base\n", "", 1)
    unset = "trustRemoteCode:\n" + indent + "type: boolean\n"
    added = text.replace(unset, unset + f"{indent}default: true\n", 1)
    for drifted in (changed, removed, added):
        assert drifted != text
        assert gen_crd_defaults.render(drifted) == text
    for value in ("main", "", "null", "1", "a: b", [1, 8, 32], True, False, 0, 2000000):
        assert yaml.safe_load(f"default: {gen_crd_defaults.flow(value)}") == {"default": value}


def test_the_crds_choices_are_the_servers_own() -> None:
    """Each enum the CRD offers for a server setting is the server's value set (the contract's
    table), except that the device and dtype leave out `auto`: the operator decides those
    before the pod exists (a cuda pod requests a GPU)."""
    spec = SCHEMA["properties"]["spec"]["properties"]
    model, runtime = spec["model"]["properties"], spec["runtime"]["properties"]
    assert tuple(model["pooling"]["enum"]) == flags.POOLINGS
    assert tuple(model["openaiTokenIds"]["enum"]) == flags.TOKEN_ID_KINDS
    for field, server_values in (
        (runtime["device"], flags.DEVICES),
        (runtime["dtype"], flags.DTYPES),
    ):
        offered = tuple(field["enum"])
        assert [value for value in server_values if value not in offered] == ["auto"]
        assert set(offered) < set(server_values)
    # And the operator checks an old object (stored before a rule) against the same sets.
    assert tuple(runtime["device"]["enum"]) == spec_model.DEVICES
    assert tuple(runtime["dtype"]["enum"]) == spec_model.DTYPES
    assert spec_model.POOLINGS == flags.POOLINGS
    assert spec_model.TOKEN_ID_KINDS == flags.TOKEN_ID_KINDS


def test_the_crds_other_choices_are_the_ones_the_operator_accepts() -> None:
    spec = SCHEMA["properties"]["spec"]["properties"]
    source = spec["model"]["properties"]["source"]["properties"]
    assert tuple(spec["imagePullPolicy"]["enum"]) == spec_model.PULL_POLICIES
    assert tuple(source["image"]["properties"]["pullPolicy"]["enum"]) == spec_model.PULL_POLICIES
    assert tuple(spec["service"]["properties"]["type"]["enum"]) == spec_model.SERVICE_TYPES
    for volume in (source["volume"], spec["model"]["properties"]["volume"]):
        assert tuple(volume["properties"]["layout"]["enum"]) == spec_model.VOLUME_LAYOUTS


def test_examples_use_only_known_fields() -> None:
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            if doc.get("kind") != "EmbeddingService":
                continue
            unknown = _unknown_fields(SCHEMA["properties"]["spec"], doc["spec"], "spec")
            assert unknown == [], example.name
            parse_spec(doc["spec"])


def _unknown_fields(node: dict[str, Any], value: Any, path: str) -> list[str]:
    out: list[str] = []
    if isinstance(value, dict) and "properties" in node:
        for key, child in value.items():
            if key not in node["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += _unknown_fields(node["properties"][key], child, f"{path}.{key}")
    return out


def test_example_fits_the_warmup_rules() -> None:
    raw = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    spec = parse_spec(raw["spec"])
    assert spec.model.id == "sentence-transformers/all-MiniLM-L6-v2"
    assert spec.service.type == "NodePort"
    assert spec.runtime.device == "cpu"
    assert spec.replicas == 2 and not spec.autoscaling.enabled
    assert max(spec.warmup.batch_sizes) * max(spec.warmup.sequence_buckets) <= (
        spec.batching.max_batch_tokens
    )


ALIAS_CRD = yaml.safe_load((ROOT / "crds" / "warmgate.dev_embeddingaliases.yaml").read_text())
(ALIAS_VERSION,) = ALIAS_CRD["spec"]["versions"]
ALIAS_SCHEMA = ALIAS_VERSION["schema"]["openAPIV3Schema"]


def test_the_alias_crd_names_scope_and_subresources() -> None:
    from warmgate_contract.names import ALIAS_KIND, ALIAS_PLURAL, API_VERSION

    assert ALIAS_CRD["metadata"]["name"] == f"{ALIAS_PLURAL}.warmgate.dev"
    names = ALIAS_CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (
        ALIAS_KIND,
        ALIAS_PLURAL,
        "embeddingalias",
    )
    assert (names["shortNames"], names["categories"]) == (["emba"], ["warmgate"])
    assert ALIAS_CRD["spec"]["scope"] == "Namespaced"
    assert f"{ALIAS_CRD['spec']['group']}/{ALIAS_VERSION['name']}" == API_VERSION
    assert ALIAS_VERSION["served"] and ALIAS_VERSION["storage"]
    assert ALIAS_VERSION["subresources"] == {"status": {}}  # no scale: an alias runs nothing
    columns = {c["name"]: c["jsonPath"] for c in ALIAS_VERSION["additionalPrinterColumns"]}
    assert columns == {
        "Service": ".spec.service",
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Reason": '.status.conditions[?(@.type=="Ready")].reason',
        "Age": ".metadata.creationTimestamp",
    }


def test_the_alias_crd_is_typed_and_described_and_its_service_is_a_dns_label() -> None:
    for path, node in walk(ALIAS_SCHEMA):
        if path in ("", ".metadata"):
            continue
        assert node.get("description"), path
        assert "type" in node, path
    spec = ALIAS_SCHEMA["properties"]["spec"]
    assert ALIAS_SCHEMA["required"] == ["spec"] and spec["required"] == ["service"]
    service = spec["properties"]["service"]
    assert service["maxLength"] == 63
    pattern = re.compile(service["pattern"])
    for name in ("bge", "bge-small-v2", "a"):
        assert pattern.search(name), name
    for name in ("", "9bge", "bge.v2", "Bge", "bge-"):
        assert not pattern.search(name), name
    status = ALIAS_SCHEMA["properties"]["status"]["properties"]
    assert set(status) == {"service", "revision", "observedGeneration", "conditions"}


AUTOSCALING = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]


def test_scale_to_zero_fields_and_rules() -> None:
    fields = AUTOSCALING["properties"]
    assert fields["minReplicas"]["minimum"] == 0
    idle = fields["scaleToZero"]["properties"]["idleSeconds"]
    assert (idle["minimum"], idle["maximum"]) == (10, 86400)
    assert "default" not in fields["scaleToZero"]  # unset unless asked for
    rules = {rule["rule"]: rule["message"] for rule in AUTOSCALING["x-kubernetes-validations"]}
    zero_needs = next(m for r, m in rules.items() if "self.minReplicas > 0" in r)
    assert "minReplicas 0 needs autoscaling.scaleToZero" in zero_needs
    needs_zero = next(m for r, m in rules.items() if "self.minReplicas == 0" in r)
    assert "scaleToZero needs autoscaling.minReplicas 0" in needs_zero
    # A scaleToZero object the user leaves empty gets the operator's own default.
    asleep = {"enabled": True, "minReplicas": 0, "scaleToZero": {}}
    defaulted = apply_defaults(
        SCHEMA["properties"]["spec"], {"model": {"id": "m"}, "autoscaling": copy.deepcopy(asleep)}
    )
    assert defaulted["autoscaling"]["scaleToZero"] == {"idleSeconds": 300}
    assert parse_spec(defaulted) == parse_spec({"model": {"id": "m"}, "autoscaling": asleep})
    status = SCHEMA["properties"]["status"]["properties"]
    assert {"scaledToZeroAt", "scaleToZero"} <= set(status)
    assert set(status["scaleToZero"]["properties"]) == {"lastWokeAt", "awakeAt", "wakeSeconds"}


def test_each_crd_file_is_its_own_yaml_document() -> None:
    """`helm show crds` (the documented CRD upgrade, piped to kubectl apply) prints the
    chart's CRD files one after another as they are: without a leading `---` each, kubectl
    would read one document holding the keys of both."""
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        assert path.read_text().startswith("---\n"), path.name
