"""`make up` / `make down`: the devcluster, the CRD, the operator and a sample EmbeddingService.

    python -m warmgate_devcluster.quickstart up [--example examples/minilm.yaml]
    python -m warmgate_devcluster.quickstart down

`up` is safe to run again: a running cluster and operator are kept, the example is re-applied.
It ends by calling the sample's Service through its node port and printing the curl to repeat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from warmgate_devcluster import procs
from warmgate_devcluster.cluster import DevCluster, agent_env
from warmgate_devcluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "warmgate.dev_embeddingservices.yaml"
DEFAULT_EXAMPLE = ROOT / "examples" / "minilm.yaml"


def _say(message: str) -> None:
    print(f"==> {message}", flush=True)


class Quickstart:
    def __init__(self, config: ClusterConfig) -> None:
        self.cluster = DevCluster(config)
        self.operator_file = config.state_dir / "operator.json"
        self.operator_log = config.logs_dir / "operator.log"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        bin_dir = self.cluster.bin_dir
        return subprocess.run(
            [str(Path(bin_dir) / "kubectl"), "--kubeconfig", str(self.cluster.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=900,
        )

    def operator_record(self) -> procs.ProcRecord | None:
        try:
            return procs.ProcRecord.from_dict(json.loads(self.operator_file.read_text()))
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def start_operator(self) -> None:
        record = self.operator_record()
        if record and procs.is_running(record):
            _say(f"operator already running (pid {record.pid})")
            return
        env = agent_env()
        env["KUBECONFIG"] = str(self.cluster.kubeconfig)
        record, _ = procs.spawn(
            "operator",
            [sys.executable, "-m", "warmgate_operator", "--log-format=text"],
            self.operator_log,
            env=env,
            cwd=self.cluster.state_dir,
        )
        self.operator_file.write_text(json.dumps(record.to_dict()))
        _say(f"operator started (pid {record.pid}, log {self.operator_log})")

    def stop_operator(self) -> bool:
        record = self.operator_record()
        if record is None:
            return False
        stopped = procs.stop(record, grace=15.0)
        self.operator_file.unlink(missing_ok=True)
        return stopped

    def up(self, example: Path, timeout: float) -> int:
        started = time.monotonic()
        _say("starting the devcluster (real etcd, kube-apiserver, controllers, scheduler)")
        self.cluster.up(log=lambda message: _say(message))
        _say("installing the EmbeddingService CRD")
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/embeddingservices.warmgate.dev",
            "--timeout=60s",
        )
        self.start_operator()
        manifest = yaml.safe_load(example.read_text())
        name = manifest["metadata"]["name"]
        namespace = manifest["metadata"].get("namespace", "default")
        _say(f"applying {example.relative_to(ROOT) if example.is_relative_to(ROOT) else example}")
        self.kubectl("apply", "-f", str(example))
        _say(f"waiting for emb/{name} to be Ready (pods load and warm the model first)")
        waited = self.kubectl(
            "-n",
            namespace,
            "wait",
            "--for=condition=Ready",
            f"emb/{name}",
            f"--timeout={int(timeout)}s",
            check=False,
        )
        print(self.kubectl("-n", namespace, "get", "emb,pods", check=False).stdout)
        if waited.returncode != 0:
            _say(f"emb/{name} is not Ready: {waited.stderr.strip()}")
            print(self.kubectl("-n", namespace, "describe", "emb", name, check=False).stdout)
            return 1
        service = json.loads(
            self.kubectl("-n", namespace, "get", "service", name, "-o", "json").stdout
        )
        port = service["spec"]["ports"][0].get("nodePort")
        if not port:
            _say(f"emb/{name} is Ready; its Service is not a NodePort, so no curl from here")
            return 0
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        body = {"input": ["warmgate keeps models warm", "no request pays the cold start"]}
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
            headers = dict(response.headers)
        vectors = [item["embedding"] for item in answer["data"]]
        _say(
            f"served {len(vectors)} embeddings of {len(vectors[0])} dimensions "
            f"(revision {headers.get('X-Warmgate-Revision')}, "
            f"cold {headers.get('X-Warmgate-Cold')}) "
            f"in {time.monotonic() - started:.0f}s"
        )
        print(
            f"""
  export KUBECONFIG={self.cluster.kubeconfig}
  export PATH={self.cluster.bin_dir}:$PATH
  kubectl get emb
  curl -s {url} -H 'content-type: application/json' \\
       -d '{{"input": "hello warm world"}}' | head -c 300; echo

  operator log: {self.operator_log}    pod logs: {self.cluster.config.logs_dir}/pods/
  stop everything: make down
"""
        )
        return 0

    def down(self) -> int:
        if self.stop_operator():
            _say("operator stopped")
        if not self.cluster.down(log=lambda message: _say(message)):
            _say("devcluster was not running")
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmgate_devcluster.quickstart")
    parser.add_argument("--state-dir", type=Path, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="cluster + CRD + operator + example, then one real request")
    up.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE)
    up.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for Ready")
    sub.add_parser("down", help="stop the operator and the cluster")
    args = parser.parse_args(argv)
    quickstart = Quickstart(ClusterConfig.from_env(state_dir=args.state_dir))
    if args.command == "up":
        return quickstart.up(args.example.resolve(), args.timeout)
    return quickstart.down()


if __name__ == "__main__":
    sys.exit(main())
