//! The rule types both dataplanes share (as Felix's `generictables`):
//! a rule in iptables syntax built from checked tokens ([`Rule`]), the
//! chain-name limit, the chained rule hashes our comments carry
//! ([`RuleHash`], [`rule_hashes`]) and what names mark an object as ours
//! ([`Ownership`]). The renderer (`crate::rules`) and the managers make
//! these; the iptables backend writes them as they are and the nftables
//! backend translates them. No kernel objects: plain data.

use base64::Engine;
use sha2::Digest;

/// iptables' limit on chain names.
pub const MAX_CHAIN_NAME: usize = 28;

/// Why a rule or chain name cannot be used. Not retryable: the caller built
/// something invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("chain name {0:?}: 1-28 characters of [A-Za-z0-9_.:-], not starting with '-'")]
    ChainName(String),
    #[error("rule token {0:?}: only [A-Za-z0-9._:/,!=+@%~-] may reach iptables-restore")]
    Token(String),
    #[error("a rule needs at least one token")]
    Empty,
    /// The rule has no nftables translation (`--dataplane nftables`).
    #[error("not expressible in nftables: {0}")]
    Nftables(String),
}

pub(crate) fn check_chain(name: &str) -> Result<(), RuleError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_CHAIN_NAME
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(RuleError::ChainName(name.to_string()))
    }
}

/// A rule's match and action, e.g. `-p tcp --dport 80 -j ACCEPT`. Built only
/// from tokens of a strict character set: no whitespace, quotes, newlines or
/// `#` can reach the restore input, so no name or id can inject a rule.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    text: String,
    /// Where in `text` the jump or goto target is (found while the tokens
    /// are checked: finding it later meant scanning 50,000 rules again).
    target: Option<std::ops::Range<usize>>,
}

impl Rule {
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Result<Self, RuleError> {
        let mut text = String::new();
        let mut target = None;
        let mut after_jump = false;
        for t in tokens {
            let ok = !t.is_empty() && t.bytes().all(crate::model::is_token_byte);
            if !ok {
                return Err(RuleError::Token(t.to_string()));
            }
            if !text.is_empty() {
                text.push(' ');
            }
            if after_jump && target.is_none() {
                target = Some(text.len()..text.len() + t.len());
            }
            after_jump = matches!(t, "-j" | "-g" | "--jump" | "--goto");
            text.push_str(t);
        }
        if text.is_empty() {
            return Err(RuleError::Empty);
        }
        Ok(Self { text, target })
    }

    /// Parses a space-separated rule (every token checked as in [`new`](Self::new)).
    pub fn parse(s: &str) -> Result<Self, RuleError> {
        Self::new(s.split(' '))
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// The chain this rule jumps or goes to, if any.
    pub fn target(&self) -> Option<&str> {
        self.target.clone().map(|r| &self.text[r])
    }
}

/// A rule's hash as its comment carries it: 16 base64url characters,
/// inline (50,000 rules are 50,000 of these: no allocation each).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleHash([u8; 16]);

impl RuleHash {
    /// What a comment with our prefix but not a hash of ours reads as (a
    /// comment edited by hand): the rule is ours, and wrong.
    pub const DAMAGED: Self = Self([b'?'; 16]);

    /// The hash in a comment read back (after our prefix).
    pub fn parse(s: &str) -> Self {
        match <[u8; 16]>::try_from(s.as_bytes()) {
            Ok(b)
                if b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || b"-_".contains(c)) =>
            {
                Self(b)
            }
            _ => Self::DAMAGED,
        }
    }

    pub fn as_str(&self) -> &str {
        // Only base64url characters or DAMAGED's '?' are ever stored.
        std::str::from_utf8(&self.0).unwrap_or("????????????????")
    }
}

impl std::fmt::Display for RuleHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for RuleHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// The hashes of a chain's rules, chained over its name (Felix's
/// `RuleHashes`): each depends on the chain and every rule up to it.
pub fn rule_hashes(chain: &str, rules: &[Rule]) -> Vec<RuleHash> {
    chained_hashes(chain, rules.iter().map(|r| r.text.as_str()))
}

/// [`rule_hashes`] of rules given as text.
pub fn chained_hashes<'a>(chain: &str, texts: impl IntoIterator<Item = &'a str>) -> Vec<RuleHash> {
    let mut h = sha2::Sha224::new();
    h.update(chain.as_bytes());
    texts
        .into_iter()
        .map(|text| {
            h.update(text.as_bytes());
            let sum = h.clone().finalize();
            // The first 16 characters of the base64 of the digest are the
            // base64 of its first 12 bytes (3 bytes to 4 characters).
            let mut out = [0u8; 16];
            let n = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode_slice(&sum[..12], &mut out)
                .expect("12 bytes encode to 16 characters");
            debug_assert_eq!(n, 16);
            RuleHash(out)
        })
        .collect()
}

/// Naming of what a table owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// Chains starting with this are ours (`dph-`).
    pub chain_prefix: String,
    /// Our hash comments start with this (`dph:`).
    pub comment_prefix: String,
}

impl Ownership {
    /// From the daemon's prefix (`dph` gives `dph-` and `dph:`).
    pub fn new(prefix: &str) -> Self {
        Self {
            chain_prefix: format!("{prefix}-"),
            comment_prefix: format!("{prefix}:"),
        }
    }
}
