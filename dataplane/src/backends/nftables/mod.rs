//! The native nftables dataplane (`--dataplane nftables`, issue 19): the
//! same managers and model as the iptables dataplane, programmed as
//! nf_tables tables and sets over our own netlink messages.
//!
//! - [`translate`]: the managers' rules (iptables syntax from a strict
//!   token set) as nf_tables expressions; anything without a translation
//!   is refused whole. Every rule counts (a counter before its target).
//! - [`chains`]: the desired chains of one table, translated as they are
//!   set, with which changed and whether the table was reshaped.
//! - [`sets`]: the desired IP sets and their uncommitted deltas.
//! - [`plan`]: desired and observed in, one commit out ([`plan::plan`],
//!   every chain; [`plan::plan_changes`], the changes alone).
//! - [`dataplane`]: the backend (read back, plan, commit, adopt, repair).
//! - [`netlink`], [`ops`], [`expr`], [`intervals`] and `wire`: the nf_tables
//!   messages, tested against the kernel (`tests/nftables_netns.rs`,
//!   `tests/nftables_dataplane.rs`).
//!
//! # Owns
//! Tables named `<prefix>-raw`, `-mangle`, `-nat` and `-filter` (and any
//! other `<prefix>-…` table: an older layout's, removed) in the `ip` and
//! `ip6` families, with everything in them. Never another agent's table;
//! nothing is flushed at start: the tables are read back and adopted, and
//! only what differs is written (a restart that finds them right writes
//! nothing). On the refresh tick (`--iptables-refresh-seconds`,
//! `--ipset-refresh-seconds`) they are read again and what was changed by
//! hand is put back; those reads run on a thread of their own over a
//! second socket, beside the applies ([`dataplane`]). With `--dataplane
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
//! rules, so a read tells what is intact. Every IP set lives in the filter
//! table (where `nft list` finds it, and so a policy that starts using a
//! big set does not have to write it first); the other tables hold copies
//! of those their rules use. `hash:ip` and `hash:ip,port` sets are hash
//! sets of addresses or `addr . proto . port`; `hash:net` sets are
//! interval sets of merged ranges. Port lists are constant interval sets
//! named after their contents. An IP set id that `nft` cannot parse back
//! (`s:…`) is named by its hash (`SetNames::for_nftables`), so `nft list
//! ruleset` loads again with `nft -f`.
//!
//! # What each change costs
//! The kernel validates a table at commit when a change in it carries a
//! verdict (a rule with accept/drop/jump/goto or a mark set, a `goto` map
//! element), by walking every chain reachable from each of the table's
//! base chains (~0.23 µs per rule visited per hook); set elements and
//! deletions are not validated (`../shared/reference/nftables-validation.md`,
//! measured in the README's nftables section). So:
//!
//! | change | written as | validation walk |
//! |---|---|---|
//! | IP-set member added/removed | set elements (ranges for nets, by difference) | none |
//! | policy or profile changed | its chain flushed and written, in one commit | the table's |
//! | endpoint added/removed | its chains and the dispatch chains | the table's |
//! | nothing changed (refresh, restart) | nothing | none |
//!
//! Every commit, whatever it holds, also costs the kernel a pass over
//! every chain of every table in the namespace (`nf_tables_commit` makes
//! each chain's next rule generation current, changed or not): about
//! 3–4 ms at 30,000 chains here, measured as the commit time of a single
//! set element in the policy benchmark. Sharding does not change that
//! floor; only fewer chains do.
//!
//! One commit per apply for all tables of an IP version. When only chains'
//! rules and set members changed, the plan looks at those alone
//! ([`plan::plan_changes`]); otherwise at every chain. The walk is what is
//! left: at issue 4's scale (320,000 rules in filter) every rule-writing
//! commit walks all of filter. Sharding policy over several small tables
//! (each with its own base chains; "allowed" carried by the accept mark to
//! a last table; the dispatch as verdict maps) is the next step: measured
//! in `bench/src/bin/nftables.rs`, a rule in a small table costs ~1 ms
//! against ~26 ms in the big one. What that layout has to solve:
//! - a chain can only jump within its table, so a shard holds its
//!   endpoints' chains, a copy of every policy and profile chain they use,
//!   and a copy of every IP set those use (at issue 4's scale every set is
//!   used in every shard: 1M elements times the shards);
//! - an `accept` ends only its own table, so each accept before the shards
//!   (established flows, the ICMPv6 router exceptions, failsafes, what raw
//!   or mangle already accepted) has to become a mark the shards and the
//!   last table honour — a mark bit beyond Felix's accept/pass/scratch.
//!
//! Tried and measured, not kept: the workload dispatch as one verdict map
//! per direction (`iifname vmap`, a `goto` per interface) in place of the
//! prefix tree of interface rules. The walk got slower — the kernel
//! validates every element of a `goto` map from every hook that reaches
//! it: one policy change at 10,000 endpoints went from 96 to 152 ms — and
//! the packet path did not change (26,546 against 28,497 request/response
//! transactions a second). The policy benchmark at 100,000 members, same
//! day, both builds.

pub mod chains;
pub mod dataplane;
pub mod expr;
pub mod intervals;
pub mod netlink;
pub mod ops;
pub mod plan;
pub mod sets;
pub mod translate;
mod wire;

pub use dataplane::Dataplane;
