"""Leader election on a coordination.k8s.io/v1 Lease, as Kubernetes' own controllers do it.

Every replica runs this before it starts the operator: the one that holds the Lease operates,
the others wait and take over when the holder stops renewing it. The rules (client-go's):

- a replica takes the Lease when it is free, or when its record has not changed for
  `lease_seconds` as this replica's own clock measures it (no clock comparison across
  machines), with an update conditional on the resourceVersion it read: of two replicas that
  try at once, one wins;
- the holder renews it every `retry_seconds`;
- a holder that has not renewed within `renew_deadline_seconds` (less than `lease_seconds`)
  stops writing at once: `may_write()` is the fence every API write checks, so a replica
  that was paused (a stopped container, a long GC pause, a partition) cannot write once
  another may hold the Lease. It then exits, and comes back as a candidate;
- a replica that stops cleanly releases the Lease, so the next one takes over at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from warmgate_kube.objects import micro_time

log = logging.getLogger("warmgate.leader")

Call = Callable[[str, str, Any], Any]
"""Synchronous API call: (method, path, body) -> parsed JSON; raises with `.status`."""


def lease_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{path}/{name}" if name else path


@dataclass
class LeaderElector:
    call: Call
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 8.0
    renew_deadline_seconds: float = 5.0
    retry_seconds: float = 1.0
    on_change: Callable[[bool], None] = lambda leading: None
    """Called with True when this replica starts leading, False when it stops."""
    _renewed: float | None = None
    """Monotonic time of the last successful acquire or renew (None: not leading)."""
    _record: tuple[str, str] | None = None
    """The Lease record (holder, renew time) as last read."""
    _record_seen: float = 0.0
    """Monotonic time this replica first saw that record: the Lease expires `lease_seconds`
    after it, on this replica's clock."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError("need retry < renew deadline < lease duration")

    def may_write(self) -> bool:
        """True while this replica holds the Lease for sure: renewed within the deadline."""
        with self._lock:
            renewed = self._renewed
        return renewed is not None and time.monotonic() - renewed < self.renew_deadline_seconds

    def report_fenced(self) -> None:
        """A write was stopped by the fence: say why before the process exits."""
        with self._lock:
            renewed = self._renewed
        since = (
            "never renewed"
            if renewed is None
            else (f"last renewed {time.monotonic() - renewed:.1f}s ago")
        )
        log.error(
            "lost lease %s/%s (%s, renew deadline %.1fs): a write was stopped before it was sent",
            self.namespace,
            self.name,
            since,
            self.renew_deadline_seconds,
        )

    def holder(self) -> str | None:
        """Who holds the Lease, as last read."""
        return self._record[0] if self._record else None

    # ------------------------------------------------------------------ one attempt
    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        now_text = micro_time()
        try:
            lease = self.call("GET", lease_path(self.namespace, self.name), None)
        except Exception as error:
            if getattr(error, "status", None) != 404:
                log.warning("reading lease %s/%s: %s", self.namespace, self.name, error)
                return False
            lease = None
        if lease is None:
            body = self._lease_body(None, now_text, now_text, 0)
            try:
                self.call("POST", lease_path(self.namespace), body)
            except Exception as error:
                log.info("creating lease %s/%s: %s", self.namespace, self.name, error)
                return False
            return self._became(True)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, str(spec.get("renewTime")))
        now = time.monotonic()
        if record != self._record:  # the record moved: its holder is alive (or it changed)
            self._record, self._record_seen = record, now
        mine = holder == self.identity
        expired = now - self._record_seen >= float(
            spec.get("leaseDurationSeconds") or self.lease_seconds
        )
        if holder and not mine and not expired:
            return self._became(False)
        transitions = int(spec.get("leaseTransitions") or 0)
        acquire = spec.get("acquireTime") if mine else now_text
        body = self._lease_body(
            lease["metadata"].get("resourceVersion"),
            acquire or now_text,
            now_text,
            transitions if mine else transitions + 1,
        )
        try:
            self.call("PUT", lease_path(self.namespace, self.name), body)
        except Exception as error:
            log.info("updating lease %s/%s: %s", self.namespace, self.name, error)
            return self._became(False) if not mine else False
        if not mine:
            log.info("took over lease %s/%s from %r", self.namespace, self.name, holder)
        return self._became(True)

    def _lease_body(
        self, resource_version: str | None, acquire: str, renew: str, transitions: int
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.lease_seconds)),
                "acquireTime": acquire,
                "renewTime": renew,
                "leaseTransitions": transitions,
            },
        }

    def _became(self, leading: bool) -> bool:
        was = self._renewed is not None
        with self._lock:
            self._renewed = time.monotonic() if leading else None
        if leading:
            self._record, self._record_seen = None, time.monotonic()
        if leading != was:
            self.on_change(leading)
        return leading

    # ------------------------------------------------------------------ loops
    def acquire(self) -> bool:
        """Block until this replica holds the Lease (True) or `stop()` (False)."""
        logged: str | None = None
        while not self._stop.is_set():
            if self.try_acquire_or_renew():
                log.info("leading: holding lease %s/%s", self.namespace, self.name)
                return True
            holder = self.holder()
            if holder != logged:
                log.info(
                    "standing by: lease %s/%s is held by %r", self.namespace, self.name, holder
                )
                logged = holder
            self._stop.wait(self.retry_seconds)
        return False

    def keep_renewing(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew every retry period in a thread; call `on_lost` once the deadline passes
        without a renewal (or another replica took the Lease)."""

        def renew() -> None:
            while not self._stop.wait(self.retry_seconds):
                started = time.monotonic()
                while not self._stop.is_set():
                    if self.try_acquire_or_renew():
                        break
                    if time.monotonic() - started >= self.renew_deadline_seconds or (
                        self.holder() not in (None, self.identity)
                    ):
                        log.error(
                            "lost lease %s/%s (holder now %r): stopping",
                            self.namespace,
                            self.name,
                            self.holder(),
                        )
                        with self._lock:
                            self._renewed = None
                        on_lost()
                        return
                    self._stop.wait(min(self.retry_seconds, 0.5))

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Stop renewing and hand the Lease back (so a peer takes over at once)."""
        self._stop.set()
        if self._renewed is None:
            return
        with self._lock:
            self._renewed = None
        try:
            lease = self.call("GET", lease_path(self.namespace, self.name), None)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**spec, "holderIdentity": None, "leaseDurationSeconds": 1}
            self.call("PUT", lease_path(self.namespace, self.name), lease)
            log.info("released lease %s/%s", self.namespace, self.name)
        except Exception as error:
            log.warning("releasing lease %s/%s: %s", self.namespace, self.name, error)
