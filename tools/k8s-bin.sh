#!/usr/bin/env bash
# Builds (once) the Kubernetes binaries warmgate's devcluster runs: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl and helm, from the Go
# module proxy, at the
# versions pinned by tools/k8s/go.mod, tools/etcd/go.mod and HELM_VERSION below.
# They are cached outside the checkout, by version, and rebuilt only when one is missing.
# Prints the folder that holds them. KUBEBUILDER_ASSETS, when it names a folder with all of
# them, is used as it is.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
HELM_VERSION="${HELM_VERSION:-v3.21.4}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${WARMGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/warmgate}"
BIN_DIR="${WARMGATE_K8S_BIN:-$CACHE/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION}"
NAMES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl helm)

have_all() {
  local dir="$1" name
  for name in "${NAMES[@]}"; do [[ -x "$dir/$name" ]] || return 1; done
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]] && have_all "$KUBEBUILDER_ASSETS"; then
  echo "$KUBEBUILDER_ASSETS"
  exit 0
fi
if have_all "$BIN_DIR"; then
  echo "$BIN_DIR"
  exit 0
fi

mkdir -p "$BIN_DIR"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--mod=mod}"
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

start=$(date +%s)
k8s_commands=()
for name in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
  [[ -x "$BIN_DIR/$name" ]] || k8s_commands+=("k8s.io/kubernetes/cmd/$name")
done
if ((${#k8s_commands[@]})); then
  echo "building Kubernetes $K8S_VERSION (${k8s_commands[*]##*/}) into $BIN_DIR (first time: ~15 min on 2 cores)" >&2
  (cd "$ROOT/tools/k8s" && go build -trimpath -pgo=off -ldflags "$ldflags" -o "$BIN_DIR/" \
    "${k8s_commands[@]}") >&2
fi
if ! [[ -x "$BIN_DIR/etcd" ]]; then
  echo "building etcd $ETCD_VERSION" >&2
  (cd "$ROOT/tools/etcd" && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/etcd" go.etcd.io/etcd/server/v3) >&2
fi
if ! [[ -x "$BIN_DIR/helm" ]]; then
  echo "building helm $HELM_VERSION" >&2
  # Helm's Makefile sets these: without them `helm template` assumes Kubernetes v1.20.
  helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  GOBIN="$BIN_DIR" GOFLAGS= go install -trimpath -ldflags "$helm_ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
fi
echo "binaries ready in $(( $(date +%s) - start ))s; cache $(du -sh "$BIN_DIR" | cut -f1)" >&2
echo "$BIN_DIR"
