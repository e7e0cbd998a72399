# dphandler's container image: the daemon (`dphandler`) and `dphctl`.
#
#   docker build -t dphandler .
#
# Build stage: the workspace's toolchain (rust-version 1.95), as an
# unprivileged user. The XDP object is committed (bpf/filter.o): no clang.
FROM rust:1.95-bookworm AS build
RUN useradd --create-home --uid 10001 builder
USER builder
WORKDIR /home/builder/src
COPY --chown=builder:builder . .
RUN cargo build --release --locked --bin dphandler --bin dphctl

# Run stage: Debian slim with what the daemon runs at run time —
# iptables-save/-restore (nft and legacy: iptables), ipset, modprobe
# (kmod, for the conntrack modules), wireguard-go (where the kernel has no
# WireGuard), iproute2 (ip, bridge: for operators and the demo).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables ipset kmod wireguard-go iproute2 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /home/builder/src/target/release/dphandler /usr/local/bin/dphandler
COPY --from=build /home/builder/src/target/release/dphctl /usr/local/bin/dphctl
# Felix's DataplaneDriver (it runs the driver without arguments).
RUN ln -s dphctl /usr/local/bin/dphandler-felix-driver
ENTRYPOINT ["/usr/local/bin/dphandler", "serve"]
