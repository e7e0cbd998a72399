//! The native nftables dataplane (`--dataplane nftables`, issue 19): the
//! same managers and model as the iptables dataplane, programmed as
//! nf_tables tables and sets over our own netlink messages.
//!
//! - [`translate`]: the managers' rules (iptables syntax from a strict
//!   token set) as nf_tables expressions; anything without a translation
//!   is refused whole. Every rule counts (a counter before its target).
//! - [`chains`]: the desired chains of one table, translated as they are
//!   set, with which changed and whether the table was reshaped.
//! - [`shards`]: the filter table split: the workloads' policy in shard
//!   tables of its own (`--nftables-shards`).
//! - [`sets`]: the desired IP sets and their uncommitted deltas.
//! - [`plan`]: desired and observed in, one commit out; each table
//!   planned whole or from its changes alone.
//! - [`dataplane`]: the backend (read back, plan, commit, adopt, repair).
//! - [`read`]: our tables read back, all at once or table by table beside
//!   the commits (the refresh), and how a table's read is taken in while
//!   commits go on.
//! - [`netlink`], [`ops`], [`expr`], [`intervals`] and `wire`: the nf_tables
//!   messages, tested against the kernel (`tests/nftables_netns.rs`,
//!   `tests/nftables_dataplane.rs`).
//!
//! # Owns
//! Tables named `<prefix>-raw`, `-mangle`, `-nat`, `-filter` and the
//! shards `-filter-<n>` (and any other `<prefix>-…` table: an older
//! layout's, removed) in the `ip` and `ip6` families, with everything in
//! them. Never another agent's table;
//! nothing is flushed at start: the tables are read back and adopted, and
//! only what differs is written (a restart that finds them right writes
//! nothing). On the refresh tick (`--iptables-refresh-seconds`,
//! `--ipset-refresh-seconds`) they are read again and what was changed by
//! hand is put back; those reads run on a thread of their own over a
//! second socket, beside the applies, table by table, each taken in with
//! what our commits touched meanwhile as they wrote it ([`read`]). With `--dataplane
//! iptables` the daemon removes these tables once its own are in, and the
//! other way round ([`super::cleanup`]).
//!
//! # Layout
//! One table per iptables table, base chains where iptables-nft hooks them
//! (raw −300, mangle −150, nat −100/100 of type `nat`, filter 0), named
//! after the built-in chain and holding our hook rules; the managers'
//! chains as regular chains of the same names. Only chains a hook reaches
//! are programmed. Each rule carries its hash comment (`<prefix>:<hash>`,
//! chained over the chain's name as Felix does): equal comments, equal
//! rules, so a read tells what is intact. `hash:ip` and `hash:ip,port`
//! sets are hash sets of addresses or `addr . proto . port`; `hash:net`
//! sets are interval sets of merged ranges. Port lists are constant
//! interval sets named after their contents. An IP set id that `nft`
//! cannot parse back (`s:…`) is named by its hash
//! (`SetNames::for_nftables`), so `nft list ruleset` loads again with
//! `nft -f`.
//!
//! Filter is sharded ([`shards`], `--nftables-shards`, 32 by default):
//! each workload's endpoint chains live in one of the shard tables
//! `<prefix>-filter-<n>` (egress hooked at prerouting, priority −80,
//! after DNAT; ingress at forward, priority 10), with
//! copies of the policy and profile chains they jump to and of the IP
//! sets those look up. There an endpoint chain is a policy list chain
//! (`<prefix>tw-list-<hash>`, `fw-list-`), named by its rules: endpoints
//! with the same policies and profiles in a shard (a deployment's
//! replicas) share one, and a policy or profile chain that one list
//! chain alone uses in a shard is written into it, not copied
//! ([`shards`]' `inline`). A shard looks the interface up in a verdict
//! map and applies the endpoint's policy (a drop in any table is final):
//! egress once per packet in prerouting, which marks what it let on
//! "checked" for filter's egress dispatch to allow (and it drops the
//! rest: fail closed); ingress after filter's own dispatch marked the
//! packet "pending" (and allowed, so filter goes on as Felix's would),
//! with filter's end check (priority 20) dropping what no shard took. A new
//! interface goes to a shard that has its policy list chain already, else
//! to the shard its IP sets point at, so endpoints that look up the same
//! sets share a shard and each set is copied few times.
//! A set no rule looks up lives in filter (every set is somewhere; a big
//! one is not copied into filter as well); a table holds only the sets
//! its rules use. With 0 or 1 shard, or a mark mask without the two
//! pending bits, filter holds everything and every set, as before.

