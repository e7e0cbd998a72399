#!/usr/bin/env bash
# The demo: the real dphandler server in a sandbox network namespace of its
# own, fed the bundled scenario through gRPC. Run as root on a fresh
# Debian/Ubuntu machine; installs the system packages it needs. The host's
# own network namespace is not touched.
set -euo pipefail
cd "$(dirname "$0")"
DPH_SKIP_BUF=1 DPH_SKIP_GRPCURL=1 DPH_SKIP_HELM=1 bash scripts/install-packages.sh
cargo build --release --locked --bin dphandler --bin dphctl
exec ./target/release/dphandler demo "$@"
