//! A small mutation fuzzer on proptest: inputs are the committed corpus
//! (`fuzz/corpus/<target>/`) changed by a list of mutations (bytes flipped,
//! inserted, deleted, cut, spliced from another input, or a token from a
//! dictionary of what breaks parsers and commands put in), and each target
//! runs for a bounded time ([`budget`]). A failing input is shrunk by
//! proptest and shown; a panic anywhere in a target is a failure.

pub mod node;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// Tokens that break parsers, shells and kernel commands.
pub const DICTIONARY: &[&str] = &[
    "\n",
    "\r\n",
    "\0",
    "\"",
    "'",
    "`",
    " ",
    "\t",
    "\\",
    "%",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "-",
    "--",
    "/",
    "/33",
    "/129",
    "::",
    "0",
    "-1",
    "65536",
    "4294967296",
    "18446744073709551616",
    "1e999",
    "NaN",
    "null",
    "true",
    "ä",
    "\u{202e}",
    "\u{feff}",
    "😀",
    "-A INPUT -j ACCEPT",
    "COMMIT",
    "*filter",
    "flush",
    "add ",
    "create ",
    "--comment",
    "; rm -rf /",
    "$(id)",
    "10.0.0.256",
    "10.0.0.0/8",
    "fd00::/64",
    "fe80::1%eth0",
    "ee:ee:ee:ee:ee",
    "tcp:0",
    "udp:65536",
    "IP_AND_PORT",
    "NET",
    "dph",
    "cali",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    // Every character an id may hold (what the edge takes, each backend
    // must program: `~` once passed the edge and failed every apply).
    "~",
    "@",
    "+",
    "=",
    ".",
    "_",
    "a~b",
    "s:a~b",
    // Names at their limits: a 15-byte interface, a 253-byte id.
    "cali0123456789a",
    "eth0",
    "lo",
    "0.0.0.0/0",
    "::/0",
    "127.0.0.1/32",
    "192.0.2.10/32",
    "192.0.2.0/24",
    "9300000000000000000",
    "86401",
    "1e400",
    "0x1",
    "0xffffffff",
];

/// Each target's time: `DPH_FUZZ_SECONDS` (CI: 60), else 5.
pub fn budget() -> Duration {
    let secs = std::env::var("DPH_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs)
}

/// The files of corpus `target` (`fuzz/corpus/<target>/`), sorted.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| {
            let p = e.expect("a corpus entry").path();
            let bytes = std::fs::read(&p).expect("a corpus file");
            (p, bytes)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files
}

/// One change to an input; positions are taken modulo its length.
#[derive(Debug, Clone)]
pub enum Mutation {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Token(usize, usize),
    Delete(usize, usize),
    Cut(usize),
    Splice(usize, usize, usize),
    Repeat(usize, usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(p, b)| Mutation::Insert(p, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(p, t)| Mutation::Token(p, t)),
        (any::<usize>(), 1usize..64).prop_map(|(p, n)| Mutation::Delete(p, n)),
        any::<usize>().prop_map(Mutation::Cut),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(i, p, q)| Mutation::Splice(i, p, q)),
        (any::<usize>(), 1usize..64, 1u8..32).prop_map(|(p, n, k)| Mutation::Repeat(p, n, k)),
    ]
}

/// An input of `inputs` (by index) and the mutations to make.
pub fn mutated(inputs: usize) -> impl Strategy<Value = (usize, Vec<Mutation>)> {
    (0..inputs, prop::collection::vec(mutation(), 0..6))
}

/// `input` with `muts` made, `others` the inputs to splice from.
pub fn apply(input: &[u8], muts: &[Mutation], others: &[&[u8]]) -> Vec<u8> {
    let mut v = input.to_vec();
    for m in muts {
        let at = |p: usize, v: &Vec<u8>| if v.is_empty() { 0 } else { p % (v.len() + 1) };
        match m {
            Mutation::Flip(p, b) if !v.is_empty() => {
                let i = p % v.len();
                v[i] ^= b;
            }
            Mutation::Flip(..) => {}
            Mutation::Insert(p, b) => {
                let i = at(*p, &v);
                v.splice(i..i, b.iter().copied());
            }
            Mutation::Token(p, t) => {
                let i = at(*p, &v);
                let tok = DICTIONARY[t % DICTIONARY.len()].as_bytes();
                v.splice(i..i, tok.iter().copied());
            }
            Mutation::Delete(p, n) => {
                let i = at(*p, &v);
                let end = (i + n).min(v.len());
                v.drain(i..end);
            }
            Mutation::Cut(p) => {
                let i = at(*p, &v);
                v.truncate(i);
            }
            Mutation::Splice(o, p, q) if !others.is_empty() => {
                let src = others[o % others.len()];
                let i = at(*p, &v);
                let j = if src.is_empty() { 0 } else { q % src.len() };
                let end = (j + 64).min(src.len());
                v.splice(i..i, src[j..end].iter().copied());
            }
            Mutation::Splice(..) => {}
            Mutation::Repeat(p, n, k) => {
                let i = at(*p, &v);
                let end = (i + n).min(v.len());
                let piece = v[i..end].to_vec();
                for _ in 0..*k {
                    v.splice(i..i, piece.iter().copied());
                }
            }
        }
    }
    v
}

/// What one target did.
#[derive(Debug)]
pub struct Ran {
    pub cases: u64,
    pub elapsed: Duration,
}

/// Runs `property` on inputs of `strategy` until [`budget`] is spent, in
/// rounds of fresh random seeds. Returns how many cases ran; panics with
/// proptest's shrunk input on the first failure (a panic in `property`
/// included).
pub fn run_for<S: Strategy>(
    name: &str,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Ran
where
    S::Value: std::fmt::Debug,
{
    let started = Instant::now();
    let budget = budget();
    let mut cases = 0u64;
    const ROUND: u32 = 256;
    while started.elapsed() < budget {
        let mut runner = TestRunner::new(Config {
            cases: ROUND,
            failure_persistence: None,
            ..Config::default()
        });
        match runner.run(&strategy, &property) {
            Ok(()) => cases += u64::from(ROUND),
            Err(TestError::Fail(why, input)) => {
                panic!("{name}: failed after {cases} cases: {why}\ninput: {input:#?}")
            }
            Err(TestError::Abort(why)) => panic!("{name}: aborted: {why}"),
        }
    }
    let ran = Ran {
        cases,
        elapsed: started.elapsed(),
    };
    eprintln!(
        "{name}: {} cases in {:.1} s, 0 failures",
        ran.cases,
        ran.elapsed.as_secs_f64()
    );
    ran
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_in_bounds() {
        let input = b"abcdef";
        let others: [&[u8]; 1] = [b"XYZ"];
        for m in [
            Mutation::Flip(100, 1),
            Mutation::Insert(7, vec![b'!']),
            Mutation::Token(3, 0),
            Mutation::Delete(5, 100),
            Mutation::Cut(3),
            Mutation::Splice(0, 2, 1),
            Mutation::Repeat(4, 2, 3),
        ] {
            let out = apply(input, std::slice::from_ref(&m), &others);
            assert!(!out.is_empty() || matches!(m, Mutation::Cut(_)), "{m:?}");
        }
        assert_eq!(apply(input, &[Mutation::Cut(3)], &others), b"abc");
        assert_eq!(apply(input, &[Mutation::Token(0, 0)], &others), b"\nabcdef");
        assert_eq!(
            apply(input, &[Mutation::Splice(0, 6, 1)], &others),
            b"abcdefYZ"
        );
        assert_eq!(apply(b"", &[Mutation::Flip(3, 9)], &others), b"");
    }
}
