//! A policy list chain as programmed: the policy and profile chains that
//! it alone jumps to in its shard (and small ones it shares) written in
//! their place, where that does exactly what the jump did.
//!
//! Every nf_tables commit costs the kernel a pass over every chain in the
//! namespace (see [`super::super`]): a policy chain that one list chain
//! uses is one chain more for every IP-set member added anywhere. Written
//! into the list chain it is not a chain at all; its rules are the same
//! rules, run in the same order. When more list chains in the shard come
//! to use it than its size allows (`copies::fits`), they all jump to one
//! copy again ([`super::copies`]).
//!
//! A jump `J` to chain `T`, followed in the list chain by
//! `-m mark --mark <accept>/<accept> -j RETURN` (as every policy and
//! profile jump of a workload chain is), is replaced by `T`'s rules when
//! - `T` only marks, drops, logs or accepts, and returns only once the
//!   accept mark is set: then its return ends the list chain just as the
//!   list chain's own return right after the jump would have (a pass,
//!   which returns with the pass mark and no accept, is not written in:
//!   in a shard a return from the list chain lets the packet through);
//! - `T` never sets the pass mark (so what follows in its tier is still
//!   guarded right), and
//! - `J` is unconditional, or guarded by "no pass mark yet" at a point
//!   where no pass mark can be set: after the tier cleared it, with only
//!   such pass-free chains run since.

use crate::generictables::Rule;

/// The accept and pass marks, and the prefix of our chains' names.
#[derive(Debug, Clone, Copy)]
pub(super) struct Marks<'a> {
    pub accept: u32,
    pub pass: u32,
    pub chain_prefix: &'a str,
}

/// `(value, mask)` of a rule's `--set-xmark <value>/<mask>`.
fn set_xmark(r: &Rule) -> Option<(u32, u32)> {
    let mut tokens = r.text().split(' ');
    tokens.find(|t| *t == "--set-xmark")?;
    let (v, m) = tokens.next()?.split_once('/')?;
    Some((number(v)?, number(m)?))
}

