#!/usr/bin/env bash
# Builds (once) what the devcluster's real node runs besides kubelet and kube-proxy (those come
# from tools/k8s-bin.sh, with the control plane): containerd v2 with ctr and the runc shim, runc,
# the CNI plugins (bridge, host-local, loopback, portmap), metrics-server, CoreDNS (cluster DNS)
# and the pause binary of the sandbox image. Everything comes from the Go module proxy (pause from the Kubernetes
# module's own source), is cached outside the checkout by version, and is rebuilt only when
# missing. Prints the folder that holds them.
#
# Needs gcc, libseccomp-dev and pkg-config (runc with seccomp, a static pause): tools/node-deps.sh
# installs them.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.3.7}"
RUNC_VERSION="${RUNC_VERSION:-v1.5.2}"
CNI_PLUGINS_VERSION="${CNI_PLUGINS_VERSION:-v1.10.0}"
METRICS_SERVER_VERSION="${METRICS_SERVER_VERSION:-v0.8.0}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.14.7}"
CACHE="${WARMGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/warmgate}"
NAME="node-containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION-cni-$CNI_PLUGINS_VERSION"
NAME+="-metrics-server-$METRICS_SERVER_VERSION-coredns-$COREDNS_VERSION-pause-$K8S_VERSION"
BIN_DIR="${WARMGATE_NODE_BIN:-$CACHE/$NAME}"
NAMES=(containerd containerd-shim-runc-v2 ctr runc cni/bridge cni/host-local cni/loopback
       cni/portmap metrics-server coredns pause)

have_all() {
  local name
  for name in "${NAMES[@]}"; do [[ -x "$BIN_DIR/$name" ]] || return 1; done
}
if have_all; then
  echo "$BIN_DIR"
  exit 0
fi

mkdir -p "$BIN_DIR/cni"
start=$(date +%s)
export GOFLAGS= GOTOOLCHAIN=local
# Built in a scratch module folder so `go install` never reads the checkout's go.mod files.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

if ! [[ -x "$BIN_DIR/containerd" && -x "$BIN_DIR/containerd-shim-runc-v2" && -x "$BIN_DIR/ctr" ]]; then
  echo "building containerd $CONTAINERD_VERSION" >&2
  pkg=github.com/containerd/containerd/v2
  CGO_ENABLED=0 GOBIN="$BIN_DIR" go install -trimpath \
    -tags "no_btrfs no_zfs no_devmapper urfave_cli_no_docs" \
    -ldflags "-s -w -X $pkg/version.Version=$CONTAINERD_VERSION" \
    "$pkg/cmd/containerd@$CONTAINERD_VERSION" \
    "$pkg/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
    "$pkg/cmd/ctr@$CONTAINERD_VERSION" >&2
fi
if ! [[ -x "$BIN_DIR/runc" ]]; then
  echo "building runc $RUNC_VERSION (seccomp)" >&2
  CGO_ENABLED=1 GOBIN="$BIN_DIR" go install -trimpath -tags seccomp \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" \
    "github.com/opencontainers/runc@$RUNC_VERSION" >&2
fi
for plugin in main/bridge ipam/host-local main/loopback meta/portmap; do
  name="${plugin#*/}"
  if ! [[ -x "$BIN_DIR/cni/$name" ]]; then
    echo "building CNI plugin $name $CNI_PLUGINS_VERSION" >&2
    CGO_ENABLED=0 GOBIN="$BIN_DIR/cni" go install -trimpath -ldflags "-s -w" \
      "github.com/containernetworking/plugins/plugins/$plugin@$CNI_PLUGINS_VERSION" >&2
  fi
done
if ! [[ -x "$BIN_DIR/metrics-server" ]]; then
  echo "building metrics-server $METRICS_SERVER_VERSION" >&2
  CGO_ENABLED=0 GOBIN="$BIN_DIR" go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/metrics-server/cmd/metrics-server@$METRICS_SERVER_VERSION" >&2
fi
if ! [[ -x "$BIN_DIR/coredns" ]]; then
  echo "building coredns $COREDNS_VERSION" >&2
  CGO_ENABLED=0 GOBIN="$BIN_DIR" go install -trimpath -ldflags "-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION" >&2
fi
if ! [[ -x "$BIN_DIR/pause" ]]; then
  echo "building pause from k8s.io/kubernetes $K8S_VERSION" >&2
  module_dir=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  gcc -Os -static -Wall -DVERSION="\"$K8S_VERSION-warmgate\"" \
    -o "$BIN_DIR/pause" "$module_dir/build/pause/linux/pause.c" >&2
  strip "$BIN_DIR/pause"
fi
have_all || { echo "node binaries incomplete in $BIN_DIR" >&2; exit 1; }
echo "node binaries ready in $(( $(date +%s) - start ))s; cache $(du -sh "$BIN_DIR" | cut -f1)" >&2
echo "$BIN_DIR"
