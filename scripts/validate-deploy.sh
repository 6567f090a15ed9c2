#!/usr/bin/env bash
# Offline checks of deploy/ (run by scripts/test.sh; needs root on a fresh
# Debian machine, installs what it uses):
#  1. the Helm chart is linted and rendered with Helm's own Go SDK (PyPI
#     helm-python-sdk, no helm binary), deploy/kubernetes/ must equal its
#     default rendering, and every object of it and of several value variants
#     is validated against the Kubernetes schemas (PyPI kubernetes-validate,
#     strict: unknown fields are errors) for each version in KUBE_VERSIONS;
#  2. a deliberately broken manifest must be rejected (the validator bites);
#  3. the init container's script runs against a scratch "node" with the real
#     dray binary, twice; the hosts.toml and drop-in it writes must be valid
#     TOML, and containerd 1.6 must load the drop-in through `imports`;
#  4. the rendered agent, snapshotter and tracker TOML are loaded by the real
#     dray binary (on loopback only);
#  5. the alert rules of deploy/prometheus pass `promtool check rules` and their
#     unit tests `promtool test rules`, and the dashboard's expressions parse
#     (validate.py checks that they all name metrics the code registers, and the
#     chart's monitoring objects, on and off, in step 1).
# `--update` first rewrites deploy/kubernetes/ from the chart.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

KUBE_VERSIONS=(1.29.0 1.33.0)
cache="${DRAY_VALIDATE_CACHE:-/var/cache/dray-validate}"
req=deploy/validate/requirements.txt
update=()
[ "${1:-}" = --update ] && update=(--update)

fail() { echo "validate-deploy: FAIL: $*" >&2; exit 1; }

