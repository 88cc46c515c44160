#!/usr/bin/env bash
# Installs (once) the Debian packages the devcluster's real node and its image builds need:
# buildah and mmdebstrap (images without Docker), iptables and conntrack (kube-proxy), iproute2
# (the node's network namespace), libseccomp-dev and pkg-config (runc is built with seccomp).
# Does nothing when every command is there already. A machine that is not Debian-like, or a
# user who is not root, gets a message saying what is missing.
set -euo pipefail

# command -> Debian package
declare -A PACKAGES=(
  [buildah]=buildah
  [mmdebstrap]=mmdebstrap
  [iptables]=iptables
  [conntrack]=conntrack
  [ip]=iproute2
  [nsenter]=util-linux
  [pkg-config]=pkg-config
  [gcc]=gcc
)
missing=()
for command in "${!PACKAGES[@]}"; do
  command -v "$command" >/dev/null 2>&1 || missing+=("${PACKAGES[$command]}")
done
[[ -f /usr/include/seccomp.h ]] || missing+=(libseccomp-dev)
# glibc's static archive, for the static pause binary.
[[ -f /usr/lib/x86_64-linux-gnu/libc.a || -f /usr/lib/aarch64-linux-gnu/libc.a ]] || missing+=(libc6-dev)
if ((${#missing[@]} == 0)); then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "The devcluster's real node needs these Debian packages: ${missing[*]}." >&2
  echo "Install them as root (apt-get install ${missing[*]}), or run on a Debian-like machine as root." >&2
  exit 1
fi
echo "installing ${missing[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
