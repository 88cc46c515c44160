"""The node's own network namespace, and the link between it and this machine.

The node (containerd, kubelet, kube-proxy and every pod) lives in a network namespace the
devcluster creates, joined to this machine by one veth pair:

    this machine                                  node namespace `wg-<hash>`
    wg<hash>  10.200.1.1/30  <--- veth --->  eth0  10.200.1.2/30   (the node's InternalIP)
    route 10.101.0.0/16 via 10.200.1.2            cni0  10.101.0.1/24  (pods, CNI bridge)
                                                  kube-proxy's iptables rules

So kube-proxy's rules, the CNI bridge and every pod address stay inside a namespace this
cluster owns (two clusters never fight over iptables chains, and `down` removes it all at
once), while this machine still reaches the apiserver's pods, the node's NodePorts and the pod
addresses through the route. The namespace has no default route: nothing a pod or the node
sends can leave the machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class NodeNetwork:
    """Names and addresses of one cluster's node network (pure: nothing is created)."""

    name: str  # the namespace; the host end of the veth is named after it
    node_cidr: str  # a /30: host end .1, node end .2
    pod_cidr: str  # routed from this machine to the node; the node's pods take the first /24
    service_cidr: str  # ClusterIPs, only ever routed by kube-proxy inside the namespace

    @classmethod
    def for_state_dir(
        cls, state_dir: Path, node_cidr: str, pod_cidr: str, service_cidr: str
    ) -> NodeNetwork:
        digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]
        return cls(f"wg-{digest}", node_cidr, pod_cidr, service_cidr)

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.name

    @property
    def host_link(self) -> str:
        return self.name.replace("-", "")  # at most 15 characters: "wg" + 8 hex

    @property
    def host_ip(self) -> str:
        """This machine's end of the link: the apiserver listens here, so pods reach it."""
        return str(ipaddress.ip_network(self.node_cidr)[1])

    @property
    def node_ip(self) -> str:
        """The node's InternalIP (kubelet, NodePorts)."""
        return str(ipaddress.ip_network(self.node_cidr)[2])

    @property
    def node_pod_cidr(self) -> str:
        """The node's share of the pod network: the first /24."""
        network = ipaddress.ip_network(self.pod_cidr)
        return str(next(network.subnets(new_prefix=max(24, network.prefixlen))))

    @property
    def bridge_ip(self) -> str:
        return str(ipaddress.ip_network(self.node_pod_cidr)[1])

    @property
    def kubernetes_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr)[1])

    @property
    def dns_service_ip(self) -> str:
        """The cluster DNS Service's address (kubeadm's choice: the tenth of the range)."""
        return str(ipaddress.ip_network(self.service_cidr)[10])

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace. nsenter changes only the network namespace (unlike
        `ip netns exec`, which also remounts /sys and would hide the cgroup hierarchy)."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]

    def contains(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return any(ip in ipaddress.ip_network(cidr) for cidr in (self.node_cidr, self.pod_cidr))

    # ------------------------------------------------------------------ create / remove
    def exists(self) -> bool:
        return self.netns_path.exists()

    def create(self) -> None:
        """Make the namespace, the veth pair, addresses and the route to the pods. A leftover of
        an earlier run under the same name is removed first."""
        self.remove()
        self._check_free()
        _ip("netns", "add", self.name)
        try:
            node_end = f"{self.host_link}n"
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", node_end)
            _ip("link", "set", node_end, "netns", self.name)
            prefix = ipaddress.ip_network(self.node_cidr).prefixlen
            _ip("addr", "add", f"{self.host_ip}/{prefix}", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            inside = ["-n", self.name]
            _ip(*inside, "link", "set", node_end, "name", "eth0")
            _ip(*inside, "addr", "add", f"{self.node_ip}/{prefix}", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
            _ip("route", "add", self.pod_cidr, "via", self.node_ip, "dev", self.host_link)
            # The node routes between its pods' bridge and the link to this machine.
            self.sysctl("net.ipv4.ip_forward", "1")
            self.sysctl("net.bridge.bridge-nf-call-iptables", "1", required=False)
        except BaseException:
            self.remove()
            raise

    def sysctl(self, key: str, value: str, *, required: bool = True) -> None:
        """Set a per-namespace sysctl inside the node's namespace."""
        path = "/proc/sys/" + key.replace(".", "/")
        result = subprocess.run(
            self.enter(["sh", "-c", f'echo {value} > "{path}"']), capture_output=True, text=True
        )
        if required and result.returncode != 0:
            raise NetworkError(f"sysctl {key}={value} in {self.name}: {result.stderr.strip()}")

    def _check_free(self) -> None:
        """Refuse addresses this machine already uses for something else."""
        ours = {ipaddress.ip_network(c) for c in (self.node_cidr, self.pod_cidr)}
        routes = json.loads(_ip("-j", "route", "show").stdout or "[]")
        for route in routes:
            dst = route.get("dst")
            if not dst or dst == "default":
                continue
            network = ipaddress.ip_network(dst, strict=False)
            if not any(network.overlaps(cidr) for cidr in ours):
                continue
            if _remove_if_abandoned(route.get("dev", "")):
                continue
            for cidr in ours:
                if network.overlaps(cidr):
                    raise NetworkError(
                        f"{cidr} overlaps this machine's route to {dst} (dev {route.get('dev')}):"
                        " choose other node_cidr/pod_cidr (WARMGATE_DEVCLUSTER_NODE_CIDR, "
                        "WARMGATE_DEVCLUSTER_POD_CIDR)"
                    )

    def remove(self) -> None:
        """Delete the namespace (its veth end, bridge, pod links and iptables rules go with it)
        and the host end of the link. Safe to call when nothing is there."""
        if self.netns_path.exists():
            _ip("netns", "delete", self.name, check=False)
            with contextlib.suppress(OSError):
                # `ip netns delete` leaves the file when something still holds the mount.
                subprocess.run(["umount", "-l", str(self.netns_path)], capture_output=True)
                self.netns_path.unlink()
        # The route to the pods goes with the link it points through.
        _ip("link", "delete", self.host_link, check=False)


def _remove_if_abandoned(link: str) -> bool:
    """A devcluster's link (`wg<8 hex>`) whose namespace no process runs in any more is what a
    killed cluster leaves; remove it (and its route goes with it). True if removed."""
    if not re.fullmatch(r"wg[0-9a-f]{8}", link):
        return False
    network = NodeNetwork(f"wg-{link[2:]}", "", "", "")
    if network.exists() and _ip("netns", "pids", network.name, check=False).stdout.strip():
        return False
    network.remove()
    return True
