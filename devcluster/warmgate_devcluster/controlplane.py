"""Command lines and health checks of etcd, kube-apiserver, kube-controller-manager and
kube-scheduler. Pure argv builders plus small blocking HTTP helpers; `cluster.py` runs them."""

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

from warmgate_devcluster.pki import Pki

# The kube-controller-manager's EndpointSlice and Endpoints controllers are replaced by
# devcluster's own (endpointslices.py): the apiserver rejects loopback addresses in IPv4
# EndpointSlices and Endpoints, and our pod IPs are loopback addresses.
DISABLED_CONTROLLERS = ("endpoints-controller", "endpointslice-controller")


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver}"


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


def apiserver_argv(
    bin_dir: Path, pki: Pki, cert_dir: Path, ports: Ports, node_port_range: str
) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--authorization-mode=Node,RBAC",
        "--service-cluster-ip-range=10.0.0.0/24",
        f"--service-node-port-range={node_port_range}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        "--allow-privileged=true",
        # The `kubernetes` Service's endpoint would be 127.0.0.1, which Endpoints reject.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(
    bin_dir: Path, pki: Pki, kubeconfig: Path, cert_dir: Path, ports: Ports
) -> list[str]:
    controllers = ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)])
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={cert_dir}",
        f"--controllers={controllers}",
        "--leader-elect=false",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        "--use-service-account-credentials=false",
        "--service-cluster-ip-range=10.0.0.0/24",
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


def kubeconfig_yaml(server: str, pki: Pki, *, namespace: str = "default") -> str:
    """An admin kubeconfig with the certificates embedded, so it works when copied elsewhere."""

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

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
                "name": "devcluster-admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_cert),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [
            {
                "name": "devcluster",
                "context": {
                    "cluster": "devcluster",
                    "user": "devcluster-admin",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "devcluster",
        "preferences": {},
    }
    return json.dumps(config, indent=2) + "\n"


def admin_ssl_context(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    return ctx


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
