"""`python -m warmgate_devcluster up|down|status|kubeconfig` (and the agents' entry points)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from warmgate_devcluster.config import ClusterConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m warmgate_devcluster",
        description="A local Kubernetes: real control plane, pods as local processes.",
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
    up.add_argument("--pod-cidr", help="loopback block for pod IPs (default 127.0.16.0/20)")
    up.add_argument("--node-port-range", help="NodePort range (default 30000-30999)")
    up.add_argument("--image-map-file", type=Path, help="YAML/JSON image -> command map")
    up.add_argument("--model-cache", type=Path, help="HF_HOME for warmgate-server containers")
    up.add_argument("--restart-backoff-base", type=float, help="seconds (default 10)")
    sub.add_parser("down", help="stop every process of the cluster, pods included")
    sub.add_parser("status", help="health of each component")
    sub.add_parser("kubeconfig", help="print the admin kubeconfig's path")
    for hidden in ("_node-agent", "_service-proxy", "_endpointslices"):
        sub.add_parser(hidden)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command.startswith("_"):
        return _agent(args.command, args.state_dir)

    from warmgate_devcluster.cluster import DevCluster

    overrides = {"state_dir": args.state_dir}
    if args.command == "up":
        overrides.update(
            pod_cidr=args.pod_cidr,
            node_port_range=args.node_port_range,
            image_map_file=args.image_map_file,
            model_cache=args.model_cache,
            restart_backoff_base=args.restart_backoff_base,
        )
    try:
        config = ClusterConfig.from_env(**overrides)
    except ValueError as exc:
        print(f"devcluster: {exc}", file=sys.stderr)
        return 2
    cluster = DevCluster(config)
    if args.command == "up":
        cluster.up()
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


def _agent(command: str, state_dir: Path | None) -> int:
    if state_dir is None:
        print("--state-dir is required", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    state_dir = state_dir.resolve()
    if command == "_node-agent":
        from warmgate_devcluster.agent import main as run
    elif command == "_service-proxy":
        from warmgate_devcluster.proxy import main as run
    else:
        from warmgate_devcluster.endpointslices import main as run
    run(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
