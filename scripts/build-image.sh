#!/usr/bin/env bash
# Builds the dray OCI image with no container engine (umoci) and pushes it
# with skopeo:
#   scripts/build-image.sh [--binary PATH] [--layout DIR] [--insecure] REGISTRY
# The image is REGISTRY/dray:VERSION (VERSION from Cargo.toml): the name and
# tag deploy/ defaults to (image.repository=dray, tag = the chart's
# appVersion; set image.repository=REGISTRY/dray). REGISTRY is host[:port]
# with an optional path, e.g. registry.example/platform.
#
# Contents: the dray binary (glibc: the shared libraries `ldd` names and the
# loader are copied beside it) as /usr/bin/dray and the entrypoint; the
# busybox-static applets the chart's init script and probes use (/bin/sh, cp,
# mv, rm, mkdir, rmdir, chmod, cmp, grep, test); the host's CA bundle, for
# HTTPS registries.
#   --binary PATH  dray binary to package (default: the release build in
#                  $CARGO_TARGET_DIR or target/, built if missing)
#   --layout DIR   where the OCI layout is written (default: a temporary
#                  directory, removed afterwards)
#   --insecure     push over plain HTTP / without TLS verification
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "build-image: $*" >&2; exit 1; }

binary="" layout="" dest="" tls=()
while [ $# -gt 0 ]; do
  case $1 in
  --binary) binary=${2:?--binary needs a path}; shift 2 ;;
  --layout) layout=${2:?--layout needs a directory}; shift 2 ;;
  --insecure) tls=(--dest-tls-verify=false); shift ;;
  -h | --help) usage; exit 0 ;;
  -*) die "unknown option $1 (see --help)" ;;
  *) [ -z "$dest" ] || die "one registry only, got $dest and $1"; dest=$1; shift ;;
  esac
done
[ -n "$dest" ] || die "name the registry to push to, e.g. scripts/build-image.sh 127.0.0.1:5000"
for tool in umoci skopeo ldd; do
  command -v "$tool" >/dev/null || die "$tool is missing (Debian: apt-get install umoci skopeo libc-bin)"
done
busybox=$(command -v busybox || true)
[ -n "$busybox" ] && ! ldd "$busybox" >/dev/null 2>&1 ||
  die "a static busybox is needed (Debian: apt-get install busybox-static)"

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
[ -n "$version" ] || die "no workspace version in Cargo.toml"
if [ -z "$binary" ]; then
  binary="${CARGO_TARGET_DIR:-target}/release/dray"
  [ -x "$binary" ] || cargo build --release --bin dray
fi
[ -x "$binary" ] || die "$binary is not an executable"
"$binary" --version | grep -qx "dray $version" ||
  die "$binary is $("$binary" --version), not dray $version"

work=$(mktemp -d /tmp/dray-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
[ -n "$layout" ] || layout="$work/oci"
rm -rf "$layout"
image="$layout:$version"
umoci init --layout "$layout"
umoci new --image "$image"
umoci unpack --image "$image" "$work/bundle" >/dev/null
rootfs="$work/bundle/rootfs"
mkdir -p "$rootfs"/{bin,usr/bin,etc/ssl/certs,tmp,var/lib/dray,run/dray}
chmod 1777 "$rootfs/tmp"

install -m 0755 "$binary" "$rootfs/usr/bin/dray"
# Every library the dynamic loader resolves, and the loader itself, at the
# paths the binary names.
ldd "$binary" | awk '/=> \//{print $3} /^[[:space:]]*\//{print $1}' | while read -r lib; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
cp "$busybox" "$rootfs/bin/busybox"
for applet in sh cp mv rm mkdir rmdir chmod cmp grep test cat ls; do
  ln -s busybox "$rootfs/bin/$applet"
done
[ -f /etc/ssl/certs/ca-certificates.crt ] &&
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"

umoci repack --image "$image" "$work/bundle"
umoci config --image "$image" --os linux --architecture amd64 \
  --config.entrypoint /usr/bin/dray --config.cmd --help \
  --config.env PATH=/usr/bin:/bin \
  --config.label "org.opencontainers.image.title=dray" \
  --config.label "org.opencontainers.image.version=$version"
umoci gc --layout "$layout"

ref="$dest/dray:$version"
skopeo copy -q "${tls[@]}" "oci:$image" "docker://$ref"
echo "$ref"
