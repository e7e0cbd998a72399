//! nf_tables over netlink (`NETLINK_NETFILTER`), in our own messages on
//! `netlink-sys`: one batch per commit (the kernel applies it whole or not
//! at all, and validates each touched table once per commit), dumps to read
//! back. The `rustables` crate speaks the same protocol but is GPL-3.0,
//! which this Apache-2.0 project cannot ship linked in; `nft` is a process
//! (30–50 ms) per change and fetches whole interval sets.
//!
//! The socket: a commit of [`Op`]s (tables; address, named-port and
//! network sets and their elements; chains; rules from
//! [`super::expr`]essions) encoded as one batch, its replies read; and
//! dumps of tables, chains, rules, sets and elements. The messages'
//! bytes are the `wire` module's. Maps come with the policy layout (see the
//! module above).

use std::collections::BTreeMap;
use std::io;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::intervals::Range;
use super::ops::{ChainInfo, Family, Key, Op, RuleInfo, SetInfo, chunks, describe};
use super::wire::*;

// enum nf_tables_msg_types.
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_DESTROYCHAIN: u16 = 27;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_GETSET: u16 = 10;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_DESTROYTABLE: u16 = 26;
const NFT_MSG_DESTROYSET: u16 = 29;
const NFT_MSG_DESTROYSETELEM: u16 = 30;
// Attributes.
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFT_SET_MAP: u32 = 0x8;
const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
const NFTA_SET_USERDATA: u16 = 13;
/// nft's `BYTEORDER_HOST_ENDIAN`, as interface names are.
const KEY_BYTEORDER: u32 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
const NFT_SET_INTERVAL: u32 = 0x4;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
/// `NFT_GOTO` (−4) as the kernel sends it.
const NFT_GOTO: u32 = (-4i32) as u32;
/// How long a reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nf_tables netlink: {0}")]
    Io(#[source] io::Error),
    /// The kernel refused the commit (nothing of it applied): which
    /// change, and why. Retrying the same commit will fail the same way
    /// unless the kernel's state changed meanwhile.
    #[error("nf_tables refused {op}: {source}")]
    Refused {
        op: String,
        /// Which change of the commit (its index in the ops given).
        index: Option<usize>,
        #[source]
        source: io::Error,
    },
    #[error("nf_tables: {0}")]
    Protocol(String),
    /// A change too big for a netlink attribute (64 KiB): not sent. The
    /// same change fails the same way.
    #[error("{op}: an attribute of {len} bytes; netlink takes at most 65535")]
    TooLarge { op: String, len: usize },
    /// Commits (ours or another agent's) kept changing what a dump walks;
    /// a later read can succeed.
    #[error("nf_tables dump interrupted by commits {tries} times in a row")]
    Interrupted { tries: usize },
}

/// How often a dump that commits interrupted is made again before the
/// read fails (and is tried again later).
const DUMP_TRIES: usize = 5;

/// The rules of `table` in a rule dump's messages.
fn rule_infos(messages: &[Vec<u8>], table: &str) -> Vec<RuleInfo> {
    messages
        .iter()
        .map(|m| attrs(m))
        .filter(|a| get(a, NFTA_RULE_TABLE).map(string).as_deref() == Some(table))
        .map(|a| RuleInfo {
            chain: get(&a, NFTA_RULE_CHAIN).map(string).unwrap_or_default(),
            handle: get(&a, NFTA_RULE_HANDLE)
                .and_then(|h| <[u8; 8]>::try_from(h).ok())
                .map_or(0, u64::from_be_bytes),
            comment: get(&a, NFTA_RULE_USERDATA)
                .map(comment_of)
                .unwrap_or_default(),
        })
        .collect()
}

/// The receive buffer: more than the largest datagram the kernel makes
/// for a dump (32 KiB).
const RECV_BUF: usize = 64 * 1024;

/// A dump done: its data messages and whether a commit interrupted it.
type Dumped = Result<(Vec<Vec<u8>>, bool), NftError>;

/// The replies to one dump request, as they come.
#[derive(Debug)]
struct Dump {
    seq: u32,
    out: Vec<Vec<u8>>,
    interrupted: bool,
}

impl Dump {
    fn new(seq: u32) -> Self {
        Self {
            seq,
            out: Vec::new(),
            interrupted: false,
        }
    }

