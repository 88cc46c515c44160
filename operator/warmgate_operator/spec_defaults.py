"""The spec model's defaults, spelled as paths of the CRD's schema (`batching.maxBatchSize`).

spec.py is the one source of the EmbeddingService's defaults: its dataclasses declare them and
`parse_spec` reads no other. The CRD's schema declares the same values as `default:`, so that
the apiserver stores and shows them; tools/gen-crd-defaults.py writes them there from
`model_defaults()`, and tests/operator/test_crd.py holds `crd_defaults()` equal to it.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from .spec import AutoscalingSpec, EmbeddingServiceSpec, HubSource, ModelSource

CRD_NAMES: Mapping[tuple[type, str], str] = {
    (HubSource, "token_secret"): "tokenSecret.name",
    (HubSource, "token_key"): "tokenSecret.key",
}
"""Fields the CRD spells otherwise than camelCase of their name (a path within their object)."""

NOT_IN_CRD: Mapping[tuple[type, str], str] = {
    (ModelSource, "kind"): "not a field of the CRD: which of source's objects is set (none: hub)",
    (AutoscalingSpec, "target_cpu_utilization_percentage"): (
        "computed by the operator: 70 unless only a podsMetric is given (parse_spec)"
    ),
}
"""Fields with a default the CRD must not declare, and why."""

ALIASES: Mapping[str, str] = {"model.volume": "model.source.volume"}
"""CRD objects that are another spelling of one of the model's (the older one)."""


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def _is_unset(value: Any) -> bool:
    """None, or an empty list or map: what the model writes for a field nobody set."""
    return value is None or (isinstance(value, Mapping | tuple | list) and not value)


def _as_yaml(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _model_class(hint: Any) -> type | None:
    """The spec model class a field holds (`VolumeSource | None` holds VolumeSource), if any."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and is_dataclass(candidate):
            return candidate
    return None


def _walk(model: type, value: Any, prefix: str) -> Iterator[tuple[str, Any, bool]]:
    """(CRD path, default, is an object) of each field of `model` with a default: `value`'s
    own where the object has one (autoscaling's scaleDown rules), else the class's."""
    hints = typing.get_type_hints(model)
    for item in fields(model):
        if (model, item.name) in NOT_IN_CRD:
            continue
        path = prefix + CRD_NAMES.get((model, item.name), camel_case(item.name))
        if value is not None:
            default = getattr(value, item.name)
        elif item.default is not MISSING:
            default = item.default
        elif item.default_factory is not MISSING:
            default = item.default_factory()
        else:
            default = None
        nested = _model_class(hints[item.name])
        if nested is not None:
            if default is not None:
                yield path, {}, True
            yield from _walk(nested, default, path + ".")
        elif not _is_unset(default):
            yield path, _as_yaml(default), False


def _with_aliases(found: dict[str, Any]) -> dict[str, Any]:
    for alias, path in ALIASES.items():
        for name, value in list(found.items()):
            if name.startswith(path + "."):
                found[alias + name[len(path) :]] = value
    return found


def model_defaults() -> dict[str, Any]:
    """{CRD path: default} of every field of the spec model that has one (None and empty
    collections are unset, not defaults), as YAML holds it (a tuple is a list)."""
    walked = _walk(EmbeddingServiceSpec, None, "")
    return _with_aliases({path: value for path, value, an_object in walked if not an_object})


def model_objects() -> frozenset[str]:
    """CRD paths of the model's objects that have a default of their own (`batching`): the
    ones the CRD may default to `{}`, so that their fields' defaults apply."""
    walked = _walk(EmbeddingServiceSpec, None, "")
    return frozenset(_with_aliases({path: {} for path, _, an_object in walked if an_object}))


def _schema_walk(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, child in (node.get("properties") or {}).items():
        path = prefix + name
        yield path, child
        yield from _schema_walk(child, path + ".")


def is_object(node: Mapping[str, Any]) -> bool:
    return node.get("type") == "object" and "properties" in node


def crd_defaults(spec_schema: Mapping[str, Any]) -> dict[str, Any]:
    """{path: default} of every field of the spec's schema that declares one, less the objects
    (their `{}` only makes their own fields' defaults apply: `crd_objects`)."""
    return {
        path: node["default"]
        for path, node in _schema_walk(spec_schema)
        if "default" in node and not is_object(node)
    }


def crd_objects(spec_schema: Mapping[str, Any]) -> frozenset[str]:
    """Paths of the spec schema's objects that default to `{}`."""
    return frozenset(
        path for path, node in _schema_walk(spec_schema) if "default" in node and is_object(node)
    )
