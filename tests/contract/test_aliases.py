"""Model names (warmgate_contract.aliases): which EmbeddingService a name means, the same for
the router and the operator."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from warmgate_contract.aliases import Claim, NameTable, claims_of, resolve
from warmgate_contract.names import (
    ALIAS_KIND,
    KIND,
    REASON_NAME_CONFLICT,
    REASON_RESOLVED,
    REASON_TARGET_MISSING,
)

OLD, NEW = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"


def service(name: str, created: str = OLD, namespace: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created}}


def alias(name: str, target: str, created: str = NEW, namespace: str = "ns") -> dict[str, Any]:
    return {**service(name, created, namespace), "spec": {"service": target}}


def test_an_alias_resolves_to_the_embedding_service_it_names() -> None:
    resolved = resolve(claims_of([service("bge-v1")], [alias("search", "bge-v1")]))
    found = resolved[(ALIAS_KIND, "ns/search")]
    assert (found.ok, found.service, found.reason) == (True, "bge-v1", REASON_RESOLVED)
    assert found.message == "ns/search is served by EmbeddingService ns/bge-v1"
    own = resolved[(KIND, "ns/bge-v1")]
    assert (own.service, own.reason) == ("bge-v1", REASON_RESOLVED)


def test_the_older_claim_keeps_a_name_and_the_message_names_both() -> None:
    services = [service("search", created=OLD), service("bge-v2", created=OLD)]
    resolved = resolve(claims_of(services, [alias("search", "bge-v2", created=NEW)]))
    refused = resolved[(ALIAS_KIND, "ns/search")]
    assert (refused.ok, refused.reason) == (False, REASON_NAME_CONFLICT)
    assert "EmbeddingService ns/search" in refused.message
    assert "EmbeddingAlias ns/search" in refused.message
    assert "older claim (EmbeddingService ns/search)" in refused.message
    assert resolved[(KIND, "ns/search")].service == "search"

    # The other way round: an alias made first keeps its name against a newer service.
    services = [service("search", created=NEW), service("bge-v2", created=OLD)]
    resolved = resolve(claims_of(services, [alias("search", "bge-v2", created=OLD)]))
    assert resolved[(ALIAS_KIND, "ns/search")].service == "bge-v2"
    assert resolved[(KIND, "ns/search")].reason == REASON_NAME_CONFLICT


def test_a_tie_goes_to_the_embedding_service() -> None:
    services = [service("search", created=OLD), service("bge", created=OLD)]
    resolved = resolve(claims_of(services, [alias("search", "bge", created=OLD)]))
    assert resolved[(KIND, "ns/search")].ok
    assert resolved[(ALIAS_KIND, "ns/search")].reason == REASON_NAME_CONFLICT


def test_an_alias_without_its_service_or_pointing_at_an_alias_is_refused() -> None:
    aliases = [alias("a", "gone"), alias("b", "a"), alias("c", "")]
    resolved = resolve(claims_of([], aliases))
    missing = resolved[(ALIAS_KIND, "ns/a")]
    assert (missing.ok, missing.reason) == (False, REASON_TARGET_MISSING)
    assert "EmbeddingService ns/gone, which does not exist" in missing.message
    chained = resolved[(ALIAS_KIND, "ns/b")]
    assert chained.reason == REASON_TARGET_MISSING and "an EmbeddingAlias" in chained.message
    assert resolved[(ALIAS_KIND, "ns/c")].reason == REASON_TARGET_MISSING


def test_names_are_per_namespace() -> None:
    """An alias means the EmbeddingService of its own namespace, whatever other namespaces
    hold; a name in two namespaces is no conflict."""
    services = [service("bge", namespace="a"), service("search", namespace="b")]
    resolved = resolve(claims_of(services, [alias("search", "bge", namespace="a")]))
    assert resolved[(ALIAS_KIND, "a/search")].service == "bge"
    assert resolved[(KIND, "b/search")].ok
    elsewhere = [alias("x", "bge", namespace="b")]
    missing = resolve(claims_of([service("bge", namespace="a")], elsewhere))
    assert missing[(ALIAS_KIND, "b/x")].reason == REASON_TARGET_MISSING


def test_the_name_table_finds_bare_and_qualified_names() -> None:
    services = [service("bge", namespace="a"), service("bge", namespace="b")]
    table = NameTable.build(claims_of(services, [alias("search", "bge", namespace="a")]))
    found = table.lookup("search")
    assert not isinstance(found, str) and found.service == "bge" and found.claim.namespace == "a"
    assert not isinstance(table.lookup("b/bge"), str)
    ambiguous = table.lookup("bge")
    assert isinstance(ambiguous, str) and "'a/bge'" in ambiguous and "'b/bge'" in ambiguous
    assert table.lookup("nothing") == "no model named 'nothing'"
    # A name lost to an older claim means the winner.
    table = NameTable.build(
        claims_of([service("search", NEW), service("x")], [alias("search", "x", OLD)])
    )
    winner = table.lookup("ns/search")
    assert not isinstance(winner, str) and winner.claim.kind == ALIAS_KIND


stamps = st.sampled_from([OLD, NEW, "2026-01-03T00:00:00Z"])
names = st.sampled_from(["a", "b", "c", "d"])


@given(
    services=st.dictionaries(names, stamps, max_size=4),
    aliases=st.dictionaries(names, st.tuples(names, stamps), max_size=4),
)
def test_every_claim_gets_one_resolution_and_each_name_one_winner(
    services: dict[str, str], aliases: dict[str, tuple[str, str]]
) -> None:
    claims = claims_of(
        [service(name, created) for name, created in services.items()],
        [alias(name, target, created) for name, (target, created) in aliases.items()],
    )
    resolved = resolve(claims)
    assert set(resolved) == {(claim.kind, claim.qualified) for claim in claims}
    for name in set(services) | set(aliases):
        group = [r for (_, qualified), r in resolved.items() if qualified == f"ns/{name}"]
        assert sum(r.reason != REASON_NAME_CONFLICT for r in group) == 1
        # Whatever resolves, resolves to an EmbeddingService that exists.
        for r in group:
            assert r.service is None or r.service in services
    # The order claims come in changes nothing.
    assert resolve(reversed(claims)) == resolved


def test_claim_describes_itself() -> None:
    claim = Claim(ALIAS_KIND, "ns", "search", "bge")
    assert (claim.qualified, claim.describe()) == ("ns/search", "EmbeddingAlias ns/search")