    /// Takes in one datagram; once the dump is done, its data messages
    /// and whether a commit interrupted it, or the kernel's error.
    fn take(&mut self, buf: &[u8]) -> Option<Dumped> {
        for m in messages(buf) {
            if m.seq != self.seq {
                continue; // a reply to an earlier request
            }
            self.interrupted |= m.flags & NLM_F_DUMP_INTR != 0;
            match m.ty {
                NLMSG_DONE => {
                    let out = std::mem::take(&mut self.out);
                    return Some(Ok((out, self.interrupted)));
                }
                NLMSG_ERROR => {
                    let code = m
                        .payload
                        .get(..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    return Some(Err(NftError::Io(io::Error::from_raw_os_error(-code))));
                }
                // Past the nfgenmsg.
                _ => self
                    .out
                    .push(m.payload.get(4..).unwrap_or_default().to_vec()),
            }
        }
        None
    }
}

/// Set elements: (key, is an interval end).
fn elements_attr(buf: &mut Vec<u8>, table: &str, set: &str, elements: &[(Key, bool)]) {
    attr_str(buf, NFTA_SET_ELEM_LIST_TABLE, table);
    attr_str(buf, NFTA_SET_ELEM_LIST_SET, set);
    nested(buf, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
        for (e, end) in elements {
            nested(b, NFTA_LIST_ELEM, |b| {
                nested(b, NFTA_SET_ELEM_KEY, |b| {
                    attr(b, NFTA_DATA_VALUE, &e.bytes());
                });
                if *end {
                    attr_u32(b, NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
                }
            });
        }
    });
}

/// A range as elements: its start, and its end flagged as one.
fn range_elements(ranges: &[Range]) -> Vec<(Key, bool)> {
    ranges
        .iter()
        .flat_map(|r| {
            std::iter::once((Key::Addr(r.start), false)).chain(r.end.map(|e| (Key::Addr(e), true)))
        })
        .collect()
}

/// A netlink socket to nf_tables in the caller's network namespace.
#[derive(Debug)]
pub struct NftNetlink {
    sock: Socket,
    seq: u32,
    /// The send buffer asked for so far.
    sndbuf: usize,
    /// Dumps of one object taken though a commit interrupted them.
    interrupted_taken: u64,
}

impl NftNetlink {
    pub fn open() -> Result<Self, NftError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(NftError::Io)?;
        sock.bind_auto().map_err(NftError::Io)?;
        sock.connect(&SocketAddr::new(0, 0)).map_err(NftError::Io)?;
        // A reply that never comes is an error, not a hang.
        nix::sys::socket::setsockopt(
            &sock,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(REPLY_TIMEOUT.as_secs() as _, 0),
        )
        .map_err(|e| NftError::Io(e.into()))?;
        Ok(Self {
            sock,
            seq: 1,
            sndbuf: 0,
            interrupted_taken: 0,
        })
    }

