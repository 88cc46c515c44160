"""Documentation that is generated or copied must not drift from its source."""

from __future__ import annotations

from pathlib import Path

import yaml
from support.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]


gen_api_docs = load_tool("gen-api-docs")


def test_api_reference_is_generated_from_the_current_crd():
    assert (ROOT / "docs" / "api-reference.md").read_text() == gen_api_docs.render(), (
        "docs/api-reference.md is stale: run make docs"
    )


def test_every_crd_field_has_a_description():
    missing: list[str] = []

    def walk(schema: dict, path: str) -> None:
        if not schema.get("description"):
            missing.append(path)
        for name, child in (schema.get("properties") or {}).items():
            walk(child, f"{path}.{name}")
        items = schema.get("items")
        if isinstance(items, dict) and items.get("properties"):
            for name, child in items["properties"].items():
                walk(child, f"{path}[].{name}")

    crds = sorted((ROOT / "crds").glob("*.yaml"))
    assert [path.name for path in crds] == [
        "warmgate.dev_embeddingaliases.yaml",
        "warmgate.dev_embeddingservices.yaml",
    ]
    for path in crds:
        crd = yaml.safe_load(path.read_text())
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            properties = version["schema"]["openAPIV3Schema"]["properties"]
            for section in ("spec", "status"):
                walk(properties[section], f"{kind} {section}")
    # Every CRD is in the generated reference.
    assert set(gen_api_docs.CRDS) == set(crds)
    assert not missing, f"fields without a description (kubectl explain shows nothing): {missing}"


def test_readme_quick_start_has_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make up", "make test"]


def test_the_supported_models_page_has_a_row_for_each_zoo_family():
    """docs/models.md's family table names each zoo model the tests serve, and no other: a
    row without its test is a claim nothing backs."""
    from warmgate_testkit import zoo

    page = (ROOT / "docs" / "models.md").read_text()
    table = page.split("## Families", 1)[1].split("## Refused", 1)[0]
    named = {
        cell.split("`")[1]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| family")
        for cell in [line.split("|")[2]]
        if cell.strip().startswith("`")
    }
    assert named == set(zoo.FAMILIES) | {"custom-code-*"}
