#!/usr/bin/env bash
# Build the Tollgate image with no registry: debootstrap a minimal Debian bookworm rootfs (Python
# 3.11), import it as the base image, build deploy/Containerfile on it. Root, with Debian's
# debootstrap and podman (`apt-get install -y debootstrap podman runc`).
#
#   deploy/build-image.sh [IMAGE]        # default localhost/tollgate:latest
#
# TOLLGATE_ROOTFS=DIR reuses a rootfs debootstrap made before (minutes saved);
# PODMAN_RUNTIME=runc where crun cannot run (a cgroup v1/v2 hybrid host: deploy/README.md);
# PODMAN_ULIMITS="--ulimit nofile=4096:4096 --ulimit nproc=4096:4096" where podman's default
# limits are above what the caller may set.
set -euo pipefail
IMAGE=${1:-localhost/tollgate:latest}
BASE=localhost/tollgate-base:bookworm
REPO=$(cd "$(dirname "$0")/.." && pwd)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PODMAN=(podman)
[[ -n ${PODMAN_RUNTIME:-} ]] && PODMAN+=(--runtime "$PODMAN_RUNTIME")
read -r -a ULIMITS <<< "${PODMAN_ULIMITS:-}"

ROOTFS=${TOLLGATE_ROOTFS:-}
if [[ -z $ROOTFS ]]; then
  ROOTFS=$(mktemp -d)
  trap 'rm -rf "$ROOTFS"' EXIT
fi
if [[ ! -x $ROOTFS/usr/bin/python3 ]]; then
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
fi
# The rootfs as it is, minus apt's caches.
tar -C "$ROOTFS" --exclude=./var/cache/apt/archives --exclude=./var/lib/apt/lists \
  --exclude=./proc --exclude=./sys --exclude=./dev -c . | "${PODMAN[@]}" import - "$BASE"
# --network host: the install step reaches the package index from the build container, trusting
# the CA bundle this host trusts (CA_BUNDLE to give another), as a build secret.
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
"${PODMAN[@]}" build --network host "${ULIMITS[@]}" --build-arg BASE="$BASE" \
  --secret id=ca-bundle,src="$CA_BUNDLE" \
  -f "$REPO/deploy/Containerfile" -t "$IMAGE" "$REPO"
echo "built $IMAGE"