    /// One datagram from the kernel. The buffer is as large as the kernel
    /// makes a dump's datagrams: it sizes them to the largest read so far
    /// on the socket, up to 32 KiB. With `recv_from_full` (a peek, then a
    /// read of just what came) they stayed at one page, and the kernel
    /// walks a set or the family's chains again from the start for each
    /// datagram of a dump: a 100,000-element set took ~1 s to read.
    fn recv(&mut self) -> Result<Vec<u8>, NftError> {
        let mut buf = Vec::with_capacity(RECV_BUF);
        let n = self
            .sock
            .recv(&mut buf, nix::libc::MSG_TRUNC)
            .map_err(NftError::Io)?;
        if n > buf.len() {
            return Err(NftError::Protocol(format!(
                "a reply of {n} bytes, more than the {RECV_BUF} read"
            )));
        }
        Ok(buf)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// Applies `ops` as one transaction: all of them, or (on an error)
    /// none.
    pub fn commit(&mut self, ops: &[Op]) -> Result<(), NftError> {
        if ops.is_empty() {
            return Ok(());
        }
        let nft = |m: u16| (NFNL_SUBSYS_NFTABLES << 8) | m;
        let _ = take_oversized(); // none of ours
        let mut batch = message(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            self.next_seq(),
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        let first = self.seq.wrapping_add(1);
        // Each message's change (a large element list is several messages:
        // an attribute holds at most 64 KiB).
        let mut of_seq: Vec<usize> = Vec::new();
        let mut last = 0;
        for (i, op) in ops.iter().enumerate() {
            for chunk in chunks(op) {
                let seq = first.wrapping_add(of_seq.len() as u32);
                of_seq.push(i);
                let mut a = Vec::new();
                let (ty, flags, family) = encode_change(chunk.as_ref(), seq, &mut a);
                if let Some(len) = take_oversized() {
                    // Nothing is sent: an attribute's length would wrap.
                    return Err(NftError::TooLarge {
                        op: describe(op),
                        len,
                    });
                }
                last = batch.len();
                batch.extend(message(
                    nft(ty),
                    NLM_F_REQUEST | flags,
                    seq,
                    family.number(),
                    0,
                    &a,
                ));
            }
        }
        self.seq = first.wrapping_add(of_seq.len() as u32);
        // Only the last change asks for an ACK (errors come for any): an
        // ACK a change would overflow the socket at thousands of them.
        let flags = u16::from_ne_bytes([batch[last + 6], batch[last + 7]]) | NLM_F_ACK;
        batch[last + 6..last + 8].copy_from_slice(&flags.to_ne_bytes());
        let last_seq = first.wrapping_add(of_seq.len() as u32 - 1);
        batch.extend(message(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            self.next_seq(),
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        ));
        // The kernel takes a batch as one datagram: the socket's send
        // buffer must hold it (as `nft` makes it).
        if batch.len() + 4096 > self.sndbuf {
            self.sndbuf = (batch.len() + 4096).next_power_of_two();
            nix::sys::socket::setsockopt(
                &self.sock,
                nix::sys::socket::sockopt::SndBufForce,
                &self.sndbuf,
            )
            .map_err(|e| NftError::Io(e.into()))?;
        }
        self.sock.send(&batch, 0).map_err(NftError::Io)?;
        // The first error names its change; the last change's reply ends
        // the commit.
        let mut refused = None;
        loop {
            let buf = match self.recv() {
                Ok(buf) => buf,
                // All the kernel had to say came before.
                Err(_) if refused.is_some() => break,
                Err(e) => return Err(e),
            };
            let mut done = false;
            for Message {
                ty, seq, payload, ..
            } in messages(&buf)
            {
                let i = seq.wrapping_sub(first) as usize;
                if ty != NLMSG_ERROR || i >= of_seq.len() {
                    continue; // not a reply, or an earlier commit's late one
                }
                let code = payload
                    .get(..4)
                    .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                if code != 0 && refused.is_none() {
                    let index = of_seq.get(i).copied();
                    let op = index
                        .and_then(|i| ops.get(i))
                        .map_or_else(|| format!("seq {seq}"), describe);
                    refused = Some(NftError::Refused {
                        op,
                        index,
                        source: io::Error::from_raw_os_error(-code),
                    });
                }
                done |= seq == last_seq;
            }
            if done {
                break;
            }
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A dump that walks more than one object (the tables, or the chains
    /// of every table of the family: the kernel's chain dump does not
    /// filter by table): every data message's attributes. One that any
    /// commit landed in is made again, up to [`DUMP_TRIES`] times: an
    /// object added or removed meanwhile shifts where the dump goes on, so
    /// one could be skipped or seen twice.
    ///
    /// The kernel's `NLM_F_DUMP_INTR` alone does not tell: it compares the
    /// ruleset's generation when each datagram's part of the dump begins,
    /// so a commit that lands while a part walks the tables before ours
    /// (another agent's chains counted one short, ours then resumed one
    /// late) goes unflagged. Seen here: 3,001 of 3,000 chains, and a
    /// table read whose only chain came twice, the second time empty. So
    /// the generation (`NFT_MSG_GETGEN`) is read before and after, as
    /// `nft` does for its cache.
    fn dump(&mut self, ty: u16, family: Family, a: &[u8]) -> Result<Vec<Vec<u8>>, NftError> {
        for _ in 0..DUMP_TRIES {
            let before = self.generation()?;
            let (out, interrupted) = self.dump_once(ty, family, a)?;
            if !interrupted && self.generation()? == before {
                return Ok(out);
            }
        }
        Err(NftError::Interrupted { tries: DUMP_TRIES })
    }

    /// The ruleset's generation: every commit (anyone's) moves it.
    pub fn generation(&mut self) -> Result<u32, NftError> {
        let seq = self.next_seq();
        let m = message(
            (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
            NLM_F_REQUEST,
            seq,
            0,
            0,
            &[],
        );
        self.sock.send(&m, 0).map_err(NftError::Io)?;
        loop {
            let buf = self.recv()?;
            for m in messages(&buf) {
                if m.seq != seq {
                    continue; // a reply to an earlier request
                }
                if m.ty == NLMSG_ERROR {
                    let code = m
                        .payload
                        .get(..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    if code != 0 {
                        return Err(NftError::Io(io::Error::from_raw_os_error(-code)));
                    }
                    continue;
                }
                if m.ty == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
                    let a = attrs(m.payload.get(4..).unwrap_or_default());
                    return get(&a, NFTA_GEN_ID)
                        .map(be_u32)
                        .ok_or_else(|| NftError::Protocol("a generation without its id".into()));
                }
            }
        }
    }

    /// A dump of what one object of one table holds (a chain's rules, a
    /// table's sets, a set's elements), taken even if a commit interrupted
    /// it: the kernel goes on by position within that object, so only a
    /// commit that changed the object can have torn it, and the flag
    /// cannot tell one from a commit to any other table. The dataplane
    /// does not take a table that a commit of its own touched while it was
    /// being read; another agent's change to one of our tables is what a
    /// refresh puts back (a torn read of it makes a chain look changed,
    /// which is written whole, or a set miss an element, which is added
    /// again: no change). A read of a 100,000-element set takes ~1 s, so
    /// under 100 commits a second such a dump would never come back
    /// unflagged. (A hash set's elements can also be skipped or repeated,
    /// unflagged, while the kernel grows or shrinks its table in a worker
    /// after many were added or removed: the same repair, no change.)
    fn dump_within(&mut self, ty: u16, family: Family, a: &[u8]) -> Result<Vec<Vec<u8>>, NftError> {
        let (out, interrupted) = self.dump_once(ty, family, a)?;
        self.interrupted_taken += u64::from(interrupted);
        Ok(out)
    }

    /// Dumps of one object (a chain's rules, a table's sets, a set's elements) taken though a
    /// commit interrupted them, since the socket was opened.
    pub fn interrupted_taken(&self) -> u64 {
        self.interrupted_taken
    }

    /// One dump, and whether a commit interrupted it.
    fn dump_once(&mut self, ty: u16, family: Family, a: &[u8]) -> Dumped {
        let seq = self.next_seq();
        let m = message(
            (NFNL_SUBSYS_NFTABLES << 8) | ty,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            family.number(),
            0,
            a,
        );
        self.sock.send(&m, 0).map_err(NftError::Io)?;
        let mut dump = Dump::new(seq);
        loop {
            let buf = self.recv()?;
            if let Some(done) = dump.take(&buf) {
                return done;
            }
        }
    }

    /// The tables of `family`.
    pub fn tables(&mut self, family: Family) -> Result<Vec<String>, NftError> {
        Ok(self
            .dump(NFT_MSG_GETTABLE, family, &[])?
            .iter()
            .filter_map(|m| get(&attrs(m), NFTA_TABLE_NAME).map(string))
            .collect())
    }

    /// The sets of `table`.
    pub fn sets(&mut self, family: Family, table: &str) -> Result<Vec<SetInfo>, NftError> {
        let mut a = Vec::new();
        attr_str(&mut a, NFTA_SET_TABLE, table);
        Ok(set_infos(
            &self.dump_within(NFT_MSG_GETSET, family, &a)?,
            table,
        ))
    }

    /// The chains of `table`.
    pub fn chains(&mut self, family: Family, table: &str) -> Result<Vec<ChainInfo>, NftError> {
        Ok(self
            .chains_by_table(family)?
            .remove(table)
            .unwrap_or_default())
    }

    /// The chains of every table of `family`, by table: one dump (the
    /// kernel's chain dump does not filter by table, so every chain of
    /// the family comes back whatever is asked).
    pub fn chains_by_table(
        &mut self,
        family: Family,
    ) -> Result<BTreeMap<String, Vec<ChainInfo>>, NftError> {
        Ok(chain_infos(&self.dump(NFT_MSG_GETCHAIN, family, &[])?))
    }

    /// The rules of one chain, in order (a dump filtered to the chain: its
    /// cost grows with the chain, not the family).
    pub fn chain_rules(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
    ) -> Result<Vec<RuleInfo>, NftError> {
        self.rule_dump(family, table, chain)
    }

    /// The rules of `table` in one dump, in each chain's order; `None` if
    /// a commit (anyone's: the generation moved, or the kernel flagged it)
    /// landed in it (one dump of 320,000 rules took minutes with one-page
    /// datagrams: measured). A commit to another table can tear it
    /// without the kernel's flag (the caller reads chain by chain then):
    /// seen here (6.18), one read in five of a table of 300 rules came
    /// back unflagged with none of them while another agent added rules
    /// and chains to its table; with the generation checked, none in 15
    /// runs of the same test.
    /// And the kernel skips what it sent from the first rule on for each
    /// datagram, so it is for tables of a few thousand rules (a shard),
    /// not for one of 300,000.
    pub fn table_rules(
        &mut self,
        family: Family,
        table: &str,
    ) -> Result<Option<Vec<RuleInfo>>, NftError> {
        let mut a = Vec::new();
        attr_str(&mut a, NFTA_RULE_TABLE, table);
        let before = self.generation()?;
        let (out, interrupted) = self.dump_once(NFT_MSG_GETRULE, family, &a)?;
        let whole = !interrupted && self.generation()? == before;
        Ok(whole.then(|| rule_infos(&out, table)))
    }

    fn rule_dump(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
    ) -> Result<Vec<RuleInfo>, NftError> {
        let mut a = Vec::new();
        attr_str(&mut a, NFTA_RULE_TABLE, table);
        attr_str(&mut a, NFTA_RULE_CHAIN, chain);
        let out = self.dump_within(NFT_MSG_GETRULE, family, &a)?;
        Ok(rule_infos(&out, table))
    }

    /// The keys in set `set` of `table`.
    pub fn elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Key>, NftError> {
        Ok(self
            .raw_elements(family, table, set)?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    /// The ranges in interval set `set` of `table`.
    pub fn ranges(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Range>, NftError> {
        let mut addrs = Vec::new();
        for (k, end) in self.raw_elements(family, table, set)? {
            let Key::Addr(a) = k else {
                return Err(NftError::Protocol(format!(
                    "set {table}/{set} holds {k:?}: not an interval set of addresses"
                )));
            };
            addrs.push((a, end));
        }
        Ok(super::intervals::from_elements(addrs))
    }

    /// Each element's key, and whether it ends an interval.
    pub fn raw_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<(Key, bool)>, NftError> {
        Ok(self
            .entries(family, table, set)?
            .into_iter()
            .map(|(k, end, _)| (k, end))
            .collect())
    }

    /// Verdict map `set`'s entries: each key and the chain its element
    /// goes to (`""` for a verdict other than a goto: none of ours).
    pub fn verdicts(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<(Key, String)>, NftError> {
        Ok(self
            .entries(family, table, set)?
            .into_iter()
            .map(|(k, _, v)| (k, v.unwrap_or_default()))
            .collect())
    }

    /// Each element's key, whether it ends an interval, and (in a verdict
    /// map) the chain it goes to.
    fn entries(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<(Key, bool, Option<String>)>, NftError> {
        let mut a = Vec::new();
        attr_str(&mut a, NFTA_SET_ELEM_LIST_TABLE, table);
        attr_str(&mut a, NFTA_SET_ELEM_LIST_SET, set);
        element_entries(&self.dump_within(NFT_MSG_GETSETELEM, family, &a)?).map_err(|len| {
            NftError::Protocol(format!(
                "set {table}/{set}: a key of {len} bytes is none of ours"
            ))
        })
    }
}

/// The chains of every table in a chain dump's messages, by table.
fn chain_infos(messages: &[Vec<u8>]) -> BTreeMap<String, Vec<ChainInfo>> {
    let mut out: BTreeMap<String, Vec<ChainInfo>> = BTreeMap::new();
    for m in messages {
        let a = attrs(m);
        let Some(table) = get(&a, NFTA_CHAIN_TABLE).map(string) else {
            continue;
        };
        let hook = get(&a, NFTA_CHAIN_HOOK).map(|h| {
            let h = attrs(h);
            (
                get(&h, NFTA_HOOK_HOOKNUM).map_or(0, be_u32),
                get(&h, NFTA_HOOK_PRIORITY).map_or(0, be_u32) as i32,
            )
        });
        out.entry(table).or_default().push(ChainInfo {
            name: get(&a, NFTA_CHAIN_NAME).map(string).unwrap_or_default(),
            hook,
        });
    }
    out
}

/// The sets of `table` in a set dump's messages.
fn set_infos(messages: &[Vec<u8>], table: &str) -> Vec<SetInfo> {
    messages
        .iter()
        .map(|m| attrs(m))
        .filter(|a| get(a, NFTA_SET_TABLE).map(string).as_deref() == Some(table))
        .map(|a| SetInfo {
            name: get(&a, NFTA_SET_NAME).map(string).unwrap_or_default(),
            key_type: get(&a, NFTA_SET_KEY_TYPE).map_or(0, be_u32),
            key_len: get(&a, NFTA_SET_KEY_LEN).map_or(0, be_u32),
            flags: get(&a, NFTA_SET_FLAGS).map_or(0, be_u32),
        })
        .collect()
}

/// Each element of an element dump's messages: its key, whether it ends
/// an interval, and (in a verdict map) the chain it goes to; `Err(len)`
/// for a key of a length none of ours has.
fn element_entries(messages: &[Vec<u8>]) -> Result<Vec<(Key, bool, Option<String>)>, usize> {
    let mut out = Vec::new();
    for m in messages {
        let top = attrs(m);
        let Some(list) = get(&top, NFTA_SET_ELEM_LIST_ELEMENTS) else {
            continue;
        };
        for (t, elem) in attrs(list) {
            if t != NFTA_LIST_ELEM {
                continue;
            }
            let ea = attrs(elem);
            let Some(key) = get(&ea, NFTA_SET_ELEM_KEY) else {
                continue;
            };
            let end = get(&ea, NFTA_SET_ELEM_FLAGS)
                .is_some_and(|f| be_u32(f) & NFT_SET_ELEM_INTERVAL_END != 0);
            let Some(v) = get(&attrs(key), NFTA_DATA_VALUE) else {
                continue;
            };
            // A goto's chain; another verdict is none of ours.
            let goto = get(&ea, NFTA_SET_ELEM_DATA)
                .and_then(|d| get(&attrs(d), NFTA_DATA_VERDICT))
                .map(|v| {
                    let va = attrs(v);
                    let code = get(&va, NFTA_VERDICT_CODE).map(be_u32);
                    match (code, get(&va, NFTA_VERDICT_CHAIN)) {
                        (Some(NFT_GOTO), Some(c)) => string(c),
                        _ => String::new(),
                    }
                });
            out.push((Key::parse(v).ok_or(v.len())?, end, goto));
        }
    }
    Ok(out)
}

/// Takes `buf` as a datagram the kernel sent a reader, through every
/// decoder the reads use (the datagram's messages, a dump's end, chains,
/// sets, elements, rules, a generation): for the fuzz targets, which
/// check that no bytes make one panic. Returns how much was decoded.
pub fn decode_any(buf: &[u8]) -> usize {
    let msgs = messages(buf);
    let mut n = msgs.len();
    if let Some(first) = msgs.first() {
        let mut dump = Dump::new(first.seq);
        if let Some(Ok((out, _))) = dump.take(buf) {
            n += out.len();
        }
    }
    let payloads: Vec<Vec<u8>> = msgs
        .iter()
        .map(|m| m.payload.get(4..).unwrap_or_default().to_vec())
        .collect();
    n += chain_infos(&payloads).len();
    n += set_infos(&payloads, "dph-filter").len();
    n += element_entries(&payloads).map_or(0, |e| e.len());
    n += rule_infos(&payloads, "dph-filter").len();
    for p in &payloads {
        n += attrs(p).len();
        if let Some(id) = get(&attrs(p), NFTA_GEN_ID) {
            n += be_u32(id) as usize & 1;
        }
    }
    n
}

/// The comment in a rule's user data (nft's TLVs; type 0).
fn comment_of(mut udata: &[u8]) -> String {
    while udata.len() >= 2 {
        let (ty, len) = (udata[0], udata[1] as usize);
        let Some(v) = udata.get(2..2 + len) else {
            break;
        };
        if ty == 0 {
            return string(v);
        }
        udata = &udata[2 + len..];
    }
    String::new()
}

/// What a commit of `ops` would send, encoded as [`NftNetlink::commit`]
/// encodes it (without a socket): the bytes of its messages, or the
/// change too large to be said. For the fuzz targets and tests.
pub fn encode(ops: &[Op]) -> Result<Vec<u8>, NftError> {
    let _ = take_oversized();
    let mut out = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        for chunk in chunks(op) {
            let mut a = Vec::new();
            let (ty, flags, family) = encode_change(chunk.as_ref(), i as u32, &mut a);
            if let Some(len) = take_oversized() {
                return Err(NftError::TooLarge {
                    op: describe(op),
                    len,
                });
            }
            out.extend(message(
                (NFNL_SUBSYS_NFTABLES << 8) | ty,
                NLM_F_REQUEST | flags,
                i as u32,
                family.number(),
                0,
                &a,
            ));
        }
    }
    Ok(out)
}

/// One change of a commit, encoded: its message type, flags and family,
/// its attributes appended to `a`. `seq` is its message's sequence number
/// (a new set is named by it within the batch).
fn encode_change(chunk: &Op, seq: u32, a: &mut Vec<u8>) -> (u16, u16, Family) {
    match chunk {
        Op::AddTable { family, table } => {
            attr_str(a, NFTA_TABLE_NAME, table);
            (NFT_MSG_NEWTABLE, NLM_F_CREATE, *family)
        }
        Op::DestroyTable { family, table } => {
            attr_str(a, NFTA_TABLE_NAME, table);
            (NFT_MSG_DESTROYTABLE, 0, *family)
        }
        Op::AddSet {
            family,
            table,
            set,
            key,
            interval,
        } => {
            let (ty, len) = key.code();
            attr_str(a, NFTA_SET_TABLE, table);
            attr_str(a, NFTA_SET_NAME, set);
            let flags = if *interval { NFT_SET_INTERVAL } else { 0 };
            attr_u32(a, NFTA_SET_FLAGS, flags);
            attr_u32(a, NFTA_SET_KEY_TYPE, ty);
            attr_u32(a, NFTA_SET_KEY_LEN, len);
            attr_u32(a, NFTA_SET_ID, seq);
            (NFT_MSG_NEWSET, NLM_F_CREATE, *family)
        }
        Op::DestroySet { family, table, set } => {
            attr_str(a, NFTA_SET_TABLE, table);
            attr_str(a, NFTA_SET_NAME, set);
            (NFT_MSG_DESTROYSET, 0, *family)
        }
        Op::AddVerdictMap {
            family,
            table,
            map,
            key,
        } => {
            let (ty, len) = key.code();
            attr_str(a, NFTA_SET_TABLE, table);
            attr_str(a, NFTA_SET_NAME, map);
            attr_u32(a, NFTA_SET_FLAGS, NFT_SET_MAP);
            attr_u32(a, NFTA_SET_KEY_TYPE, ty);
            attr_u32(a, NFTA_SET_KEY_LEN, len);
            attr_u32(a, NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
            attr_u32(a, NFTA_SET_ID, seq);
            // For `nft` to print the keys: their byte order in
            // its user data (libnftnl's KEYBYTEORDER TLV).
            let mut udata = vec![0u8, 4];
            udata.extend(KEY_BYTEORDER.to_ne_bytes());
            attr(a, NFTA_SET_USERDATA, &udata);
            (NFT_MSG_NEWSET, NLM_F_CREATE, *family)
        }
        Op::AddVerdicts {
            family,
            table,
            map,
            entries,
        } => {
            attr_str(a, NFTA_SET_ELEM_LIST_TABLE, table);
            attr_str(a, NFTA_SET_ELEM_LIST_SET, map);
            nested(a, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
                for (k, v) in entries {
                    nested(b, NFTA_LIST_ELEM, |b| {
                        nested(b, NFTA_SET_ELEM_KEY, |b| {
                            attr(b, NFTA_DATA_VALUE, &k.bytes());
                        });
                        nested(b, NFTA_SET_ELEM_DATA, |b| super::expr::verdict_data(b, v));
                    });
                }
            });
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE, *family)
        }
        Op::AddElements {
            family,
            table,
            set,
            elements,
        } => {
            let e: Vec<_> = elements.iter().map(|e| (*e, false)).collect();
            elements_attr(a, table, set, &e);
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE, *family)
        }
        Op::AddRanges {
            family,
            table,
            set,
            ranges,
        } => {
            elements_attr(a, table, set, &range_elements(ranges));
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE, *family)
        }
        Op::AddIntervals {
            family,
            table,
            set,
            elements,
        }
        | Op::DestroyIntervals {
            family,
            table,
            set,
            elements,
        } => {
            elements_attr(a, table, set, elements);
            if matches!(chunk, Op::AddIntervals { .. }) {
                (NFT_MSG_NEWSETELEM, NLM_F_CREATE, *family)
            } else {
                (NFT_MSG_DESTROYSETELEM, 0, *family)
            }
        }
        Op::DestroyRanges {
            family,
            table,
            set,
            ranges,
        } => {
            elements_attr(a, table, set, &range_elements(ranges));
            (NFT_MSG_DESTROYSETELEM, 0, *family)
        }
        Op::AddChain {
            family,
            table,
            chain,
            base,
        } => {
            attr_str(a, NFTA_CHAIN_TABLE, table);
            attr_str(a, NFTA_CHAIN_NAME, chain);
            if let Some(b) = base {
                nested(a, NFTA_CHAIN_HOOK, |h| {
                    attr_u32(h, NFTA_HOOK_HOOKNUM, b.hook as u32);
                    attr(h, NFTA_HOOK_PRIORITY, &b.priority.to_be_bytes());
                });
                attr_u32(a, NFTA_CHAIN_POLICY, u32::from(b.accept_by_default));
                attr_str(a, NFTA_CHAIN_TYPE, if b.nat { "nat" } else { "filter" });
            }
            (NFT_MSG_NEWCHAIN, NLM_F_CREATE, *family)
        }
        Op::DestroyChain {
            family,
            table,
            chain,
        } => {
            attr_str(a, NFTA_CHAIN_TABLE, table);
            attr_str(a, NFTA_CHAIN_NAME, chain);
            (NFT_MSG_DESTROYCHAIN, 0, *family)
        }
        Op::DeleteRule {
            family,
            table,
            chain,
            handle,
        } => {
            attr_str(a, NFTA_RULE_TABLE, table);
            attr_str(a, NFTA_RULE_CHAIN, chain);
            attr(a, NFTA_RULE_HANDLE, &handle.to_be_bytes());
            (NFT_MSG_DELRULE, 0, *family)
        }
        Op::FlushChain {
            family,
            table,
            chain,
        } => {
            attr_str(a, NFTA_RULE_TABLE, table);
            attr_str(a, NFTA_RULE_CHAIN, chain);
            (NFT_MSG_DELRULE, 0, *family)
        }
        Op::AddRule {
            family,
            table,
            chain,
            exprs,
            comment,
        } => {
            attr_str(a, NFTA_RULE_TABLE, table);
            attr_str(a, NFTA_RULE_CHAIN, chain);
            attr(
                a,
                NFTA_RULE_EXPRESSIONS | NLA_F_NESTED,
                &super::expr::encode(exprs),
            );
            if !comment.is_empty() {
                // nft's user data: a TLV, type 0 (comment),
                // NUL-terminated.
                // At most 127 bytes, as nft allows.
                let mut end = comment.len().min(127);
                while !comment.is_char_boundary(end) {
                    end -= 1;
                }
                let mut c = comment.as_bytes()[..end].to_vec();
                c.push(0);
                let mut udata = vec![0u8, c.len() as u8];
                udata.extend(c);
                attr(a, NFTA_RULE_USERDATA, &udata);
            }
            (NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, *family)
        }
        Op::DestroyElements {
            family,
            table,
            set,
            elements,
        } => {
            let e: Vec<_> = elements.iter().map(|e| (*e, false)).collect();
            elements_attr(a, table, set, &e);
            (NFT_MSG_DESTROYSETELEM, 0, *family)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The widest rule the edge takes (every match that must hold in one
    /// rule, with the longest set names) fits a netlink attribute; ten
    /// times as many are refused, never sent with a wrapped length.
    #[test]
    fn the_widest_rule_the_edge_takes_fits_and_a_wider_one_is_refused() {
        let rule = |n: usize| {
            let mut t = vec!["-p".to_string(), "tcp".into()];
            for i in 0..n {
                t.extend(
                    ["-m", "set", "!", "--match-set"]
                        .map(String::from)
                        .into_iter()
                        .chain([format!("dph40_{i:0>25}"), "src".into()]),
                );
            }
            t.extend(["-j".into(), "DROP".into()]);
            t.join(" ")
        };
        let op = |n: usize| Op::AddRule {
            family: Family::Ip,
            table: "dph-filter".into(),
            chain: "dph-pi-x".into(),
            exprs: super::super::translate::translate(&rule(n), false)
                .unwrap()
                .exprs
                .clone(),
            comment: "dph:0123456789abcdef".into(),
        };
        let max = crate::model::policy::MAX_INLINE_MATCHES;
        let bytes = encode(&[op(max)]).unwrap();
        eprintln!("a rule of {max} set lookups: {} bytes", bytes.len());
        assert!(bytes.len() < 64 << 10, "{} bytes", bytes.len());
        let e = encode(&[op(10 * max)]).unwrap_err();
        assert!(matches!(e, NftError::TooLarge { .. }), "{e}");
    }

    /// A data message of dump `seq` carrying `payload`, flagged `flags`.
    fn data(seq: u32, flags: u16, payload: &[u8]) -> Vec<u8> {
        message(
            (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN,
            flags,
            seq,
            2,
            0,
            payload,
        )
    }

    fn done(seq: u32, flags: u16) -> Vec<u8> {
        message(NLMSG_DONE, flags, seq, 0, 0, &[])
    }

    /// A dump's data comes back once it is done, across datagrams; replies
    /// to another request are skipped.
    #[test]
    fn a_dump_gathers_its_messages_until_done() {
        let mut d = Dump::new(7);
        let first = [data(6, 0, &[9; 4]), data(7, 0, &[1; 4])].concat();
        assert!(d.take(&first).is_none());
        let last = [data(7, 0, &[2; 4]), done(7, 0)].concat();
        let (out, interrupted) = d.take(&last).unwrap().unwrap();
        assert_eq!(out, [vec![1; 4], vec![2; 4]]);
        assert!(!interrupted);
    }

    /// A dump a commit interrupted (one message flagged, or only the last)
    /// is reported as such (a walk of several objects is made again, not
    /// taken as what the kernel holds).
    #[test]
    fn an_interrupted_dump_is_reported() {
        let mut d = Dump::new(3);
        assert!(d.take(&data(3, NLM_F_DUMP_INTR, &[1; 4])).is_none());
        assert!(d.take(&done(3, 0)).unwrap().unwrap().1);

        let mut d = Dump::new(4);
        let all = [data(4, 0, &[1; 4]), done(4, NLM_F_DUMP_INTR)].concat();
        assert!(d.take(&all).unwrap().unwrap().1);

        // The flag on another request's message does not count.
        let mut d = Dump::new(5);
        let all = [
            data(4, NLM_F_DUMP_INTR, &[1; 4]),
            data(5, 0, &[2; 4]),
            done(5, 0),
        ]
        .concat();
        assert_eq!(d.take(&all).unwrap().unwrap(), (vec![vec![2; 4]], false));
    }
}
