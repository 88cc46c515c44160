"""Command lines of etcd, kube-apiserver, kube-controller-manager and kube-scheduler, and
their kubeconfigs. Pure argv builders plus a small blocking HTTP GET for the health endpoints
that are not the Kubernetes API (etcd, the controller manager, the scheduler, kube-proxy);
`cluster.py` runs them, and reads the API itself through the Kubernetes client (`kubeapi`)."""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from warmgate_devcluster.pki import (
    ADMIN,
    APISERVER_KUBELET_CLIENT,
    FRONT_PROXY_CLIENT,
    ClientIdentity,
    Pki,
)


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    # The apiserver listens on this machine's end of the link to the node (network.py), so
    # that kubelet, kube-proxy and pods reach it; this machine reaches it there too.
    apiserver_host: str = "127.0.0.1"

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.apiserver_host}:{self.apiserver}"


def etcd_argv(bin_dir: Path, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(bin_dir / "etcd"),
        "--name=devcluster",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


# Every write to the API is recorded, with who made it (user and user agent), the object and the
# time, so "who wrote this, and when?" has an answer from the apiserver itself (the idle
# operator test asks it); so is every read of warmgate's own resources (kopf's listings and
# watches of EmbeddingServices, the operator's audits), so "who still reads at idle?" has one
# too. Other reads are not recorded: they are most requests and answer nothing of the kind.
# One event per request, when its response is complete (a watch's also when it starts).
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: Metadata
    verbs: [get, list, watch]
    resources:
      - group: warmgate.dev
  - level: None
"""

AUDIT_LOG_MAX_MIB = 32
AUDIT_LOG_BACKUPS = 1


def apiserver_argv(
    bin_dir: Path,
    pki: Pki,
    cert_dir: Path,
    ports: Ports,
    service_cidr: str,
    node_port_range: str,
    audit_policy: Path,
    audit_log: Path,
) -> list[str]:
    """`audit_policy` must hold AUDIT_POLICY; the log stays under AUDIT_LOG_MAX_MIB x
    (AUDIT_LOG_BACKUPS + 1), written before each response (blocking mode)."""
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        f"--bind-address={ports.apiserver_host}",
        f"--advertise-address={ports.apiserver_host}",
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--authorization-mode=Node,RBAC",
        f"--service-cluster-ip-range={service_cidr}",
        f"--service-node-port-range={node_port_range}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        "--allow-privileged=true",
        # To kubelets (logs, exec, port-forward), by the node's InternalIP.
        f"--kubelet-client-certificate={pki.client_cert(APISERVER_KUBELET_CLIENT)}",
        f"--kubelet-client-key={pki.client_key(APISERVER_KUBELET_CLIENT)}",
        "--kubelet-preferred-address-types=InternalIP",
        # The aggregation layer (metrics-server's metrics.k8s.io), as kubeadm sets it up;
        # aggregator routing dials the endpoint's pod address, not the ClusterIP.
        f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        f"--proxy-client-cert-file={pki.front_proxy_client_cert}",
        f"--proxy-client-key-file={pki.front_proxy_client_key}",
        "--enable-aggregator-routing=true",
        f"--audit-policy-file={audit_policy}",
        f"--audit-log-path={audit_log}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
        f"--audit-log-maxsize={AUDIT_LOG_MAX_MIB}",
        f"--audit-log-maxbackup={AUDIT_LOG_BACKUPS}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(
    bin_dir: Path, pki: Pki, kubeconfig: Path, cert_dir: Path, ports: Ports, service_cidr: str
) -> list[str]:
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={cert_dir}",
        "--controllers=*",
        "--leader-elect=false",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        "--use-service-account-credentials=false",
        f"--service-cluster-ip-range={service_cidr}",
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(bin_dir: Path, kubeconfig: Path, cert_dir: Path, ports: Ports) -> list[str]:
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={cert_dir}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def kubeconfig_yaml(
    server: str,
    pki: Pki,
    identity: ClientIdentity = ADMIN,
    *,
    namespace: str = "default",
) -> str:
    """A kubeconfig for one client identity with the certificates embedded, so it works when
    copied elsewhere."""

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    user = f"devcluster-{identity.file_stem}"
    # JSON is valid YAML, and needs no YAML library here.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "devcluster",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(pki.client_cert(identity)),
                    "client-key-data": b64(pki.client_key(identity)),
                },
            }
        ],
        "contexts": [
            {
                "name": "devcluster",
                "context": {"cluster": "devcluster", "user": user, "namespace": namespace},
            }
        ],
        "current-context": "devcluster",
        "preferences": {},
    }
    return json.dumps(config, indent=2) + "\n"


def insecure_ssl_context() -> ssl.SSLContext:
    # kube-controller-manager and kube-scheduler serve /healthz with self-signed certificates.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_get(url: str, context: ssl.SSLContext | None = None, timeout: float = 3.0):
    """(status, body) of a GET; (None, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return None, str(exc)


def wait_until(
    check: Callable[[], bool],
    what: str,
    timeout: float,
    alive: Callable[[], bool] | None = None,
    interval: float = 0.2,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if alive is not None and not alive():
            raise RuntimeError(f"{what}: the process exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not healthy after {timeout:.0f}s")
        time.sleep(interval)
