//! The native nftables dataplane (`--dataplane nftables`, issue 19): work
//! in progress. Built so far: [`netlink`], our own nf_tables messages
//! over `netlink-sys` (tables; address, network and named-port
//! `addr . proto . port` sets with their elements; interface → verdict
//! maps (the dispatch); chains and rules from
//! [`expr`]essions; one batch per commit; tables, chains with their hooks,
//! rules with their handles and comments, sets and elements read back), and
//! [`intervals`], the calc graph's CIDRs as the disjoint ranges an
//! interval set holds, changed by difference; tested against the kernel
//! (`tests/nftables_netns.rs`). Nothing selects this backend yet.
//!
//! # Owns
//! Only tables whose names start with the daemon's prefix (`dph-…`), in
//! the `ip`, `ip6` and `inet` families; never another agent's table, and
//! nothing is flushed at start: a restart reads its tables back and
//! adopts them.
//!
//! # Design for the validation walk
//! The kernel validates a table at commit when a change in it carries a
//! verdict (a rule with accept/drop/jump/goto, a `goto` map element), by
//! walking every chain reachable from each of that table's base chains:
//! ~0.23 µs per rule visited per hook. Data-only changes (set elements,
//! data-map elements, `accept`/`drop` verdict-map elements) and deletions
//! are not validated. Measured on this project's machines (kernel 6.18):
//! an `accept` rule in a 3.3k-chain / 30k-rule table costs 7–13 ms of
//! kernel time per commit, the same rule in a small table 0.24 ms, a set
//! element 0.28 ms, a `goto` map element 14.7 ms. So:
//!
//! | change | how it is written | costs |
//! |---|---|---|
//! | IP-set member added/removed | a set element (hash sets; interval sets for nets, merged here, not by `nft`) | no walk: ~0.3 ms per commit |
//! | endpoint added/removed | an element of the dispatch verdict map (`iifname → goto <endpoint chain>` once its chain exists; removal is data-only) | a walk of the *dispatch shard* only |
//! | policy changed | its chain rewritten in the shard that holds it | a walk of that shard: shards are kept small (≤ ~2k rules), so ≤ ~0.5 ms |
//! | policy moved between endpoints | the endpoints' chains, in their shards | one walk per touched shard |
//!
//! Layout (per family; planned):
//! - *Shard tables* `dph-s<N>`, each with its own base chains at its own
//!   priority (`filter − 9 … filter − 1`) and a verdict map from interface
//!   to endpoint chain (a jump cannot cross tables, so each shard holds the
//!   chains of its endpoints and of the policies they use). An endpoint
//!   lives in exactly one shard, chosen by a hash of its interface name.
//! - A shard's verdict on a packet of one of its endpoints: `drop` is
//!   final (a drop in any table ends the packet); "allowed" sets the accept
//!   mark and `accept`s, which ends only that table.
//! - `dph-final` (priority filter + 1): packets of our endpoints without the
//!   accept mark are dropped (fail closed: an endpoint not yet in a shard's
//!   map is dropped here).
//! - Each chain is reached from one hook only (a graph reached from two
//!   hooks is walked twice): forward and input get separate shards.
//!
//! Next steps, in order: set names `nft` can print (it cannot parse a name
//! with `:`, as Calico's IP-set ids have); chains and rules (the
//! iptables renderer's rules as nft expressions); the shard tables and the
//! dispatch maps; the backend behind the managers (`--dataplane
//! nftables`); the policy suite and the benchmark on both backends.

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
