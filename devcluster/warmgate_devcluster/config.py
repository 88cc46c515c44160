"""The one frozen configuration object of a devcluster, read from flags and environment once.

`up` writes it into the state folder (`cluster.json`); the node agent, the service proxy and the
EndpointSlice controller read it back from there, so every process of one cluster agrees.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# devcluster/warmgate_devcluster/ -> the repository root, when running from a checkout.
_CHECKOUT_ROOT = PACKAGE_DIR.parent.parent
ENV_PREFIX = "WARMGATE_DEVCLUSTER_"


def repo_root() -> Path | None:
    """The warmgate checkout this package lives in, or None when installed elsewhere."""
    if (_CHECKOUT_ROOT / "tools" / "k8s-bin.sh").is_file():
        return _CHECKOUT_ROOT
    return None


def default_state_dir() -> Path:
    root = repo_root()
    return (root if root is not None else Path.cwd()) / ".devcluster"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything that shapes one devcluster. All fields have an env twin
    `WARMGATE_DEVCLUSTER_<FIELD>` (upper case), read by `from_env`."""

    # Folder holding pids, logs, certificates, etcd data, pod folders and the kubeconfig.
    state_dir: Path = field(default_factory=default_state_dir)
    # Name of the one Node the agent registers.
    node_name: str = "devcluster"
    # Loopback block pod IPs are taken from (127.0.x.y; never 127.0.0.0/24). Give two clusters
    # that run at the same time (a user's `make up` and the tests) different blocks.
    pod_cidr: str = "127.0.16.0/20"
    # NodePort range of the apiserver; the service proxy listens on these ports on 127.0.0.1.
    # 31000-32767 is left to test clusters (pytest_plugin), so they never collide with this one.
    node_port_range: str = "30000-30999"
    # Container restart back-off: base doubles per restart up to the cap (kubelet: 10s, 300s).
    restart_backoff_base: float = 10.0
    restart_backoff_max: float = 300.0
    # YAML or JSON file mapping image references to local commands (merged over the defaults).
    image_map_file: Path | None = None
    # Hugging Face cache handed to warmgate-server containers as HF_HOME.
    model_cache: Path | None = None
    # Nominal Node capacity (pods are processes; nothing enforces these).
    node_cpu: str = "16"
    node_memory: str = "64Gi"
    node_pods: str = "110"
    node_gpus: str = "0"
    # cpu.shares of the control plane's cgroup (1024 = one CPU's weight; 0: no cgroup of its
    # own). On a real cluster the control plane runs on other machines; a small weight here lets
    # it use idle CPU without crowding out serving pods when the CPUs are contested.
    control_plane_cpu_shares: int = 256
    # Seconds to wait for each control-plane component to report healthy.
    start_timeout: float = 180.0

    def __post_init__(self) -> None:
        block = ipaddress.ip_network(self.pod_cidr, strict=False)
        loopback = ipaddress.ip_network("127.0.0.0/8")
        if not block.subnet_of(loopback) or block.prefixlen > 24 or block.prefixlen < 16:
            raise ValueError(
                f"pod_cidr {self.pod_cidr!r} must be a /16../24 block inside 127.0.0.0/8, "
                "for example 127.0.16.0/20"
            )
        if ipaddress.ip_address("127.0.0.1") in block:
            raise ValueError(f"pod_cidr {self.pod_cidr!r} must not contain 127.0.0.1")
        low, _, high = self.node_port_range.partition("-")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) < int(high) < 65536):
            raise ValueError(f"node_port_range {self.node_port_range!r} must look like 30000-32767")
        if self.control_plane_cpu_shares < 0:
            raise ValueError("control_plane_cpu_shares must be >= 0 (0: no cgroup of its own)")
        if self.restart_backoff_base <= 0 or self.restart_backoff_max < self.restart_backoff_base:
            raise ValueError(
                "restart_backoff_base must be > 0 and restart_backoff_max >= restart_backoff_base"
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
    def pods_dir(self) -> Path:
        return self.state_dir / "pods"

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
            if f.name in ("state_dir", "image_map_file", "model_cache"):
                value = Path(value).expanduser().resolve()
            elif f.name in ("restart_backoff_base", "restart_backoff_max", "start_timeout"):
                value = float(value)
            elif f.name == "control_plane_cpu_shares":
                value = int(value)
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
