//! Hostile input against the real server in a namespace of its own: each
//! malformed or malicious message gets a rejection naming its field,
//! nothing of it reaches the kernel, and the stream and the rest of the
//! state go on. The cases are the table in docs/api.md ("Hostile input"), which
//! this test checks is in step with them. Needs root.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1;
use dphandler_tests::kernel::{our_rules, our_set};
use dphandler_tests::{Daemon, Netns, in_sync, ipset, msg, privileged, push, tempdir};

/// One hostile message: what it is, the message (JSON, as `dphctl push`
/// reads it), and the field its rejection must name.
struct Case {
    what: &'static str,
    json: String,
    field: &'static str,
}

fn case(what: &'static str, json: &str, field: &'static str) -> Case {
    Case {
        what,
        json: json.to_string(),
        field,
    }
}

/// A workload endpoint update whose `endpoint` is `ep` (JSON fields).
fn wep(ep: &str) -> String {
    format!(
        r#"{{"workloadEndpointUpdate":{{"id":{{"orchestratorId":"k8s","workloadId":"ns.pod","endpointId":"eth0"}},"endpoint":{{"state":"active","name":"cali1",{ep}}}}}}}"#
    )
}

/// A policy update with one inbound rule `rule` (JSON fields).
fn rule(rule: &str) -> String {
    format!(
        r#"{{"activePolicyUpdate":{{"id":{{"name":"default.p"}},"policy":{{"tier":"default","inboundRules":[{{"action":"allow",{rule}}}]}}}}}}"#
    )
}

