"""The one frozen configuration object of a devcluster, read from flags and environment once.

`up` writes it into the state folder (`cluster.json`); `status` and `down` read it back from
there, so every command on one cluster agrees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from warmgate_devcluster.network import NodeNetwork

PACKAGE_DIR = Path(__file__).resolve().parent
# devcluster/warmgate_devcluster/ -> the repository root, when running from a checkout.
_CHECKOUT_ROOT = PACKAGE_DIR.parent.parent
ENV_PREFIX = "WARMGATE_DEVCLUSTER_"


def repo_root() -> Path | None:
    """The warmgate checkout this package lives in, or None when installed elsewhere."""
    if (_CHECKOUT_ROOT / "tools" / "k8s-bin.sh").is_file():
        return _CHECKOUT_ROOT
    return None


def cache_root() -> Path:
    """Where built binaries, images, wheels and containerd roots are kept between runs, outside
    the checkout: WARMGATE_CACHE, else $XDG_CACHE_HOME/warmgate, else ~/.cache/warmgate (the
    tools/ scripts agree)."""
    if os.environ.get("WARMGATE_CACHE"):
        return Path(os.environ["WARMGATE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmgate"


def default_state_dir() -> Path:
    root = repo_root()
    return (root if root is not None else Path.cwd()) / ".devcluster"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything that shapes one devcluster. All fields have an env twin
    `WARMGATE_DEVCLUSTER_<FIELD>` (upper case), read by `from_env`."""

    # Folder holding pids, logs, certificates, etcd data, the node's state and the kubeconfig.
    state_dir: Path = field(default_factory=default_state_dir)
    # Name of the one Node.
    node_name: str = "devcluster"
    # The link between this machine and the node's network namespace (network.py): a /30 whose
    # first address is this machine's end (the apiserver listens there) and whose second is the
    # node's InternalIP. Two clusters running at once (a `make up` and the tests) need
    # different links and pod networks; pytest_plugin gives each test session its own.
    node_cidr: str = "10.200.1.0/30"
    # Pod addresses, routed from this machine through the node (its pods take the first /24).
    pod_cidr: str = "10.101.0.0/16"
    # ClusterIPs; only kube-proxy, inside the node's namespace, ever routes them.
    service_cidr: str = "10.96.0.0/16"
    # NodePort range of the apiserver; node ports answer on the node's InternalIP.
    node_port_range: str = "30000-32767"
    # containerd's root (images, unpacked layers). Kept between runs, outside the state folder,
    # so the images are imported once, not at every `up`; one cluster at a time may use it.
    # Default: <cache>/containerd/<cluster name>.
    containerd_root: Path | None = None
    # Import warmgate's own images (server with its model, operator) into the node; off, the
    # node gets only what the cluster itself runs (pause, CoreDNS, metrics-server) and the base.
    app_images: bool = True
    # cpu.shares of the control plane's cgroup (1024 = one CPU's weight; 0: no cgroup of its
    # own). On a real cluster the control plane runs on other machines; a small weight here lets
    # it use idle CPU without crowding out serving pods when the CPUs are contested.
    control_plane_cpu_shares: int = 256
    # Seconds to wait for each component to report healthy.
    start_timeout: float = 180.0

    def __post_init__(self) -> None:
        networks = {}
        for name, smallest, largest in (
            ("node_cidr", 30, 30),
            ("pod_cidr", 24, 16),
            ("service_cidr", 24, 12),
        ):
            value = getattr(self, name)
            try:
                network = ipaddress.ip_network(value)
            except ValueError as exc:
                raise ValueError(f"{name} {value!r} is not an IPv4 network: {exc}") from exc
            if network.version != 4 or not network.is_private or network.is_loopback:
                raise ValueError(f"{name} {value!r} must be a private IPv4 block (10.x, 172.16.x)")
            if not largest <= network.prefixlen <= smallest:
                raise ValueError(f"{name} {value!r} must be a /{largest} to /{smallest} block")
            networks[name] = network
        for a, b in (
            ("node_cidr", "pod_cidr"),
            ("node_cidr", "service_cidr"),
            ("pod_cidr", "service_cidr"),
        ):
            if networks[a].overlaps(networks[b]):
                raise ValueError(f"{a} {getattr(self, a)} overlaps {b} {getattr(self, b)}")
        low, _, high = self.node_port_range.partition("-")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) < int(high) < 65536):
            raise ValueError(f"node_port_range {self.node_port_range!r} must look like 30000-32767")
        if self.control_plane_cpu_shares < 0:
            raise ValueError("control_plane_cpu_shares must be >= 0 (0: no cgroup of its own)")
        # kubelet binds unix sockets inside the state folder (node/kubelet/pod-resources/<10
        # digits>), and a socket's path has at most 107 bytes: past that it fails to start.
        longest = len(str(Path(self.state_dir).resolve() / "node/kubelet/pod-resources")) + 11
        if longest > 107:
            raise ValueError(
                f"state folder {self.state_dir} is {longest - 107} characters too long: kubelet"
                " makes unix sockets below it (at most 107 bytes a path); choose a shorter one"
            )

    # Paths inside the state folder.
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log: every write (who, what, when), one JSON object a line;
        rotated backups beside it (`audit-<time>.log`)."""
        return self.logs_dir / "audit.log"

    @property
    def network(self) -> NodeNetwork:
        return NodeNetwork.for_state_dir(
            self.state_dir, self.node_cidr, self.pod_cidr, self.service_cidr
        )

    @property
    def cluster_name(self) -> str:
        """Names this cluster's cgroups, run folder and default containerd root."""
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
        return f"warmgate-devcluster-{digest}"

    @property
    def control_plane_group(self) -> str:
        return f"{self.cluster_name}-control-plane"

    @property
    def node_group(self) -> str:
        return f"{self.cluster_name}-node"

    @property
    def containerd_dir(self) -> Path:
        return self.containerd_root or cache_root() / "containerd" / self.cluster_name

    @property
    def run_dir(self) -> Path:
        """Sockets and runtime state: short paths (a unix socket path has at most 108 bytes)."""
        return Path("/run") / self.cluster_name

    @property
    def config_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def runtime_file(self) -> Path:
        return self.state_dir / "runtime.json"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for key, value in data.items():
            if isinstance(value, Path):
                data[key] = str(value)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterConfig:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in data or data[f.name] is None:
                continue
            value = data[f.name]
            if f.name in ("state_dir", "containerd_root"):
                value = Path(value).expanduser().resolve()
            elif f.name == "start_timeout":
                value = float(value)
            elif f.name == "control_plane_cpu_shares":
                value = int(value)
            elif f.name == "app_images":
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true")
            else:
                value = str(value)
            kwargs[f.name] = value
        return cls(**kwargs)

    @classmethod
    def load(cls, state_dir: Path) -> ClusterConfig:
        """The configuration `up` wrote into a state folder."""
        data = json.loads((Path(state_dir) / "cluster.json").read_text())
        data["state_dir"] = str(state_dir)
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> ClusterConfig:
        """Defaults, then `WARMGATE_DEVCLUSTER_*` variables, then explicit overrides."""
        environ = os.environ if environ is None else environ
        data: dict = {}
        for f in dataclasses.fields(cls):
            value = environ.get(ENV_PREFIX + f.name.upper())
            if value:
                data[f.name] = value
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)
