"""`make up` / `make down`: the devcluster with its real node, the operator installed by the Helm
chart from its image, and a sample EmbeddingService serving from server containers.

    python -m warmgate_devcluster.quickstart up [--example examples/minilm.yaml]
    python -m warmgate_devcluster.quickstart down

`up` is safe to run again: a running cluster is kept, the chart is upgraded in place and the
example re-applied. It ends by calling the sample's Service through its node port (kube-proxy
on the node's address) and printing the curl to repeat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from warmgate_contract.names import (
    API_VERSION,
    COLD_HEADER,
    INSTANCE_LABEL,
    PLURAL,
    POD_HEADER,
    REVISION_HEADER,
)
from warmgate_devcluster import images, kubeapi, testkit
from warmgate_devcluster.cluster import DevCluster
from warmgate_devcluster.config import ClusterConfig
from warmgate_devcluster.preflight import NodeUnsupported

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "warmgate"
DEFAULT_EXAMPLE = ROOT / "examples" / "minilm.yaml"
OPERATOR_NAMESPACE = "warmgate-system"
RELEASE = "warmgate"


def _say(message: str) -> None:
    print(f"==> {message}", flush=True)


def chart_values(hub_endpoint: str | None) -> list[str]:
    """The chart's settings for the devcluster: the images it built, never pulled (the
    operator's, the router's and the server pods'), and the devcluster's model hub, which
    server pods download their model from (no hub outside this machine can be reached)."""
    repository, _, tag = images.OPERATOR.name.rpartition(":")
    router_repository, _, router_tag = images.ROUTER.name.rpartition(":")
    values = [
        f"--set=image.repository={repository}",
        f"--set=image.tag={tag}",
        "--set=image.pullPolicy=Never",
        f"--set=router.image.repository={router_repository}",
        f"--set=router.image.tag={router_tag}",
        "--set=router.image.pullPolicy=Never",
        f"--set=serverImage={images.SERVER.name}",
        "--set=serverImagePullPolicy=Never",
        "--set=logFormat=text",
    ]
    if hub_endpoint:
        values.append(f"--set=hubEndpoint={hub_endpoint}")
    return values


class Quickstart:
    def __init__(self, config: ClusterConfig) -> None:
        self.cluster = DevCluster(config)

    def helm(self, *args: str) -> subprocess.CompletedProcess:
        """The built helm, its caches in the state folder."""
        bin_dir = self.cluster.bin_dir
        assert bin_dir is not None, "the devcluster is not up"
        env = {"KUBECONFIG": str(self.cluster.kubeconfig), "HOME": str(self.cluster.state_dir)}
        return subprocess.run(
            [str(Path(bin_dir) / "helm"), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
            env={**env, "PATH": "/usr/bin:/bin"},
        )

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """kubectl for what a user does with it here: apply a manifest file, show objects."""
        return self.cluster.kubectl(*args, check=check)

    def install_operator(self) -> None:
        _say("installing the CRD and the operator (helm chart, in-cluster, from its image)")
        testkit.install_crd(self.cluster, timeout=60)
        try:
            self.helm(
                "upgrade",
                "--install",
                RELEASE,
                str(CHART),
                "--namespace",
                OPERATOR_NAMESPACE,
                "--create-namespace",
                *chart_values(self.cluster.hub_endpoint),
                "--wait",
                "--timeout=5m",
            )
        except subprocess.CalledProcessError as error:
            _say(f"helm failed: {(error.stderr or error.stdout or '').strip()}")
            self.show_operator_namespace()
            raise

    def show_operator_namespace(self) -> None:
        """What a user looks at when the chart does not become ready: the pods, their events
        and the last lines of each container's log."""
        ns = ("-n", OPERATOR_NAMESPACE)
        release = f"{INSTANCE_LABEL}={RELEASE}"
        for args in (
            ("get", "deployments,pods,endpointslices", "-o", "wide"),
            ("get", "events", "--sort-by=.lastTimestamp"),
            ("describe", "pods"),
            ("logs", "--all-containers", "--prefix", "--tail=40", "-l", release),
        ):
            shown = self.kubectl(*ns, *args, check=False)
            print(f"$ kubectl -n {OPERATOR_NAMESPACE} {' '.join(args)}")
            print((shown.stdout + shown.stderr).rstrip()[-6000:], flush=True)

    def up(self, example: Path, timeout: float) -> int:
        started = time.monotonic()
        _say("starting the devcluster: control plane, and a node (containerd, kubelet, kube-proxy)")
        try:
            self.cluster.up(log=_say)
        except NodeUnsupported as exc:
            _say(str(exc))
            return 2
        self.install_operator()
        manifest = yaml.safe_load(example.read_text())
        name = manifest["metadata"]["name"]
        namespace = manifest["metadata"].get("namespace", "default")
        shown = example.relative_to(ROOT) if example.is_relative_to(ROOT) else example
        _say(f"applying {shown}")
        self.kubectl("apply", "-f", str(example))
        _say(f"waiting for emb/{name} to be Ready (pods load and warm the model first)")
        with self.cluster.api_client() as api:
            ready = self._wait_ready(api, namespace, name, timeout)
            print(
                self.kubectl("-n", namespace, "get", "emb,pods", "-o", "wide", check=False).stdout
            )
            if not ready:
                _say(f"emb/{name} is not Ready after {timeout:.0f}s")
                print(self.kubectl("-n", namespace, "describe", "emb", name, check=False).stdout)
                return 1
            service = kubeapi.call(
                api, "GET", kubeapi.resource_path("v1", "services", namespace, name)
            )
        port = service["spec"]["ports"][0].get("nodePort")
        if not port:
            _say(f"emb/{name} is Ready; its Service is not a NodePort, so no curl from here")
            return 0
        url = f"http://{self.cluster.node_ip}:{port}/v1/embeddings"
        body = {"input": ["warmgate keeps models warm", "no request pays the cold start"]}
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with _through_the_service(request) as response:
            answer = json.load(response)
            headers = dict(response.headers)
        vectors = [item["embedding"] for item in answer["data"]]
        _say(
            f"served {len(vectors)} embeddings of {len(vectors[0])} dimensions through the "
            f"Service (pod {headers.get(POD_HEADER)}, revision "
            f"{headers.get(REVISION_HEADER)}, cold {headers.get(COLD_HEADER)}) "
            f"in {time.monotonic() - started:.0f}s"
        )
        print(
            f"""
  export KUBECONFIG={self.cluster.kubeconfig}
  export PATH={self.cluster.bin_dir}:$PATH
  kubectl get emb,pods,hpa -A
  kubectl top pods                      # metrics-server
  kubectl logs -n {OPERATOR_NAMESPACE} deploy/warmgate
  curl -s {url} -H 'content-type: application/json' \\
       -d '{{"input": "hello warm world"}}' | head -c 300; echo

  component logs: {self.cluster.config.logs_dir}    stop everything: make down
"""
        )
        return 0

    @staticmethod
    def _wait_ready(api, namespace: str, name: str, timeout: float) -> bool:
        """Until the EmbeddingService's Ready condition is True; False after `timeout`."""
        path = kubeapi.resource_path(API_VERSION, PLURAL, namespace, name)

        def ready() -> bool:
            try:
                found = kubeapi.read(api, path)
            except (kubeapi.ApiError, *kubeapi.UNANSWERED):
                return False
            return kubeapi.condition(found, "Ready").get("status") == "True"

        try:
            testkit.wait_until(ready, timeout, f"emb/{name} Ready", every=2.0)
        except AssertionError:
            return False
        return True

    def down(self) -> int:
        if not self.cluster.down(log=_say):
            _say("devcluster was not running")
        return 0


def _through_the_service(request: urllib.request.Request, seconds: float = 30.0) -> Any:
    """The Service's answer to `request`. Its node port refuses connections until kube-proxy
    has written the rules for the endpoints that just turned Ready, which on a busy node comes
    a moment after the EmbeddingService's Ready (CI saw the first request refused): a refused
    connection is tried again for `seconds`; anything else is raised at once."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return urllib.request.urlopen(request, timeout=30)
        except urllib.error.URLError as error:
            if not isinstance(error.reason, ConnectionRefusedError):
                raise
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmgate_devcluster.quickstart")
    parser.add_argument("--state-dir", type=Path, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="cluster + operator (chart) + example, then one real request")
    up.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE)
    up.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for Ready")
    sub.add_parser("down", help="stop the cluster, its node and every pod")
    args = parser.parse_args(argv)
    quickstart = Quickstart(ClusterConfig.from_env(state_dir=args.state_dir))
    if args.command == "up":
        return quickstart.up(args.example.resolve(), args.timeout)
    return quickstart.down()


if __name__ == "__main__":
    sys.exit(main())
