"""`python -m warmgate_devcluster up|down|status|kubeconfig`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from warmgate_devcluster.config import ClusterConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m warmgate_devcluster",
        description="A local Kubernetes: real control plane, a real node (kubelet, containerd).",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="state folder (default: .devcluster at the repository root; "
        "env WARMGATE_DEVCLUSTER_STATE_DIR)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the cluster in the background (no-op when running)")
    up.add_argument("--node-cidr", help="/30 link to the node (default 10.200.1.0/30)")
    up.add_argument("--pod-cidr", help="pod addresses (default 10.101.0.0/16)")
    up.add_argument("--node-port-range", help="NodePort range (default 30000-32767)")
    sub.add_parser("down", help="stop every process of the cluster, pods included")
    sub.add_parser("status", help="health of each component")
    sub.add_parser("kubeconfig", help="print the admin kubeconfig's path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from warmgate_devcluster.cluster import DevCluster

    overrides = {"state_dir": args.state_dir}
    if args.command == "up":
        overrides.update(
            node_cidr=args.node_cidr,
            pod_cidr=args.pod_cidr,
            node_port_range=args.node_port_range,
        )
    try:
        config = ClusterConfig.from_env(**overrides)
    except ValueError as exc:
        print(f"devcluster: {exc}", file=sys.stderr)
        return 2
    cluster = DevCluster(config)
    if args.command == "up":
        from warmgate_devcluster.preflight import NodeUnsupported

        try:
            cluster.up()
        except NodeUnsupported as exc:
            print(f"devcluster: {exc}", file=sys.stderr)
            return 2
        bin_dir = cluster.bin_dir
        print(f"\n  export KUBECONFIG={cluster.kubeconfig}")
        if bin_dir is not None:
            print(f"  export PATH={bin_dir}:$PATH   # kubectl, helm")
        print("  kubectl get nodes,pods -A")
        print(f"\n  logs: {config.logs_dir}    stop: python -m warmgate_devcluster down")
        return 0
    if args.command == "down":
        if not cluster.down():
            print("devcluster: nothing was running")
        return 0
    if args.command == "status":
        healthy = True
        for item in cluster.status():
            mark = "ok " if item.healthy else "BAD" if item.running else "-- "
            healthy &= item.healthy
            pid = item.pid if item.pid is not None else "-"
            print(f"{mark} {item.name:24} pid {pid!s:8} {item.detail}")
        print(f"kubeconfig: {cluster.kubeconfig}")
        return 0 if healthy else 1
    if args.command == "kubeconfig":
        print(cluster.kubeconfig)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
