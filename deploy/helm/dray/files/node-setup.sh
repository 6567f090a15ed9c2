#!/bin/sh
# The dray agent's init container: prepares one node before the agent starts.
#
# It DOES:
#   1. issue this node's peer certificate (peer id = the node name, the
#      certificate's DNS SAN) from the cluster CA mounted from a Secret if
#      TLS_MODE=issue; with TLS_MODE=provided it checks the files the node
#      already has; with TLS_MODE=signer (the default) the agent enrolls itself;
#   2. write containerd's hosts.toml for each mirrored registry with
#      `dray agent configure-containerd` (containerd re-reads these on every
#      pull: no restart needed once `config_path` is set);
#   3. install the proxy-snapshotter drop-in (proxy_plugins.dray) into
#      containerd's conf.d, when the snapshotter is enabled.
# It does NOT:
#   - restart containerd (the drop-in takes effect at containerd's next start;
#     the operator restarts it once, see docs/operator-guide.md);
#   - edit containerd's config.toml (imports, config_path, the CRI snapshotter):
#     an imported file replaces whole plugin sections, so the CRI settings
#     cannot be set safely from a drop-in. It only reports what is missing.
# Every step is idempotent: the pod may restart at any time.
set -eu

: "${NODE_NAME:?NODE_NAME must be set (the node name, from spec.nodeName)}"
DRAY="${DRAY:-dray}"
TLS_MODE="${TLS_MODE:-signer}"
CA_DIR="${CA_DIR:-/etc/dray/ca}"
TLS_DIR="${TLS_DIR:-/etc/dray/tls}"
SETUP_DIR="${SETUP_DIR:-/etc/dray/setup}"
CONTAINERD_DIR="${CONTAINERD_DIR:-/host/etc/containerd}"
MIRROR="${MIRROR:-http://127.0.0.1:5050}"
REGISTRIES="${REGISTRIES:-}"
SNAPSHOTTER="${SNAPSHOTTER:-true}"

log() { echo "dray node-setup: $*"; }
die() { echo "dray node-setup: error: $*" >&2; exit 1; }

# 1. This node's certificate.
case "$TLS_MODE" in
issue)
  [ -r "$CA_DIR/ca.crt" ] && [ -r "$CA_DIR/ca.key" ] ||
    die "TLS_MODE=issue needs ca.crt and ca.key in $CA_DIR (the CA Secret)"
  # `dray ca issue` refuses to overwrite, so issue into a fresh directory and
  # move the files into place: a restarted pod gets a fresh certificate.
  fresh="$TLS_DIR/.issue"
  rm -rf "$fresh"
  "$DRAY" ca issue --ca-dir "$CA_DIR" --peer-id "$NODE_NAME" --out "$fresh" >/dev/null ||
    die "could not issue a certificate for peer id '$NODE_NAME' (node names must be 1-63 lowercase letters, digits, '-' or '.')"
  for f in ca.crt agent.crt agent.key; do mv -f "$fresh/$f" "$TLS_DIR/$f"; done
  rmdir "$fresh"
  log "issued the peer certificate for $NODE_NAME"
  ;;
signer)
  log "the agent enrolls with the tracker's signer: no certificate to place"
  ;;
provided)
  for f in ca.crt agent.crt agent.key; do
    [ -s "$TLS_DIR/$f" ] || die "TLS_MODE=provided but $TLS_DIR/$f is missing or empty"
  done
  log "using the node's own certificate in $TLS_DIR"
  ;;
*) die "TLS_MODE must be 'signer', 'issue' or 'provided', not '$TLS_MODE'" ;;
esac

# 2. hosts.toml per mirrored registry (NAME or NAME=SERVER_URL, space-separated).
[ -d "$CONTAINERD_DIR" ] || die "$CONTAINERD_DIR is not a directory: is containerd's config dir mounted?"
if [ -n "$REGISTRIES" ]; then
  set --
  for r in $REGISTRIES; do set -- "$@" --registry "$r"; done
  "$DRAY" agent configure-containerd --config-path "$CONTAINERD_DIR/certs.d" --mirror "$MIRROR" "$@"
else
  log "no registries to mirror: hosts.toml left alone"
fi

# 3. The proxy-snapshotter drop-in, written beside and renamed into place.
dropin="$CONTAINERD_DIR/conf.d/dray.toml"
if [ "$SNAPSHOTTER" = true ]; then
  mkdir -p "$CONTAINERD_DIR/conf.d"
  if cmp -s "$SETUP_DIR/containerd-dray.toml" "$dropin"; then
    log "$dropin is up to date"
  else
    cp "$SETUP_DIR/containerd-dray.toml" "$dropin.dray-tmp"
    chmod 0644 "$dropin.dray-tmp"
    mv -f "$dropin.dray-tmp" "$dropin"
    log "wrote $dropin: containerd loads it at its next restart"
  fi
fi

# Report what only the operator may change in config.toml.
cfg="$CONTAINERD_DIR/config.toml"
if [ ! -f "$cfg" ]; then
  log "warning: $cfg not found: containerd runs on built-in defaults, which read no hosts.toml and no conf.d"
else
  grep -Eq '^[[:space:]]*config_path[[:space:]]*=' "$cfg" ||
    log "warning: $cfg sets no registry config_path: containerd ignores the hosts.toml files (see docs/operator-guide.md)"
  if [ "$SNAPSHOTTER" = true ]; then
    grep -Eq '^[[:space:]]*imports[[:space:]]*=.*conf\.d' "$cfg" ||
      log "warning: $cfg does not import conf.d/*.toml: the dray snapshotter is not registered with containerd"
  fi
fi
log "done"
