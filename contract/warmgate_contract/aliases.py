"""Model names: which EmbeddingService a name means, the same for the router (which forwards by
it) and the operator (which writes each EmbeddingAlias's status from it).

Within a namespace every EmbeddingService claims its own name and every EmbeddingAlias claims
its name for the EmbeddingService its `spec.service` names. Kubernetes keeps names unique per
kind, so two claims of one name are an alias named like an EmbeddingService. The older claim
(by creationTimestamp; the EmbeddingService on a tie) keeps the name and the newer is refused
with a message naming both: a new alias can never take traffic from a name already in use, and
deleting the older claim hands the name over. An alias points at an EmbeddingService, never at
another alias (a chain would let one change move many names at once).

Across namespaces a name is `namespace/name`; a bare name means the one namespace that has it
and is refused, naming the candidates, when more than one has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .names import ALIAS_KIND, KIND, REASON_NAME_CONFLICT, REASON_RESOLVED, REASON_TARGET_MISSING


@dataclass(frozen=True)
class Claim:
    kind: str  # KIND or ALIAS_KIND
    namespace: str
    name: str
    target: str  # the EmbeddingService it means (an EmbeddingService's own name)
    created: str = ""  # metadata.creationTimestamp (RFC 3339 sorts as text)

    @property
    def qualified(self) -> str:
        return f"{self.namespace}/{self.name}"

    def describe(self) -> str:
        return f"{self.kind} {self.qualified}"


@dataclass(frozen=True)
class Resolution:
    """What one claim's name resolves to: `service` (an EmbeddingService's name in `namespace`)
    when it serves, else `reason` and `message` say why not."""

    claim: Claim
    service: str | None
    reason: str
    message: str

    @property
    def ok(self) -> bool:
        return self.service is not None


def claims_of(
    services: Iterable[Mapping[str, Any]], aliases: Iterable[Mapping[str, Any]]
) -> list[Claim]:
    """The claims of EmbeddingService and EmbeddingAlias objects (as the API returns them)."""
    found = []
    for obj in services:
        meta = obj["metadata"]
        found.append(
            Claim(
                KIND,
                meta["namespace"],
                meta["name"],
                meta["name"],
                meta.get("creationTimestamp") or "",
            )
        )
    for obj in aliases:
        meta = obj["metadata"]
        target = str((obj.get("spec") or {}).get("service") or "")
        found.append(
            Claim(
                ALIAS_KIND,
                meta["namespace"],
                meta["name"],
                target,
                meta.get("creationTimestamp") or "",
            )
        )
    return found


def _order(claim: Claim) -> tuple[str, int, str]:
    return (claim.created, 0 if claim.kind == KIND else 1, claim.name)


def resolve(claims: Iterable[Claim]) -> dict[tuple[str, str], Resolution]:
    """Every claim's resolution, by (kind, namespace/name)."""
    claims = list(claims)
    by_name: dict[str, list[Claim]] = {}
    for claim in claims:
        by_name.setdefault(claim.qualified, []).append(claim)
    services = {c.qualified for c in claims if c.kind == KIND}
    aliases = {c.qualified for c in claims if c.kind == ALIAS_KIND}
    resolved: dict[tuple[str, str], Resolution] = {}
    for qualified, group in by_name.items():
        group.sort(key=_order)
        winner, *losers = group
        for loser in losers:
            resolved[(loser.kind, qualified)] = Resolution(
                loser,
                None,
                REASON_NAME_CONFLICT,
                f"the name {qualified} is claimed by {winner.describe()} and "
                f"{loser.describe()}; the older claim ({winner.describe()}) keeps it: rename or "
                f"delete one of them",
            )
        target = f"{winner.namespace}/{winner.target}"
        if winner.kind == KIND:
            resolution = Resolution(winner, winner.name, REASON_RESOLVED, f"serves {qualified}")
        elif not winner.target:
            resolution = Resolution(
                winner, None, REASON_TARGET_MISSING, f"{winner.describe()} names no spec.service"
            )
        elif target in services:
            resolution = Resolution(
                winner,
                winner.target,
                REASON_RESOLVED,
                f"{qualified} is served by EmbeddingService {target}",
            )
        elif target in aliases:
            resolution = Resolution(
                winner,
                None,
                REASON_TARGET_MISSING,
                f"{winner.describe()} points at {target}, an {ALIAS_KIND}: an alias points at an "
                f"EmbeddingService",
            )
        else:
            resolution = Resolution(
                winner,
                None,
                REASON_TARGET_MISSING,
                f"{winner.describe()} points at EmbeddingService {target}, which does not exist",
            )
        resolved[(winner.kind, qualified)] = resolution
    return resolved


@dataclass(frozen=True)
class NameTable:
    """Model names as clients send them, for the router: `namespace/name` always, a bare
    `name` when one namespace has it."""

    by_qualified: Mapping[str, Resolution]
    by_bare: Mapping[str, tuple[str, ...]]  # bare name -> the qualified names that have it

    @classmethod
    def build(cls, claims: Iterable[Claim]) -> NameTable:
        by_qualified: dict[str, Resolution] = {}
        for (_, qualified), resolution in resolve(claims).items():
            current = by_qualified.get(qualified)
            # The name's winner (the one that resolved or failed on its own terms), not a
            # refused rival.
            if current is None or current.reason == REASON_NAME_CONFLICT:
                by_qualified[qualified] = resolution
        bare: dict[str, list[str]] = {}
        for qualified in sorted(by_qualified):
            bare.setdefault(qualified.split("/", 1)[1], []).append(qualified)
        return cls(by_qualified, {name: tuple(q) for name, q in bare.items()})

    def lookup(self, name: str) -> Resolution | str:
        """The name's resolution, or a message saying why there is none."""
        if "/" in name:
            found = self.by_qualified.get(name)
            return found if found is not None else f"no model named {name!r}"
        candidates = self.by_bare.get(name, ())
        if len(candidates) == 1:
            return self.by_qualified[candidates[0]]
        if not candidates:
            return f"no model named {name!r}"
        return f"the model name {name!r} is in more than one namespace: use one of " + ", ".join(
            repr(c) for c in candidates
        )