//! # What each change costs
//! The kernel validates a table at commit when a change in it carries a
//! verdict (a rule with accept/drop/jump/goto or a mark set, a `goto` map
//! element), by walking every chain reachable from each of the table's
//! base chains (~0.23 µs per rule visited per hook); set elements and
//! deletions are not validated (`../shared/reference/nftables-validation.md`,
//! measured in docs/performance.md, "nftables: what one commit costs"). So:
//!
//! | change | written as | validation walk |
//! |---|---|---|
//! | IP-set member added/removed | set elements, in each table that holds the set (ranges for nets, by difference) | none |
//! | policy or profile changed | its chain (and each shard's copy, or the list chain it is written into) flushed and written, in one commit | the shards whose endpoints use it (and filter, if a host endpoint does) |
//! | endpoint added | its interface's elements in its shard's two dispatch maps (`goto` its list chains), and the list chains unless the shard has them | its shard's (each list chain once: egress from prerouting, ingress from forward) |
//! | endpoint removed | its elements removed, and its list chains unless others there share them | none |
//! | endpoint's policies changed | its elements replaced, a new list chain unless one like it is there, the old one unless shared | its shard's |
//! | nothing changed (refresh, restart) | nothing | none |
//!
//! Every commit, whatever it holds, also costs the kernel a pass over
//! every chain of every table in the namespace (`nf_tables_commit` makes
//! each chain's next rule generation current, changed or not): 0.8 ms for
//! a set element next to 30,000 chains in `bench/src/bin/nftables.rs`,
//! 2–3 ms in the daemon at the policy benchmark's scale. Hence the shared
//! policy list chains, and the policies written into the one list chain
//! that uses them: fewer chains make every commit cheaper.
//!
//! One commit per apply for all tables of an IP version. Each table is
//! planned from its changes alone (`plan/changes.rs`): the chains whose
//! rules changed, the sets' new and gone members, and where a chain was
//! added, removed or pointed elsewhere, the chains its hooks reach now
//! made (with any IP set their rules look up that the table lacks, whole)
//! and those they no longer reach removed. A table is planned whole
//! (`plan/table.rs`: every chain its hooks reach, every set it holds)
//! when its hooks changed, after a read of it, and for filter (which holds every
//! set no shard uses) when a chain of it came or went. A set that only
//! removed chains looked up stays in a shard until its next whole plan
//! (at the latest after the next refresh read): its members cost an
//! element each there meanwhile. An endpoint coming or going touches its
//! shard only: filter's dispatch is one goto to the pending chain
//! whatever the interfaces; at 10,000 endpoints, of ~870 plans in 15 s of
//! churn, only the first was whole (before, ~150 planned a shard whole,
//! ~5 ms each).
//!
//! What the shards cost: the copies (policy chains and IP sets in each
//! shard that uses them: at issue 4's scale 10% more rules, and 1,684
//! sets for 1,000), a verdict-map lookup per shard for each packet to or
//! from a workload, and `nft list ruleset`: the kernel's family-wide rule
//! dump starts again from the first rule for each message, and across 17
//! tables (16 shards) that took 3 minutes at 10,000 endpoints against 11 s in one
//! table (`nft list table ip dph-filter-3`, one table, takes 0.3 s; the
//! daemon reads chain by chain). An operator who lists the whole ruleset
//! by hand often can run with `--nftables-shards 1`.
//!
//! Tried and measured, not kept: the workload dispatch of filter itself
//! (unsharded) as one verdict map per direction (`iifname vmap`, a `goto` per interface)
//! in place of the prefix tree of interface rules. The walk got slower —
//! the kernel validates every element of a `goto` map from every hook
//! that reaches it: one policy change at 10,000 endpoints went from 96 to
//! 152 ms — and the packet path did not change (26,546 against 28,497
//! request/response transactions a second). In a shard, where the walk is
//! small, the map is what keeps the other shards' cost per packet at one
//! lookup.

pub mod chains;
pub mod dataplane;
pub mod expr;
pub mod intervals;
pub mod netlink;
pub mod ops;
pub mod plan;
pub mod read;
pub mod sets;
pub mod shards;
pub mod translate;
mod wire;

pub use dataplane::Dataplane;
