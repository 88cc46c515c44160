"""EmbeddingService specs drawn from the CRD itself (hypothesis), for the contract tests.

`SERVER_FIELDS` is every spec field whose value reaches the server's command line, found by
varying each field of the CRD's schema over its range and watching what the operator's
`server_args` writes; `specs()` draws every one of them over the range the CRD allows, with the
fields the CRD's cross-field rules tie together (the warmup plan's limits, the device and dtype,
the one model source) drawn so that those rules hold. A field added to the CRD that reaches a
server flag is drawn without a change here, or `undrawable()` names it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from warmgate_contract.flags import read_args
from warmgate_operator.builders import server_args
from warmgate_operator.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "warmgate.dev_embeddingservices.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

# Strings have patterns and meanings a generator cannot guess: valid values to draw from (checked
# against the CRD's lengths and patterns by the tests).
SAMPLE_STRINGS: dict[str, tuple[str, ...]] = {
    "model.id": ("sentence-transformers/all-MiniLM-L6-v2", "BAAI/bge-small-en-v1.5", "e5"),
    "model.revision": ("main", "v2", "2024-02", "a" * 40),
    "model.servedName": ("minilm", "bge-small-en-v1.5"),
    "model.defaultPromptName": ("query", "passage"),
    "model.defaultPrompt": ("query: ", ""),
    "model.source.volume.claimName": ("embedding-models",),
    "model.source.volume.path": ("", "bge-small-en-v1.5", "models/minilm"),
    "model.source.image.reference": ("registry.example.com/models/minilm:2024-05",),
    "model.source.image.path": ("", "minilm"),
    "model.source.baked.path": ("/models/minilm", "/opt/model"),
    "model.source.hub.endpoint": ("https://hub.example.com",),
    "model.source.hub.tokenSecret.name": ("hf-token",),
    "model.source.hub.tokenSecret.key": ("token",),
    "model.source.hub.cacheClaimName": ("hf-cache",),
    "model.volume.claimName": ("embedding-models",),
    "model.volume.path": ("", "bge-small-en-v1.5"),
    "image": ("registry.example.com/warmgate-server:1",),
    "priorityClassName": ("high",),
    "autoscaling.podsMetric.name": ("warmgate_queue_depth",),
}
# The fields the CRD's cross-field rules tie together; `specs()` draws them in an order that
# keeps those rules.
CONSTRAINED = frozenset(
    {
        "batching.maxBatchSize",
        "batching.maxBatchTokens",
        "warmup.batchSizes",
        "warmup.sequenceBuckets",
        "model.maxInputLength",
        "runtime.device",
        "runtime.dtype",
        "runtime.cudaGraphs",
        "runtime.backend",
        "runtime.packing",
    }
)
SOURCE_PREFIXES = ("model.source", "model.volume")
"""The model's source: one of several objects, at most one set (a CEL rule)."""
EXCLUSIVE = (frozenset({"model.defaultPromptName", "model.defaultPrompt"}),)
"""Fields of which the CRD takes one at most."""


def field(path: str) -> dict[str, Any]:
    node = SPEC_SCHEMA
    for part in path.split("."):
        node = node["properties"][part]
    return node


def schema_fields(node: dict[str, Any] = SPEC_SCHEMA, prefix: str = "") -> Iterator[str]:
    """Every field under spec with a schema of its own (dotted paths, parents first); lists of
    objects, free-form maps and int-or-string values are passed through to the pod as written
    and have none."""
    for name, child in node.get("properties", {}).items():
        if "anyOf" in child or child.get("x-kubernetes-preserve-unknown-fields"):
            continue
        if child.get("type") == "array" and child["items"].get("type") == "object":
            continue
        if child.get("type") == "object" and "properties" not in child:
            continue
        path = f"{prefix}{name}"
        yield path
        if child.get("type") == "object":
            yield from schema_fields(child, f"{path}.")


def candidates(path: str) -> list[Any]:
    """Distinct values the CRD allows for the field at `path`."""
    node = field(path)
    kind = node.get("type")
    if "enum" in node:
        return list(node["enum"])
    if kind == "boolean":
        return [False, True]
    if kind == "integer":
        low = node.get("minimum", 0)
        return [low, node.get("maximum", low + 1)]
    if kind == "string":
        # Without samples, any two strings tell whether the field reaches the server at all.
        placeholders = ("/a", "/b") if node.get("pattern", "").startswith("^/") else ("a", "b")
        return list(SAMPLE_STRINGS.get(path, placeholders))
    if kind == "array":
        low = node["items"].get("minimum", 0)
        return [[low], [low, low + 1]]
    if kind == "object":
        return [required_filled(path)]
    return []


