#!/usr/bin/env python3
"""Write the spec model's defaults (operator/warmgate_operator/spec.py, one source) into the
EmbeddingService CRD as its schema's `default:` values.

Only those lines change: a default that differs is rewritten, one the model does not have is
removed, one it has is added before the field's description; the rest of the file (its
comments, wrapping and order) stays as written. Objects that default to `{}` (so that their
fields' defaults apply) are the CRD's own choice and are left alone. `--check` exits 1 when the
file would change; tests/operator/test_crd.py fails then too. After a change run
`make chart-sync` (the chart's copy) and `make docs` (docs/api-reference.md).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from warmgate_operator.spec_defaults import is_object, model_defaults

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "warmgate.dev_embeddingservices.yaml"
SPEC_SCHEMA_PATH = ("spec", "versions", 0, "schema", "openAPIV3Schema", "properties", "spec")
_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*")


def flow(value: Any) -> str:
    """A default as one line of YAML, the way the CRD writes them (`main`, `""`, `[1, 8]`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = _PLAIN.fullmatch(value) and yaml.safe_load(value) == value
        return value if plain else json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(flow(item) for item in value) + "]"
    return json.dumps(value)


def _child(node: yaml.Node, key: str | int) -> yaml.Node:
    if isinstance(key, int):
        return node.value[key]
    for key_node, value_node in node.value:
        if key_node.value == key:
            return value_node
    raise KeyError(key)


def _entry(node: yaml.MappingNode, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    for key_node, value_node in node.value:
        if key_node.value == key:
            return key_node, value_node
    return None


def _properties(node: yaml.MappingNode, prefix: str = ""):
    found = _entry(node, "properties")
    if found is None:
        return
    for key_node, child in found[1].value:
        path = prefix + key_node.value
        yield path, child
        yield from _properties(child, path + ".")


def _last_line(key: yaml.Node, value: yaml.Node) -> int:
    """The last line (0-based) of a mapping entry."""
    end = value.end_mark
    return end.line - 1 if end.column == 0 and end.line > key.start_mark.line else end.line


def render(text: str | None = None) -> str:
    """The CRD's text with the spec model's defaults."""
    text = CRD.read_text() if text is None else text
    schema = yaml.safe_load(text)
    node = yaml.compose(text)
    for key in SPEC_SCHEMA_PATH:
        schema, node = schema[key], _child(node, key)
    wanted = model_defaults()
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []  # lines [start, end) replaced by new lines
    for path, property_node in _properties(node):
        field = schema
        for part in path.split("."):
            field = field["properties"][part]
        if is_object(field):
            continue
        want = wanted.pop(path, None)
        have = _entry(property_node, "default")
        if have is not None:
            key_node, value_node = have
            if want is not None and json.dumps(field["default"]) == json.dumps(want):
                continue
            line = " " * key_node.start_mark.column + f"default: {flow(want)}\n"
            new = [] if want is None else [line]
            edits.append((key_node.start_mark.line, _last_line(key_node, value_node) + 1, new))
        elif want is not None:
            before = _entry(property_node, "description")
            anchor = before[0] if before else property_node.value[-1][0]
            at = anchor.start_mark.line if before else _last_line(*property_node.value[-1]) + 1
            line = " " * anchor.start_mark.column + f"default: {flow(want)}\n"
            edits.append((at, at, [line]))
    if wanted:
        raise SystemExit(f"the spec model has defaults for fields the CRD lacks: {sorted(wanted)}")
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    return "".join(lines)


def main(argv: list[str]) -> int:
    current = CRD.read_text()
    wanted = render(current)
    if wanted == current:
        return 0
    relative = CRD.relative_to(ROOT)
    if "--check" in argv:
        print(f"{relative}: its defaults differ from the spec model's: run {sys.argv[0]}")
        return 1
    CRD.write_text(wanted)
    print(f"wrote {relative}; now run `make chart-sync` and `make docs`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