# Debian packages: python3 with venv for the validators, containerd for its
# config loader, prometheus for promtool.
need=()
command -v python3 >/dev/null && python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3 python3-venv)
command -v containerd >/dev/null || need+=(containerd)
command -v promtool >/dev/null || need+=(prometheus)
if ((${#need[@]})); then
  [ "$(id -u)" -eq 0 ] || fail "missing ${need[*]}; run as root to install them"
  echo "== installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The pinned validators, in a venv keyed by the requirements file's hash.
venv="$cache/venv-$(sha256sum "$req" | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "== installing validators into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req"
  touch "$venv/.complete"
fi
py="$venv/bin/python"

work=$(mktemp -d /tmp/dray-validate.XXXXXX)
cleanup() {
  if [ -n "${pid:-}" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
kv=()
for v in "${KUBE_VERSIONS[@]}"; do kv+=(--kube-version "$v"); done

echo "== chart: lint, render, compare with deploy/kubernetes/, validate"
"$py" deploy/validate/validate.py "${kv[@]}" "${update[@]}" --extract "$work/rendered" \
  --dashboard-rules "$work/dashboard-rules.yaml"

echo "== alert rules and dashboard expressions: promtool $(promtool --version 2>&1 | awk 'NR == 1 {print $3}')"
promtool check rules deploy/prometheus/dray-alerts.yaml || fail "promtool check rules deploy/prometheus/dray-alerts.yaml"
(cd deploy/prometheus && promtool test rules dray-alerts.test.yaml) || fail "promtool test rules deploy/prometheus/dray-alerts.test.yaml"
promtool check rules "$work/dashboard-rules.yaml" >"$work/promtool-dashboard.log" 2>&1 ||
  fail "the dashboard's expressions do not parse: $(cat "$work/promtool-dashboard.log")"
echo "$(grep -c 'expr:' "$work/dashboard-rules.yaml") dashboard expressions parse"

echo "== broken manifests must be rejected"
# Each copy has one mistake: an unknown field (only strict checking sees it),
# and a port name where a number belongs.
broken() { # LABEL FIELD SED-SCRIPT
  sed -e "$3" deploy/kubernetes/agent-daemonset.yaml >"$work/broken-$1.yaml"
  cmp -s "$work/broken-$1.yaml" deploy/kubernetes/agent-daemonset.yaml && fail "could not break the $1 copy"
  if "$py" deploy/validate/validate.py "${kv[@]}" --only "$work/broken-$1.yaml" 2>"$work/broken-$1.err"; then
    fail "the validator accepted a DaemonSet with $1"
  fi
  grep -q "$2" "$work/broken-$1.err" || fail "the validator did not name $2: $(cat "$work/broken-$1.err")"
  echo "rejected $1: $(head -1 "$work/broken-$1.err")"
}
broken "an unknown field" hostNetwrk 's/^\(\s*\)hostNetwork: true/\1hostNetwork: true\n\1hostNetwrk: true/'
broken "a string port" containerPort 's/containerPort: 9464/containerPort: "admin"/'

# The dray binary: DRAY_BIN, else the release build scripts/test.sh just made.
dray="${DRAY_BIN:-${CARGO_TARGET_DIR:-/var/tmp/dray-target}/release/dray}"
if [ ! -x "$dray" ]; then
  echo "== building dray (release)"
  cargo build --release --bin dray -q
  dray="${CARGO_TARGET_DIR:-target}/release/dray"
fi

echo "== the init container's node-setup.sh on a scratch node"
r="$work/rendered"
node="$work/node"
mkdir -p "$node/etc/containerd" "$node/tls" "$node/setup"
cp "$r/containerd-dray.toml" "$node/setup/"
"$dray" ca init --dir "$node/ca" >/dev/null
# The registries, mirror and modes exactly as the DaemonSet passes them.
set -a
# shellcheck disable=SC1091
. "$r/node-setup.env"
set +a
[ -n "$REGISTRIES" ] || fail "the DaemonSet passes no REGISTRIES to node-setup"
# A registry with its own server, as values.yaml allows.
REGISTRIES="$REGISTRIES registry.internal:5000=http://registry.internal:5000"
# The chart's default (signer) places no certificate: the agent enrolls.
# issue mode is the one that writes files here, so the scratch node runs it.
TLS_MODE=issue
export NODE_NAME=node-a DRAY="$dray" CA_DIR="$node/ca" TLS_DIR="$node/tls" \
  SETUP_DIR="$node/setup" CONTAINERD_DIR="$node/etc/containerd" REGISTRIES TLS_MODE
for run in 1 2; do # twice: a restarted pod must succeed again
  sh "$r/node-setup.sh" >"$work/setup-$run.log" 2>&1 || fail "node-setup.sh run $run: $(cat "$work/setup-$run.log")"
done
grep -q "conf.d/dray.toml is up to date" "$work/setup-2.log" || fail "second node-setup run rewrote the drop-in"
for f in ca.crt agent.crt agent.key; do [ -s "$node/tls/$f" ] || fail "node-setup left no $f"; done
san=$("$py" - "$node/tls/agent.crt" <<'PY'
import sys, base64, re
pem = open(sys.argv[1]).read()
der = base64.b64decode("".join(re.findall(r"^[A-Za-z0-9+/=]+$", pem, re.M)))
print("node-a" if b"node-a" in der else "missing")
PY
)
[ "$san" = node-a ] || fail "the issued certificate does not name peer id node-a"

echo "== hosts.toml and the drop-in are valid TOML of the expected shape"
"$py" - "$node/etc/containerd" $REGISTRIES <<'PY'
import pathlib, sys, tomllib
base = pathlib.Path(sys.argv[1])
for entry in sys.argv[2:]:
    name, _, server = entry.partition("=")
    path = base / "certs.d" / name / "hosts.toml"
    doc = tomllib.loads(path.read_text())
    want = server or ("https://registry-1.docker.io" if name == "docker.io" else f"https://{name}")
    assert doc.get("server") == want, f"{path}: server is {doc.get('server')!r}, want {want!r}"
    hosts = doc.get("host", {})
    assert list(hosts) == ["http://127.0.0.1:5050"], f"{path}: hosts {list(hosts)}"
    assert hosts["http://127.0.0.1:5050"]["capabilities"] == ["pull", "resolve"], path
dropin = tomllib.loads((base / "conf.d/dray.toml").read_text())
assert dropin["proxy_plugins"]["dray"] == {"type": "snapshot", "address": "/run/dray/snapshotter.sock"}, dropin
assert set(dropin) == {"version", "proxy_plugins"}, f"the drop-in may only add proxy_plugins, has {set(dropin)}"
print(f"{len(sys.argv) - 2} hosts.toml files and conf.d/dray.toml parse")
PY

echo "== containerd $(containerd --version | awk '{print $3}') loads the drop-in through imports"
cat >"$node/etc/containerd/config.toml" <<TOML
version = 2
imports = ["$node/etc/containerd/conf.d/*.toml"]
root = "$work/containerd/root"
state = "$work/containerd/state"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "$node/etc/containerd/certs.d"
TOML
containerd --config "$node/etc/containerd/config.toml" config dump >"$work/dump.toml" 2>"$work/dump.err" ||
  fail "containerd rejected the config with the drop-in: $(cat "$work/dump.err")"
"$py" - "$work/dump.toml" <<'PY'
import sys, tomllib
dump = tomllib.load(open(sys.argv[1], "rb"))
got = dump.get("proxy_plugins", {}).get("dray")
assert got and got["type"] == "snapshot" and got["address"] == "/run/dray/snapshotter.sock", f"proxy_plugins.dray is {got!r}"
cri = dump["plugins"]["io.containerd.grpc.v1.cri"]
assert cri["registry"]["config_path"].endswith("certs.d"), "the drop-in clobbered the CRI registry section"
print("containerd's merged config has proxy_plugins.dray and keeps the CRI section")
PY
sh "$r/node-setup.sh" >"$work/setup-3.log" 2>&1
grep -q warning "$work/setup-3.log" && fail "node-setup warns about a complete config.toml: $(cat "$work/setup-3.log")"

echo "== the dray binary accepts the rendered configs"
# Loopback only: the rendered admin address is rewritten, the trackers replaced
# by a closed local port, the peer and mirror listeners set by flags.
sed 's/0\.0\.0\.0:/127.0.0.1:/' "$r/agent.toml" >"$work/agent.toml"
sed "s/0\.0\.0\.0:[0-9]*/127.0.0.1:0/; s|/etc/dray/tls|$work/tracker-tls|g" "$r/tracker.toml" >"$work/tracker.toml"
"$dray" ca issue --ca-dir "$node/ca" --tracker --name localhost --out "$work/tracker-tls" >/dev/null
sed "s|/run/dray|$work/run|g; s|/var/lib/dray|$work/state|g" "$r/snapshotter.toml" >"$work/snapshotter.toml"
# The scratch node ran issue mode (its files are in $node/tls); the rendered
# [enroll] section (tests/node_identity.rs runs enrollment) would dial the cluster
# name of the signer, so it is dropped here: nothing leaves loopback.
sed -i "s|/etc/dray/tls|$node/tls|g; s|/etc/dray/ca-bundle|$node/tls|g; s|/var/lib/dray|$work/state|; /^\[enroll\]/,/^token = /d" "$work/agent.toml"
mkdir -p "$work/run"
started() { # NAME CHECK COMMAND...: runs until the shell test CHECK passes (10 s at most)
  local what=$1 check=$2
  shift 2
  "$@" >"$work/$what.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    eval "$check" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  eval "$check" || fail "dray $what did not start with the rendered config: $(tail -5 "$work/$what.log")"
  kill "$pid" && wait "$pid" 2>/dev/null || true
  pid=
  echo "dray $what started with the rendered config"
}
started tracker 'grep -q listening "$work/tracker.log"' "$dray" tracker --config "$work/tracker.toml"
# The DaemonSet's DHT flags too (a bootstrap address nobody answers).
started agent 'grep -q "serving peers.*DHT on 127.0.0.1:" "$work/agent.log"' "$dray" agent --config "$work/agent.toml" \
  --tracker https://127.0.0.1:9 --peer-listen 127.0.0.1:0 --mirror-listen 127.0.0.1:0 \
  --dht-listen 127.0.0.1:0 --dht-bootstrap localhost:9
started snapshotter 'test -S "$work/run/snapshotter.sock"' "$dray" snapshotter --config "$work/snapshotter.toml"
echo "validate-deploy: all checks passed"