def required_filled(path: str) -> dict[str, Any]:
    """The object at `path` with its required fields, and nothing else."""
    node = field(path)
    value: dict[str, Any] = {}
    for name in node.get("required", []):
        child = f"{path}.{name}"
        if "anyOf" in field(child):
            value[name] = "1"
        else:
            value[name] = copy.deepcopy(candidates(child)[0])
    return value


def with_value(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `spec` with `path` set (its parents created with their required fields)."""
    spec = copy.deepcopy(spec)
    node = spec
    *parents, last = path.split(".")
    walked = []
    for part in parents:
        walked.append(part)
        node = node.setdefault(part, required_filled(".".join(walked)))
    node[last] = copy.deepcopy(value)
    return spec


def minimal_spec() -> dict[str, Any]:
    return {"model": required_filled("model")}


def args_of(spec: dict[str, Any]) -> tuple[str, ...] | None:
    try:
        return tuple(server_args(parse_spec(spec)))
    except SpecError:
        return None


@cache
def _variant_args() -> dict[str, frozenset[tuple[str, ...]]]:
    """For each field, the distinct server arguments the operator writes as the field takes
    each of its candidate values (or is left out, when it may be)."""
    found = {}
    for path in schema_fields():
        parent = path.rpartition(".")[0]
        base = with_value(minimal_spec(), parent, required_filled(parent)) if parent else None
        base = base or minimal_spec()
        without = copy.deepcopy(base)
        holder = without
        for part in path.split(".")[:-1]:
            holder = holder[part]
        holder.pop(path.split(".")[-1], None)
        variants = [] if _required(path) else [args_of(without)]
        variants += [args_of(with_value(base, path, value)) for value in candidates(path)]
        found[path] = frozenset(args for args in variants if args is not None)
    return found


def server_fields() -> frozenset[str]:
    """The spec fields whose value changes the server's arguments the operator writes."""
    return frozenset(path for path, args in _variant_args().items() if len(args) > 1)


def written_flags() -> frozenset[str]:
    """The server flags (their `dest`) the operator writes for some spec."""
    return frozenset(
        dest
        for variants in _variant_args().values()
        for args in variants
        for dest in read_args(args)
    )


def source_kinds() -> list[str]:
    """The model source objects (`model.source.volume`, the older `model.volume`, ...) that
    change the server's arguments, themselves or through a field of theirs."""
    fields = server_fields()
    return [
        path
        for path in schema_fields()
        if path.startswith(SOURCE_PREFIXES) and path != "model.source"
        if field(path).get("type") == "object"
        if any(found == path or found.startswith(f"{path}.") for found in fields)
    ]


def undrawable() -> list[str]:
    """Strings `specs()` would draw but has no valid values for (SAMPLE_STRINGS)."""
    drawn = set(server_fields())
    for kind in source_kinds():
        drawn |= {f"{kind}.{name}" for name in field(kind).get("required", [])}
    return sorted(
        path
        for path in drawn
        if field(path).get("type") == "string" and "enum" not in field(path)
        if path not in SAMPLE_STRINGS
    )


# ------------------------------------------------------------------ drawing
def _integers(path: str, low: int | None = None, high: int | None = None) -> st.SearchStrategy:
    node = field(path)
    low = node.get("minimum", 0) if low is None else max(low, node.get("minimum", low))
    high = node.get("maximum", 1 << 20) if high is None else min(high, node.get("maximum", high))
    return st.integers(low, high)


def _ascending(path: str, high: int | None = None) -> st.SearchStrategy[list[int]]:
    """A list within the CRD's size and item range, unique and ascending (as the CRD asks)."""
    node = field(path)
    low = node["items"].get("minimum", 0)
    top = node["items"].get("maximum", 1 << 20)
    top = top if high is None else min(top, high)
    return st.lists(
        st.integers(low, top),
        min_size=node.get("minItems", 0),
        max_size=min(node.get("maxItems", 16), top - low + 1),
        unique=True,
    ).map(sorted)


def _leaf(path: str) -> st.SearchStrategy[Any]:
    node = field(path)
    kind = node.get("type")
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return _integers(path)
    if kind == "array":
        return _ascending(path)
    return st.sampled_from(SAMPLE_STRINGS[path])


def _required(path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return name in (field(parent) if parent else SPEC_SCHEMA).get("required", [])


def _put(spec: dict[str, Any], path: str, value: Any) -> None:
    node = spec
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


@st.composite
def _object(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """The object at `path`: its required fields, and each field that reaches the server,
    drawn (or left out, when the CRD lets it be)."""
    value: dict[str, Any] = {}
    for name in field(path).get("properties", {}):
        child = f"{path}.{name}"
        if _required(child) or (child in server_fields() and draw(st.booleans())):
            value[name] = draw(_leaf(child))
    return value


@st.composite
def _source(draw: st.DrawFn) -> tuple[str, dict[str, Any]] | None:
    """One model source (or none: the hub by default)."""
    chosen = draw(st.sampled_from([None, *source_kinds()]))
    if chosen is None:
        return None
    return chosen, draw(_object(chosen))


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    """A spec within the CRD: every server field drawn over its range (each optional one
    sometimes left to its default), the cross-field rules kept."""
    spec: dict[str, Any] = {"model": {}}
    left_out = set()
    for group in EXCLUSIVE:
        kept = draw(st.sampled_from([None, *sorted(group)]))
        left_out |= group - {kept}
    for path in sorted(server_fields() - CONSTRAINED - left_out):
        if path.startswith(SOURCE_PREFIXES) or field(path).get("type") == "object":
            continue
        if _required(path) or draw(st.booleans()):
            _put(spec, path, draw(_leaf(path)))
    source = draw(_source())
    if source is not None:
        _put(spec, *source)

    # The warmup plan's limits: the largest shape within the token budget, the largest warmup
    # batch within the batch size, the input limit within the largest bucket.
    tokens = draw(_integers("batching.maxBatchTokens", low=2))
    buckets = draw(_ascending("warmup.sequenceBuckets", high=tokens))
    sizes = draw(_ascending("warmup.batchSizes", high=tokens // buckets[-1]))
    _put(spec, "batching.maxBatchTokens", tokens)
    _put(spec, "warmup.sequenceBuckets", buckets)
    _put(spec, "warmup.batchSizes", sizes)
    _put(spec, "batching.maxBatchSize", draw(_integers("batching.maxBatchSize", low=sizes[-1])))
    if draw(st.booleans()):
        limit = draw(_integers("model.maxInputLength", high=buckets[-1]))
        _put(spec, "model.maxInputLength", limit)

    # float16, and CUDA graphs that must be captured, on a GPU only; ONNX Runtime on the CPU
    # only, in float32, with padded passes.
    device = draw(_leaf("runtime.device"))
    on_gpu = device == "cuda"
    if device != field("runtime.device")["default"] or draw(st.booleans()):
        _put(spec, "runtime.device", device)
    backend = "torch" if on_gpu else draw(_leaf("runtime.backend"))
    if backend != field("runtime.backend")["default"] or draw(st.booleans()):
        _put(spec, "runtime.backend", backend)
    refused = {
        "runtime.dtype": {"float16"} if backend == "torch" else {"float16", "bfloat16"},
        "runtime.cudaGraphs": {"on"},
        "runtime.packing": {"on"} if backend == "onnxruntime" else set(),
    }
    for path in ("runtime.dtype", "runtime.cudaGraphs", "runtime.packing"):
        if draw(st.booleans()):
            choices = [v for v in field(path)["enum"] if on_gpu or v not in refused[path]]
            _put(spec, path, draw(st.sampled_from(choices)))
    return spec


def free_field_values() -> dict[str, st.SearchStrategy[Any]]:
    """The constrained fields, each over its whole CRD range regardless of the others: what
    the apiserver's cross-field rules must judge."""
    return {path: _leaf(path) for path in sorted(CONSTRAINED)}


def pattern_ok(path: str, value: str) -> bool:
    node = field(path)
    if len(value) < node.get("minLength", 0) or len(value) > node.get("maxLength", 1 << 20):
        return False
    return "pattern" not in node or re.search(node["pattern"], value) is not None