fn number(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

impl Marks<'_> {
    fn accept_return(&self) -> String {
        let a = self.accept;
        format!("-m mark --mark {a:#x}/{a:#x} -j RETURN")
    }

    fn is_chain(&self, target: &str) -> bool {
        target.starts_with(self.chain_prefix)
    }

    /// Whether `r` may set the pass mark.
    fn sets_pass(&self, r: &Rule) -> bool {
        set_xmark(r).is_some_and(|(v, m)| m & v & self.pass != 0)
    }

    /// Whether chain rules `rules` do what a jump to them does when run in
    /// the jumping chain's place (see the module header).
    fn can_inline(&self, rules: &[Rule]) -> bool {
        let accept_return = self.accept_return();
        rules.iter().all(|r| match r.target() {
            None => true,
            Some("RETURN") => r.text() == accept_return,
            Some(t) if self.is_chain(t) => false,
            Some(_) => !self.sets_pass(r),
        })
    }

    /// List chain `body` as programmed: each jump to a chain `sole`
    /// gives the rules of (those to be written into the list chains that
    /// use them) written in its place where that does the same; `known`
    /// gives any chain's rules.
    pub(super) fn render<'r>(
        &self,
        body: &[Rule],
        sole: impl Fn(&str) -> Option<&'r [Rule]>,
        known: impl Fn(&str) -> Option<&'r [Rule]>,
    ) -> Vec<Rule> {
        let accept_return = self.accept_return();
        let pass_guard = format!("-m mark --mark 0/{:#x} -j ", self.pass);
        // No pass mark can be set at this point of the chain.
        let mut no_pass = false;
        let mut out = Vec::with_capacity(body.len());
        for (i, r) in body.iter().enumerate() {
            if let Some((v, m)) = set_xmark(r) {
                if m & v & self.pass != 0 {
                    no_pass = false;
                } else if m & self.pass != 0 && r.text().starts_with("-j MARK ") {
                    no_pass = true;
                }
            }
            let Some(t) = r.target().filter(|t| self.is_chain(t)) else {
                out.push(r.clone());
                continue;
            };
            let unconditional = r.text() == format!("-j {t}");
            let guarded = no_pass
                && r.text()
                    .strip_prefix(&pass_guard)
                    .is_some_and(|rest| rest == t);
            let returns_next = body.get(i + 1).is_some_and(|n| n.text() == accept_return);
            if (unconditional || guarded)
                && returns_next
                && let Some(rules) = sole(t).filter(|rules| self.can_inline(rules))
            {
                out.extend(rules.iter().cloned());
                continue;
            }
            // Jumped to: what it does to the pass mark is only known from
            // its rules.
            no_pass = no_pass
                && known(t).is_some_and(|rules| {
                    rules
                        .iter()
                        .all(|r| !self.sets_pass(r) && r.target().is_none_or(|t| !self.is_chain(t)))
                });
            out.push(r.clone());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn rules(texts: &[&str]) -> Vec<Rule> {
        texts
            .iter()
            .map(|t| Rule::parse(t).expect("valid"))
            .collect()
    }

    fn texts(rules: &[Rule]) -> Vec<&str> {
        rules.iter().map(Rule::text).collect()
    }

    const MARKS: Marks<'static> = Marks {
        accept: 0x10000,
        pass: 0x20000,
        chain_prefix: "dph-",
    };

    /// A workload's ingress chain in its shard: two policies in one tier,
    /// a profile, as the endpoints manager writes it.
    fn list() -> Vec<Rule> {
        rules(&[
            "-j MARK --set-xmark 0x0/0x2000000",
            "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN",
            "-m conntrack --ctstate INVALID -j DROP",
            "-j MARK --set-xmark 0/0x30000",
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-default.a",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0/0x20000 -j dph-pi-default.b",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-m mark --mark 0/0x20000 -j DROP",
            "-j dph-pri-kns.web",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-j DROP",
        ])
    }

    fn allow(port: u16) -> Vec<Rule> {
        rules(&[
            &format!("-p tcp --dport {port} -j MARK --set-xmark 0x10000/0x10000"),
            "-m mark --mark 0x10000/0x10000 -j RETURN",
            "-p udp -j DROP",
        ])
    }

    fn pass() -> Vec<Rule> {
        rules(&[
            "-p tcp -j MARK --set-xmark 0x20000/0x20000",
            "-m mark --mark 0x20000/0x20000 -j RETURN",
        ])
    }

    fn render(chains: &HashMap<&str, Vec<Rule>>, sole: &[&str]) -> Vec<String> {
        let out = MARKS.render(
            &list(),
            |t| {
                sole.contains(&t)
                    .then(|| chains.get(t).map(Vec::as_slice))
                    .flatten()
            },
            |t| chains.get(t).map(Vec::as_slice),
        );
        texts(&out).into_iter().map(str::to_string).collect()
    }

    #[test]
    fn a_chain_used_by_this_list_alone_is_written_in_its_place() {
        let chains = HashMap::from([
            ("dph-pi-default.a", allow(80)),
            ("dph-pi-default.b", allow(81)),
            ("dph-pri-kns.web", allow(82)),
        ]);
        let all = ["dph-pi-default.a", "dph-pi-default.b", "dph-pri-kns.web"];
        assert_eq!(
            render(&chains, &all),
            [
                "-j MARK --set-xmark 0x0/0x2000000",
                "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN",
                "-m conntrack --ctstate INVALID -j DROP",
                "-j MARK --set-xmark 0/0x30000",
                "-j MARK --set-xmark 0/0x20000",
                "-p tcp --dport 80 -j MARK --set-xmark 0x10000/0x10000",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-p udp -j DROP",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-p tcp --dport 81 -j MARK --set-xmark 0x10000/0x10000",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-p udp -j DROP",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-m mark --mark 0/0x20000 -j DROP",
                "-p tcp --dport 82 -j MARK --set-xmark 0x10000/0x10000",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-p udp -j DROP",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-j DROP",
            ]
        );
        // Shared ones stay jumps.
        assert_eq!(
            render(&chains, &["dph-pi-default.b"])[5..8],
            [
                "-m mark --mark 0/0x20000 -j dph-pi-default.a",
                "-m mark --mark 0x10000/0x10000 -j RETURN",
                "-p tcp --dport 81 -j MARK --set-xmark 0x10000/0x10000",
            ]
        );
    }

    #[test]
    fn a_pass_is_never_written_in_nor_what_it_may_skip() {
        let all = ["dph-pi-default.a", "dph-pi-default.b", "dph-pri-kns.web"];
        // A passing policy first: it stays a jump, and the next policy of
        // its tier (skipped once the pass mark is set) does too; the
        // profile, unconditional, is written in.
        let chains = HashMap::from([
            ("dph-pi-default.a", pass()),
            ("dph-pi-default.b", allow(81)),
            ("dph-pri-kns.web", allow(82)),
        ]);
        let out = render(&chains, &all);
        assert!(out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.a".to_string()));
        assert!(out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.b".to_string()));
        assert!(!out.contains(&"-j dph-pri-kns.web".to_string()));
        // Second: the first is written in, the pass stays a jump.
        let chains = HashMap::from([
            ("dph-pi-default.a", allow(80)),
            ("dph-pi-default.b", pass()),
            ("dph-pri-kns.web", allow(82)),
        ]);
        let out = render(&chains, &all);
        assert!(!out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.a".to_string()));
        assert!(out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.b".to_string()));
        // A shared first policy, not known to be pass-free: the second
        // stays a jump.
        let out = render(&chains, &["dph-pi-default.b"]);
        assert!(out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.b".to_string()));
        // Shared but pass-free: the second is written in.
        let chains = HashMap::from([
            ("dph-pi-default.a", allow(80)),
            ("dph-pi-default.b", allow(81)),
        ]);
        let out = render(&chains, &["dph-pi-default.b"]);
        assert!(out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.a".to_string()));
        assert!(!out.contains(&"-m mark --mark 0/0x20000 -j dph-pi-default.b".to_string()));
    }

    #[test]
    fn chains_that_jump_or_return_otherwise_stay_jumps() {
        let all = ["dph-pi-default.a", "dph-pi-default.b"];
        let chains = HashMap::from([
            ("dph-pi-default.a", rules(&["-p tcp -j dph-other"])),
            ("dph-pi-default.b", rules(&["-p tcp -j RETURN"])),
        ]);
        let out = render(&chains, &all);
        assert_eq!(out, texts(&list()));
        // A jump without the accept check right after it (as an untracked
        // chain's NOTRACK) stays one.
        let body = rules(&[
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-default.a",
            "-m mark --mark 0x10000/0x10000 -j NOTRACK",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]);
        let a = allow(80);
        let out = MARKS.render(&body, |_| Some(&a[..]), |_| Some(&a[..]));
        assert_eq!(out, body);
        // A guarded jump is written in after the tier's clearing of the
        // pass mark, not without it.
        let body = rules(&[
            "-j MARK --set-xmark 0/0x20000",
            "-m mark --mark 0/0x20000 -j dph-pi-default.a",
            "-m mark --mark 0x10000/0x10000 -j RETURN",
        ]);
        let out = MARKS.render(&body, |_| Some(&a[..]), |_| Some(&a[..]));
        assert_eq!(
            texts(&out)[1],
            "-p tcp --dport 80 -j MARK --set-xmark 0x10000/0x10000"
        );
        let out = MARKS.render(&body[1..], |_| Some(&a[..]), |_| Some(&a[..]));
        assert_eq!(out, body[1..]);
    }
}
