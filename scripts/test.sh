#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need on a fresh
# Debian machine (as root), then format check, clippy and every test in release
# mode (one build serves the tests and the benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."

# Share one build directory across checkouts so CI does not rebuild from clean.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/dray-target}"
export CARGO_TERM_COLOR=never

packages=(containerd runc docker-registry skopeo umoci busybox-static iproute2 curl apache2-utils prometheus pigz valgrind linux-perf)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: missing packages ${missing[*]}; run as root to install them" >&2
    exit 1
  fi
  echo "== installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --release --features dray/hostile -- -D warnings
echo "== cargo test"
cargo test --workspace --release --features dray/hostile -- --test-threads 1
echo "== deploy/ (offline manifest and chart checks)"
DRAY_BIN="$CARGO_TARGET_DIR/release/dray" ./scripts/validate-deploy.sh