fn cases() -> Vec<Case> {
    let long = "a".repeat(300);
    let huge: Vec<String> = (0..1_048_577u32)
        .map(|i| format!("\"10.{}.{}.{}\"", i >> 16, (i >> 8) & 255, i & 255))
        .collect();
    vec![
        // Ids and names that reach a kernel object's name or a comment.
        case(
            "IP set id with a newline and a rule after it",
            r#"{"ipsetUpdate":{"id":"s:a\n-A INPUT -j ACCEPT","members":[]}}"#,
            "ipset_update.id",
        ),
        case(
            "IP set id with a double quote",
            r#"{"ipsetUpdate":{"id":"s\"a","members":[]}}"#,
            "ipset_update.id",
        ),
        case(
            "IP set id with a space",
            r#"{"ipsetUpdate":{"id":"s a","members":[]}}"#,
            "ipset_update.id",
        ),
        case(
            "IP set id with a non-ASCII letter",
            r#"{"ipsetUpdate":{"id":"s:ä","members":[]}}"#,
            "ipset_update.id",
        ),
        case(
            "IP set id with a NUL byte",
            r#"{"ipsetUpdate":{"id":"s\u0000a","members":[]}}"#,
            "ipset_update.id",
        ),
        case(
            "IP set id empty",
            r#"{"ipsetUpdate":{"id":"","members":[]}}"#,
            "ipset_update.id",
        ),
        Case {
            what: "IP set id of 300 characters",
            json: format!(r#"{{"ipsetUpdate":{{"id":"{long}","members":[]}}}}"#),
            field: "ipset_update.id",
        },
        case(
            "IP set type unknown (9)",
            r#"{"ipsetUpdate":{"id":"s:t","type":9,"members":[]}}"#,
            "ipset_update.type",
        ),
        case(
            "IP set remove, id with a semicolon and a command",
            r#"{"ipsetRemove":{"id":"s;rm -rf /"}}"#,
            "ipset_remove.id",
        ),
        case(
            "IP set delta, id with a tab",
            r#"{"ipsetDeltaUpdate":{"id":"s\ta","addedMembers":["10.0.0.1"]}}"#,
            "ipset_delta_update.id",
        ),
        case(
            "policy name with a newline",
            r#"{"activePolicyUpdate":{"id":{"name":"p\nq"},"policy":{}}}"#,
            "active_policy_update.id.name",
        ),
        case(
            "policy namespace with a space",
            r#"{"activePolicyUpdate":{"id":{"name":"p","namespace":"a b"},"policy":{}}}"#,
            "active_policy_update.id.namespace",
        ),
        case(
            "policy tier with a backtick",
            r#"{"activePolicyUpdate":{"id":{"name":"p"},"policy":{"tier":"t`id`"}}}"#,
            "active_policy_update.policy.tier",
        ),
        case(
            "policy without an id",
            r#"{"activePolicyUpdate":{"policy":{}}}"#,
            "active_policy_update.id",
        ),
        case(
            "profile id with a double quote",
            r#"{"activeProfileUpdate":{"id":{"name":"prof\"x"},"profile":{}}}"#,
            "active_profile_update.id.name",
        ),
        case(
            "profile remove, id with a newline",
            r#"{"activeProfileRemove":{"id":{"name":"a\nb"}}}"#,
            "active_profile_remove.id.name",
        ),
        case(
            "workload orchestrator id with a newline",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s\n","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":"cali1"}}}"#,
            "workload_endpoint_update.id.orchestrator_id",
        ),
        case(
            "workload endpoint id with non-ASCII",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"ëth0"},"endpoint":{"state":"active","name":"cali1"}}}"#,
            "workload_endpoint_update.id.endpoint_id",
        ),
        case(
            "workload without an endpoint",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"}}}"#,
            "workload_endpoint_update.endpoint",
        ),
        case(
            "workload interface name of 16 bytes",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":"cali0123456789ab"}}}"#,
            "workload_endpoint_update.endpoint.name",
        ),
        case(
            "workload interface name with a slash",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":"cali/../x"}}}"#,
            "workload_endpoint_update.endpoint.name",
        ),
        case(
            "workload interface name with a space",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":"cali 1"}}}"#,
            "workload_endpoint_update.endpoint.name",
        ),
        case(
            "workload interface name empty",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":""}}}"#,
            "workload_endpoint_update.endpoint.name",
        ),
        Case {
            what: "workload state unknown",
            json: wep(r#""state":"bogus""#),
            field: "workload_endpoint_update.endpoint.state",
        },
        Case {
            what: "workload MAC not a MAC",
            json: wep(r#""mac":"zz:zz:zz:zz:zz:zz""#),
            field: "workload_endpoint_update.endpoint.mac",
        },
        Case {
            what: "workload profile id with a space",
            json: wep(r#""profileIds":["a b"]"#),
            field: "workload_endpoint_update.endpoint.profile_ids[0]",
        },
        Case {
            what: "workload tier name with a newline",
            json: wep(r#""tiers":[{"name":"t\n","ingressPolicies":[]}]"#),
            field: "workload_endpoint_update.endpoint.tiers[0].name",
        },
        Case {
            what: "workload tier's policy name with a quote",
            json: wep(r#""tiers":[{"name":"default","ingressPolicies":[{"name":"p'"}]}]"#),
            field: "workload_endpoint_update.endpoint.tiers[0].ingress_policies[0].name",
        },
        Case {
            what: "workload tier default action unknown",
            json: wep(r#""tiers":[{"name":"default","defaultAction":"Explode"}]"#),
            field: "workload_endpoint_update.endpoint.tiers[0].default_action",
        },
        Case {
            what: "workload tier listed twice",
            json: wep(r#""tiers":[{"name":"default"},{"name":"default"}]"#),
            field: "workload_endpoint_update.endpoint.tiers[1].name",
        },
        case(
            "host endpoint interface with a semicolon",
            r#"{"hostEndpointUpdate":{"id":{"endpointId":"h"},"endpoint":{"name":"eth0;x"}}}"#,
            "host_endpoint_update.endpoint.name",
        ),
        case(
            "host endpoint id with a newline",
            r#"{"hostEndpointUpdate":{"id":{"endpointId":"h\n"},"endpoint":{"name":"eth0"}}}"#,
            "host_endpoint_update.id.endpoint_id",
        ),
        case(
            "host endpoint expected address not an IP",
            r#"{"hostEndpointUpdate":{"id":{"endpointId":"h"},"endpoint":{"name":"eth0","expectedIpv4Addrs":["10.0.0.1; drop"]}}}"#,
            "host_endpoint_update.endpoint.expected_ipv4_addrs[0]",
        ),
        // Addresses and CIDRs.
        case(
            "IP set (net) member with host bits",
            r#"{"ipsetUpdate":{"id":"s:n","type":"NET","members":["10.0.0.1/24"]}}"#,
            "ipset_update.members[0]",
        ),
        case(
            "IP set (net) member prefix /33",
            r#"{"ipsetUpdate":{"id":"s:n","type":"NET","members":["10.0.0.0/33"]}}"#,
            "ipset_update.members[0]",
        ),
        case(
            "IP set (ip) member 10.0.0.256",
            r#"{"ipsetUpdate":{"id":"s:i","type":"IP","members":["10.0.0.1","10.0.0.256"]}}"#,
            "ipset_update.members[1]",
        ),
        case(
            "IP set (ip) member with a newline and an ipset command",
            r#"{"ipsetUpdate":{"id":"s:i","type":"IP","members":["10.0.0.1\nflush"]}}"#,
            "ipset_update.members[0]",
        ),
        case(
            "IP set (ip,port) member port 70000",
            r#"{"ipsetUpdate":{"id":"s:p","type":"IP_AND_PORT","members":["10.0.0.1,tcp:70000"]}}"#,
            "ipset_update.members[0]",
        ),
        case(
            "IP set (ip,port) member protocol foo",
            r#"{"ipsetUpdate":{"id":"s:p","type":"IP_AND_PORT","members":["10.0.0.1,foo:80"]}}"#,
            "ipset_update.members[0]",
        ),
        Case {
            what: "IP set of 1,048,577 members (over the most a set may hold)",
            json: format!(
                r#"{{"ipsetUpdate":{{"id":"s:huge","type":"IP","members":[{}]}}}}"#,
                huge.join(",")
            ),
            field: "ipset_update.members",
        },
        case(
            "IP set delta member not an IP",
            r#"{"ipsetDeltaUpdate":{"id":"s:canary","addedMembers":["not-an-ip"]}}"#,
            "ipset_delta_update.added_members[0]",
        ),
        case(
            "IP set delta for a set that does not exist",
            r#"{"ipsetDeltaUpdate":{"id":"s:nope","addedMembers":["10.0.0.1"]}}"#,
            "ipset_delta_update.id",
        ),
        case(
            "IP set delta (ip,port) member into an IP set",
            r#"{"ipsetDeltaUpdate":{"id":"s:canary","addedMembers":["10.0.0.1,tcp:80"]}}"#,
            "ipset_delta_update.added_members[0]",
        ),
        Case {
            what: "rule source net with host bits",
            json: rule(r#""srcNet":["10.0.0.1/8"]"#),
            field: "active_policy_update.policy.inbound_rules[0].src_net[0]",
        },
        Case {
            what: "rule destination net (IPv6) with host bits",
            json: rule(r#""dstNet":["fd00::1/64"]"#),
            field: "active_policy_update.policy.inbound_rules[0].dst_net[0]",
        },
        Case {
            what: "rule source net with a rule appended",
            json: rule(r#""srcNet":["10.0.0.0/8 -j ACCEPT"]"#),
            field: "active_policy_update.policy.inbound_rules[0].src_net[0]",
        },
        Case {
            what: "rule for IPv4 with an IPv6 net",
            json: rule(r#""ipVersion":"IPV4","srcNet":["fd00::/64"]"#),
            field: "active_policy_update.policy.inbound_rules[0].src_net",
        },
        Case {
            what: "rule IP version 5",
            json: rule(r#""ipVersion":5"#),
            field: "active_policy_update.policy.inbound_rules[0].ip_version",
        },
        Case {
            what: "workload IPv4 net that is IPv6",
            json: wep(r#""ipv4Nets":["fd00::1/128"]"#),
            field: "workload_endpoint_update.endpoint.ipv4_nets[0]",
        },
        Case {
            what: "workload IPv6 net that is IPv4",
            json: wep(r#""ipv6Nets":["10.65.0.1/32"]"#),
            field: "workload_endpoint_update.endpoint.ipv6_nets[0]",
        },
        Case {
            what: "workload IPv4 net with host bits",
            json: wep(r#""ipv4Nets":["10.65.0.1/24"]"#),
            field: "workload_endpoint_update.endpoint.ipv4_nets[0]",
        },
        Case {
            what: "workload NAT external IP truncated",
            json: wep(r#""ipv4Nat":[{"extIp":"10.0.0","intIp":"10.65.0.1"}]"#),
            field: "workload_endpoint_update.endpoint.ipv4_nat[0].ext_ip",
        },
        case(
            "IPAM pool CIDR with host bits",
            r#"{"ipamPoolUpdate":{"id":"p","pool":{"cidr":"10.65.0.1/16"}}}"#,
            "ipam_pool_update.pool.cidr",
        ),
        case(
            "route destination /40",
            r#"{"routeUpdate":{"dst":"10.0.0.0/40","dstNodeName":"n"}}"#,
            "route_update.dst",
        ),
        case(
            "route node IP not an IP",
            r#"{"routeUpdate":{"dst":"10.0.0.0/26","dstNodeName":"n","dstNodeIp":"10.0.0.1 via x"}}"#,
            "route_update.dst_node_ip",
        ),
        case(
            "VTEP MAC with seven octets",
            r#"{"vtepUpdate":{"node":"n","mac":"66:00:00:00:00:00:01","ipv4Addr":"10.65.1.0","parentDeviceIp":"192.168.0.2"}}"#,
            "vtep_update.mac",
        ),
        case(
            "VTEP IPv4 address that is IPv6",
            r#"{"vtepUpdate":{"node":"n","mac":"66:00:00:00:00:01","ipv4Addr":"fd00::1","parentDeviceIp":"192.168.0.2"}}"#,
            "vtep_update.ipv4_addr",
        ),
        case(
            "WireGuard public key not base64 of 32 bytes",
            r#"{"wireguardEndpointUpdate":{"hostname":"n","publicKey":"not-a-key"}}"#,
            "wireguard_endpoint_update.public_key",
        ),
        case(
            "host metadata IPv4 address not an IP",
            r#"{"hostMetadataUpdate":{"hostname":"n","ipv4Addr":"300.0.0.1"}}"#,
            "host_metadata_update.ipv4_addr",
        ),
        case(
            "service cluster IP not an IP",
            r#"{"serviceUpdate":{"name":"s","namespace":"n","clusterIps":["10.96.0.1 -j DNAT"]}}"#,
            "service_update.cluster_ips[0]",
        ),
        // Ports, protocols, ICMP and actions.
        Case {
            what: "rule destination port 65536",
            json: rule(r#""protocol":{"name":"tcp"},"dstPorts":[{"first":65536,"last":65536}]"#),
            field: "active_policy_update.policy.inbound_rules[0].dst_ports[0].first",
        },
        Case {
            what: "rule source port -1",
            json: rule(r#""protocol":{"name":"tcp"},"srcPorts":[{"first":-1,"last":80}]"#),
            field: "active_policy_update.policy.inbound_rules[0].src_ports[0].first",
        },
        Case {
            what: "rule port range reversed (90-80)",
            json: rule(r#""protocol":{"name":"tcp"},"dstPorts":[{"first":90,"last":80}]"#),
            field: "active_policy_update.policy.inbound_rules[0].dst_ports[0]",
        },
        Case {
            what: "rule ports with protocol icmp",
            json: rule(r#""protocol":{"name":"icmp"},"dstPorts":[{"first":80,"last":80}]"#),
            field: "active_policy_update.policy.inbound_rules[0].protocol",
        },
        Case {
            what: "rule protocol name tcpx",
            json: rule(r#""protocol":{"name":"tcpx"}"#),
            field: "active_policy_update.policy.inbound_rules[0].protocol.name",
        },
        Case {
            what: "rule protocol name with a space and a match",
            json: rule(r#""protocol":{"name":"tcp -m"}"#),
            field: "active_policy_update.policy.inbound_rules[0].protocol.name",
        },
        Case {
            what: "rule protocol number 256",
            json: rule(r#""protocol":{"number":256}"#),
            field: "active_policy_update.policy.inbound_rules[0].protocol.number",
        },
        Case {
            what: "rule ICMP type 256",
            json: rule(r#""protocol":{"name":"icmp"},"icmpType":256"#),
            field: "active_policy_update.policy.inbound_rules[0].icmp_type.type",
        },
        Case {
            what: "rule ICMP code 300",
            json: rule(r#""protocol":{"name":"icmp"},"icmpTypeCode":{"type":3,"code":300}"#),
            field: "active_policy_update.policy.inbound_rules[0].icmp_type.code",
        },
        Case {
            what: "rule action accept (not a Calico action)",
            json: rule(r#""srcNet":["10.0.0.0/8"]"#)
                .replace(r#""action":"allow""#, r#""action":"accept""#),
            field: "active_policy_update.policy.inbound_rules[0].action",
        },
        Case {
            what: "rule IP set id with a newline",
            json: rule(r#""srcIpSetIds":["s\n-j ACCEPT"]"#),
            field: "active_policy_update.policy.inbound_rules[0].src_ip_set_ids[0]",
        },
        Case {
            what: "rule id with a quote",
            json: rule(r#""ruleId":"r\"1""#),
            field: "active_policy_update.policy.inbound_rules[0].rule_id",
        },
        // What a careless feeder sent (issue 38; tests/probes.rs replays
        // each against the loop, the kernel and the daemon's memory).
        case(
            "refresh interval of 9.3e18 seconds (the loop's timer overflowed)",
            r#"{"configUpdate":{"config":{"IptablesRefreshInterval":"9300000000000000000"}}}"#,
            "config_update.config[IptablesRefreshInterval]",
        ),
        case(
            "workload endpoint on the uplink (eth0)",
            r#"{"workloadEndpointUpdate":{"id":{"orchestratorId":"k8s","workloadId":"w","endpointId":"e"},"endpoint":{"state":"active","name":"eth0"}}}"#,
            "workload_endpoint_update.endpoint.name",
        ),
        Case {
            what: "workload net 0.0.0.0/0 (the node's default route)",
            json: wep(r#""ipv4Nets":["0.0.0.0/0"]"#),
            field: "workload_endpoint_update.endpoint.ipv4_nets[0]",
        },
        Case {
            what: "workload net 127.0.0.1/32",
            json: wep(r#""ipv4Nets":["127.0.0.1/32"]"#),
            field: "workload_endpoint_update.endpoint.ipv4_nets[0]",
        },
        case(
            "route for a local block of 0.0.0.0/0 (a default blackhole)",
            r#"{"routeUpdate":{"types":4,"ipPoolType":2,"dst":"0.0.0.0/0","dstNodeName":"n"}}"#,
            "route_update.dst",
        ),
        case(
            "route to ::/0",
            r#"{"routeUpdate":{"types":1,"ipPoolType":2,"dst":"::/0","dstNodeName":"n"}}"#,
            "route_update.dst",
        ),
        Case {
            what: "policy of 10,001 empty rules",
            json: format!(
                r#"{{"activePolicyUpdate":{{"id":{{"name":"default.big"}},"policy":{{"inboundRules":[{}]}}}}}}"#,
                vec!["{}"; 10_001].join(",")
            ),
            field: "active_policy_update.policy.inbound_rules",
        },
        Case {
            what: "rule naming 65 IP sets (a rule past 64 KiB)",
            json: rule(&format!(
                r#""srcIpSetIds":[{}]"#,
                (0..65)
                    .map(|i| format!("\"s:{i}\""))
                    .collect::<Vec<_>>()
                    .join(",")
            )),
            field: "active_policy_update.policy.inbound_rules[0]",
        },
        Case {
            what: "IP set id of 70,000 characters (cut short in the reason)",
            json: format!(
                r#"{{"ipsetUpdate":{{"id":"{}","members":[]}}}}"#,
                "a".repeat(70_000)
            ),
            field: "ipset_update.id",
        },
    ]
}

fn parse(json: &str) -> Result<Payload> {
    let mut msgs = dphandler_proto::text::parse_to_dataplane(json).context("the case's JSON")?;
    if msgs.len() != 1 {
        bail!("{} messages in one case", msgs.len());
    }
    msgs.remove(0).payload.context("a payload")
}

/// Everything of ours the kernel holds: rules of every table in both
/// families, and our IP sets (`ipset` or, for nftables, in the tables).
fn kernel(ns: &Netns) -> Result<String> {
    let mut out = String::new();
    for v6 in [false, true] {
        for t in ["raw", "mangle", "nat", "filter"] {
            out.push_str(&our_rules(ns, v6, t)?);
        }
    }
    if !dphandler_tests::kernel::nftables() {
        let sets = ns.run("ipset", &["save"])?;
        out.push_str(&String::from_utf8_lossy(&sets.stdout));
    }
    Ok(out)
}

#[tokio::test]
async fn hostile_messages_are_rejected_by_field_and_nothing_reaches_the_kernel() -> Result<()> {
    let cases = cases();
    // The table in docs/api.md ("Hostile input") is this list.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.md"))?;
    let rows: Vec<String> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| format!("| {} | {} | `{}` |", i + 1, c.what, c.field))
        .collect();
    assert!(
        rows.iter().all(|r| readme.contains(r.as_str())),
        "docs/api.md's table should read:\n{}",
        rows.join("\n")
    );
    assert!(cases.len() >= 60, "{} cases", cases.len());
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("hostile")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;

    // A state to keep: an IP set a policy uses, a profile, a workload.
    let baseline = |seq0: u64| -> Result<Vec<felix::ToDataplane>> {
        let mut m = vec![
            ipset("s:canary", &["10.9.0.1"]),
            parse(&rule(
                r#""protocol":{"name":"tcp"},"dstPorts":[{"first":80,"last":80}],"srcIpSetIds":["s:canary"]"#,
            ))?,
            parse(
                r#"{"activeProfileUpdate":{"id":{"name":"prof-a"},"profile":{"inboundRules":[{"action":"allow"}]}}}"#,
            )?,
            parse(&wep(
                r#""profileIds":["prof-a"],"ipv4Nets":["10.65.0.1/32"],"tiers":[{"name":"default","ingressPolicies":[{"name":"default.p"}]}]"#,
            ))?,
        ];
        m.push(in_sync());
        Ok(m.into_iter()
            .enumerate()
            .map(|(i, p)| msg(seq0 + i as u64, p))
            .collect())
    };
    let (rejected, _) = push(&mut client, baseline(1)?).await?;
    assert!(rejected.is_empty(), "the baseline is valid: {rejected:?}");
    let before = kernel(&ns)?;
    let status_before = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert!(
        before.contains("dph"),
        "the baseline is programmed:\n{before}"
    );

    // One stream: each hostile message followed by a valid one (the
    // baseline's IP set again, which changes nothing).
    let mut msgs = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let seq = 2 * i as u64 + 1;
        msgs.push(msg(seq, parse(&c.json).with_context(|| c.what)?));
        msgs.push(msg(seq + 1, ipset("s:canary", &["10.9.0.1"])));
    }
    let last = 2 * cases.len() as u64;
    let (rejected, programmed) = push(&mut client, msgs).await?;
    assert_eq!(programmed, last, "the stream went on to its end");
    let mut wrong = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let seq = 2 * i as u64 + 1;
        let got: Vec<&v1::Rejection> = rejected
            .iter()
            .filter(|r| r.sequence_number == seq)
            .collect();
        match got.as_slice() {
            [r] if r.field == c.field && !r.reason.is_empty() => {}
            _ => wrong.push(format!(
                "{} ({}): {:?}",
                i + 1,
                c.what,
                got.iter()
                    .map(|r| (&r.field, &r.reason))
                    .collect::<Vec<_>>()
            )),
        }
    }
    assert!(
        wrong.is_empty(),
        "not rejected by the expected field:\n{}",
        wrong.join("\n")
    );
    assert_eq!(
        rejected.len(),
        cases.len(),
        "only the hostile ones: {rejected:?}"
    );

    // Nothing reached the kernel or the state.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(kernel(&ns)?, before, "the kernel changed");
    let status_after = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(status_after.objects, status_before.objects);
    assert_eq!(status_after.failed_applies, status_before.failed_applies);

    // And a valid change still goes in.
    let delta = parse(r#"{"ipsetDeltaUpdate":{"id":"s:canary","addedMembers":["10.9.0.2"]}}"#)?;
    let (rejected, _) = push(&mut client, vec![msg(1, delta)]).await?;
    assert!(rejected.is_empty(), "{rejected:?}");
    let set = our_set(&ns, false, "dph40s:canary")?;
    assert!(set.contains("10.9.0.2"), "{set}");
    Ok(())
}

/// What the server answered a `ToDataplane` call whose request body is
/// `body` (raw gRPC frames): its `grpc-status` and `grpc-message`.
async fn raw_call(socket: &std::path::Path, body: Vec<u8>) -> Result<(String, String)> {
    raw_call_replies(socket, body).await.map(|(s, m, _)| (s, m))
}

/// [`raw_call`], with the replies the server sent before its status.
async fn raw_call_replies(
    socket: &std::path::Path,
    body: Vec<u8>,
) -> Result<(String, String, Vec<v1::ToDataplaneReply>)> {
    use prost::Message;
    let io = tokio::net::UnixStream::connect(socket).await?;
    let (h2, conn) = h2::client::handshake(io).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut h2 = h2.ready().await?;
    let req = http::Request::builder()
        .method("POST")
        .uri("http://localhost/dphandler.v1.Dataplane/ToDataplane")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (resp, mut send) = h2.send_request(req, false)?;
    send.send_data(bytes::Bytes::from(body), true)?;
    let resp = tokio::time::timeout(Duration::from_secs(10), resp).await??;
    let (parts, mut body) = resp.into_parts();
    let pick = |h: &http::HeaderMap| -> Option<(String, String)> {
        let s = h.get("grpc-status")?.to_str().ok()?.to_string();
        let m = h
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .unwrap_or_default();
        Some((s, percent_decoded(m)))
    };
    if let Some((s, m)) = pick(&parts.headers) {
        return Ok((s, m, Vec::new()));
    }
    let mut data = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), body.data()).await? {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let mut replies = Vec::new();
    let mut rest = data.as_slice();
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into()?) as usize;
        let frame = rest.get(5..5 + len).context("a reply cut short")?;
        replies.push(v1::ToDataplaneReply::decode(frame)?);
        rest = &rest[5 + len..];
    }
    let trailers = body.trailers().await?.context("no trailers")?;
    let (s, m) = pick(&trailers).context("no grpc-status in the trailers")?;
    Ok((s, m, replies))
}

/// `grpc-message` as sent: percent-encoded.
fn percent_decoded(m: &str) -> String {
    let b = m.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One gRPC frame: uncompressed, `len` announced, `payload` sent.
fn frame(len: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8];
    f.extend_from_slice(&len.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Frames no gRPC client sends: each ends its stream with a status that
/// says what was wrong, holds nothing of it, and the server goes on.
#[tokio::test]
async fn broken_frames_end_their_stream_and_nothing_else() -> Result<()> {
    use prost::Message;
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("frames")?;
    let d = Daemon::start(&ns, &socket, &[])?;
    let mut client = d.connect().await?;
    let good = msg(1, ipset("s:x", &["10.0.0.1"])).encode_to_vec();

    // Bytes that are not UTF-8 in the IP set's id (":" made 0xff).
    let at = good
        .windows(3)
        .position(|w| w == b"s:x")
        .context("the id in the encoding")?;
    // Each message is decoded on its own, after the limits are checked
    // on its bytes: one that cannot be is rejected like any invalid one,
    // and the stream goes on to the next.
    let mut bad = good.clone();
    bad[at + 1] = 0xff;
    let mut body = frame(bad.len() as u32, &bad);
    for next in [msg(2, ipset("s:y", &["10.0.0.2"])), msg(3, in_sync())] {
        let next = next.encode_to_vec();
        body.extend(frame(next.len() as u32, &next));
    }
    let (status, message, replies) = raw_call_replies(&socket, body).await?;
    eprintln!("not UTF-8: grpc-status {status}: {message}: {replies:?}");
    assert_eq!(status, "0", "{message}");
    let rejections: Vec<&v1::Rejection> = replies
        .iter()
        .filter_map(|r| match &r.kind {
            Some(v1::to_dataplane_reply::Kind::Rejected(x)) => Some(x),
            _ => None,
        })
        .collect();
    assert_eq!(rejections.len(), 1, "{replies:?}");
    assert_eq!(rejections[0].sequence_number, 1);
    assert!(
        rejections[0].reason.contains("UTF-8") && rejections[0].reason.contains("id"),
        "{:?}",
        rejections[0]
    );
    let received = replies.iter().find_map(|r| match &r.kind {
        Some(v1::to_dataplane_reply::Kind::Received(x)) => Some(x),
        _ => None,
    });
    assert_eq!(
        received.map(|r| (r.messages, r.rejected, r.last_accepted_sequence)),
        Some((3, 1, 3))
    );

    // A frame that announces 100 bytes and carries 10.
    let (status, message) = raw_call(&socket, frame(100, &good[..10])).await?;
    eprintln!("truncated: grpc-status {status}: {message}");
    assert_eq!(status, "13", "{message}");
    assert!(message.contains("EOF"), "{message}");

    // A frame that says it is compressed, with no compression agreed.
    let mut compressed = frame(good.len() as u32, &good);
    compressed[0] = 1;
    let (status, message) = raw_call(&socket, compressed).await?;
    eprintln!("compressed: grpc-status {status}: {message}");
    assert_eq!(status, "13", "{message}");
    assert!(message.contains("compressed"), "{message}");

    // Nothing of them is held but the valid messages after the first
    // (the set, then InSync: the first stream's snapshot), and a good
    // stream still works.
    let st = client
        .get_status(v1::GetStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(st.objects.get("ipset"), Some(&1), "{:?}", st.objects);
    let (rejected, programmed) = push(
        &mut client,
        vec![msg(1, ipset("s:x", &["10.0.0.1"])), msg(2, in_sync())],
    )
    .await?;
    assert!(rejected.is_empty() && programmed == 2, "{rejected:?}");
    Ok(())
}
