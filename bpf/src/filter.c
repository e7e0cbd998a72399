// SPDX-License-Identifier: Apache-2.0
//
// dphandler's XDP prefilter (Felix's felix/bpf-apache/filter.c, extended to
// IPv6): on a host interface, a packet to a failsafe port (protocol +
// destination port) passes; one whose source is in the interface's
// blocklist (an LPM trie per IP family) is dropped; everything else
// passes. Per-CPU counters of each verdict (packets, bytes).
//
// Maps are pinned by name in the interface's directory under bpffs, so a
// restarted daemon finds them (and the link) and takes over without a gap.
//
// The object is committed beside this file (filter.o); bpf/build.sh
// rebuilds it:
//   clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c filter.c -o filter.o

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

// Failsafe (protocol, destination port in host order).
struct failsafe_key {
	__u8 proto;
	__u8 pad;
	__u16 port;
};

struct lpm_v4 {
	__u32 prefixlen;
	__u8 addr[4];
};

struct lpm_v6 {
	__u32 prefixlen;
	__u8 addr[16];
};

struct verdict {
	__u64 packets;
	__u64 bytes;
};

enum {
	VERDICT_PASS = 0,     // not listed
	VERDICT_FAILSAFE = 1, // to a failsafe port
	VERDICT_DROP = 2,     // source listed
	VERDICT_COUNT = 3,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, struct failsafe_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} failsafe SEC(".maps");

// One value per entry (Felix keeps a reference count there; we keep the
// set of members in the daemon and write each prefix once).
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1048576);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_v4);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} blocklist_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1048576);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_v6);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} blocklist_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, VERDICT_COUNT);
	__type(key, __u32);
	__type(value, struct verdict);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} verdicts SEC(".maps");

static __always_inline int count(struct xdp_md *ctx, __u32 which, int action)
{
	struct verdict *v = bpf_map_lookup_elem(&verdicts, &which);
	if (v) {
		v->packets += 1;
		v->bytes += ctx->data_end - ctx->data;
	}
	return action;
}

// The destination port of a TCP or UDP header at l4, if it is whole.
static __always_inline int dport(void *l4, void *end, __u8 proto, __u16 *port)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *t = l4;
		if ((void *)(t + 1) > end)
			return 0;
		*port = bpf_ntohs(t->dest);
		return 1;
	}
	if (proto == IPPROTO_UDP) {
		struct udphdr *u = l4;
		if ((void *)(u + 1) > end)
			return 0;
		*port = bpf_ntohs(u->dest);
		return 1;
	}
	return 0;
}

static __always_inline int failsafe_port(__u8 proto, __u16 port)
{
	struct failsafe_key k = {.proto = proto, .pad = 0, .port = port};
	return bpf_map_lookup_elem(&failsafe, &k) != NULL;
}

SEC("xdp")
int prefilter(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	__u16 port;

	if ((void *)(eth + 1) > end)
		return count(ctx, VERDICT_PASS, XDP_PASS);

	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl < 5)
			return count(ctx, VERDICT_PASS, XDP_PASS);
		// Ports only in a first (or only) fragment.
		int first = (ip->frag_off & bpf_htons(0x1fff)) == 0;
		if (first && dport((void *)ip + ip->ihl * 4, end, ip->protocol, &port) &&
		    failsafe_port(ip->protocol, port))
			return count(ctx, VERDICT_FAILSAFE, XDP_PASS);
		struct lpm_v4 k = {.prefixlen = 32};
		__builtin_memcpy(k.addr, &ip->saddr, 4);
		if (bpf_map_lookup_elem(&blocklist_v4, &k))
			return count(ctx, VERDICT_DROP, XDP_DROP);
		return count(ctx, VERDICT_PASS, XDP_PASS);
	}

	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return count(ctx, VERDICT_PASS, XDP_PASS);
		// TCP or UDP right after the fixed header (extension headers are
		// not walked: such packets are not failsafe here, iptables'
		// failsafe rules still see them).
		if (dport((void *)(ip6 + 1), end, ip6->nexthdr, &port) &&
		    failsafe_port(ip6->nexthdr, port))
			return count(ctx, VERDICT_FAILSAFE, XDP_PASS);
		struct lpm_v6 k = {.prefixlen = 128};
		__builtin_memcpy(k.addr, &ip6->saddr, 16);
		if (bpf_map_lookup_elem(&blocklist_v6, &k))
			return count(ctx, VERDICT_DROP, XDP_DROP);
		return count(ctx, VERDICT_PASS, XDP_PASS);
	}

	return count(ctx, VERDICT_PASS, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
