//! The daemon's iptables state on the real kernel: its hooks and chains,
//! foreign rules untouched, a restart that drops nothing even for a moment,
//! tampering repaired, both iptables flavours. Needs root.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use dphandler_tests::{Daemon, Netns, eventually, in_sync, msg, privileged, push, tempdir};

fn save(ns: &Netns, tool: &str) -> Result<Vec<String>> {
    Ok(
        String::from_utf8_lossy(&ns.run(tool, &["-t", "filter"])?.stdout)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| match l.strip_prefix(':') {
                Some(rest) => format!(":{}", rest.rsplit_once(' ').map_or(rest, |x| x.0)),
                None => l.to_string(),
            })
            .collect(),
    )
}

fn ours(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.contains("dph"))
        .cloned()
        .collect()
}

fn foreign(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !l.contains("dph"))
        .cloned()
        .collect()
}

fn plant(ns: &Netns, ipt: &str) -> Result<()> {
    ns.run(ipt, &["-w", "-N", "KUBE-FOO"])?;
    ns.run(
        ipt,
        &["-w", "-A", "KUBE-FOO", "-s", "10.8.0.0/16", "-j", "RETURN"],
    )?;
    ns.run(
        ipt,
        &["-w", "-A", "INPUT", "-s", "10.9.9.9", "-j", "ACCEPT"],
    )?;
    ns.run(
        ipt,
        &[
            "-w",
            "-A",
            "FORWARD",
            "-m",
            "comment",
            "--comment",
            "kube thing",
            "-j",
            "KUBE-FOO",
        ],
    )?;
    Ok(())
}

#[tokio::test]
async fn hooks_survive_restarts_without_a_gap_and_foreign_rules_stay() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let socket = dir.path().join("dp.sock");
    let ns = Netns::new("ipt")?;
    plant(&ns, "iptables-nft")?;
    let planted = foreign(&save(&ns, "iptables-nft-save")?);

    let args = [
        "--iptables-backend",
        "nft",
        "--iptables-refresh-seconds",
        "1",
    ];
    let d = Daemon::start(&ns, &socket, &args)?;
    push(&mut d.connect().await?, vec![msg(1, in_sync())]).await?;
    let s = save(&ns, "iptables-nft-save")?;
    let hooks = |s: &[String]| {
        s.iter()
            .filter(|l| {
                ["-A INPUT ", "-A FORWARD ", "-A OUTPUT "]
                    .iter()
                    .any(|b| l.starts_with(b))
                    && l.contains("dph:")
            })
            .count()
    };
    assert_eq!(hooks(&s), 3, "our three hooks: {s:#?}");
    assert!(s.iter().any(|l| l == ":dph-FORWARD -"), "{s:#?}");
    let rules_of_ours = s
        .iter()
        .filter(|l| l.starts_with("-A ") && l.contains("dph:"))
        .count();
    let input: Vec<&String> = s.iter().filter(|l| l.starts_with("-A INPUT")).collect();
    assert!(
        input[0].ends_with("-j dph-INPUT"),
        "our hook is on top: {s:#?}"
    );
    assert_eq!(foreign(&s), planted);
    for t in ["raw", "mangle", "nat"] {
        let text =
            String::from_utf8_lossy(&ns.run("iptables-nft-save", &["-t", t])?.stdout).into_owned();
        assert!(!text.contains("dph"), "nothing of ours in {t} yet: {text}");
    }
    assert!(d.stop()?.success());
    assert_eq!(
        save(&ns, "iptables-nft-save")?,
        s,
        "stopping removes nothing"
    );

    // Restart while a watcher samples the table: our hooks never vanish.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, name) = (stop.clone(), ns.0.clone());
        std::thread::spawn(move || {
            let (mut min, mut samples) = (usize::MAX, 0);
            while !stop.load(Ordering::Relaxed) {
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", &name, "iptables-nft-save", "-t", "filter"])
                    .output()
                    .expect("iptables-save");
                let n = String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| l.starts_with("-A ") && l.contains("dph:"))
                    .count();
                min = min.min(n);
                samples += 1;
            }
            (min, samples)
        })
    };
    let d = Daemon::start(&ns, &socket, &args)?;
    let mut c = d.connect().await?;
    push(&mut c, vec![msg(1, in_sync())]).await?;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (min, samples) = watcher.join().unwrap();
    assert!(samples >= 3, "{samples} samples");
    assert_eq!(
        min, rules_of_ours,
        "a rule of ours vanished during the restart"
    );
    assert_eq!(save(&ns, "iptables-nft-save")?, s, "adopted as it was");

    // Tampering: our INPUT hook deleted, a rule put into our chain; the
    // refresh (1 s here) restores both, foreign rules untouched.
    let hook = s
        .iter()
        .find(|l| l.starts_with("-A INPUT") && l.contains("dph:"))
        .unwrap();
    let spec: Vec<&str> = hook["-A INPUT ".len()..]
        .split(' ')
        .map(|w| w.trim_matches('"'))
        .collect();
    let mut del = vec!["-w", "-D", "INPUT"];
    del.extend(spec);
    ns.run("iptables-nft", &del)?;
    ns.run("iptables-nft", &["-w", "-A", "dph-OUTPUT", "-j", "DROP"])?;
    ns.run("iptables-nft", &["-w", "-D", "dph-FORWARD", "1"])?;
    eventually(10, || Ok(save(&ns, "iptables-nft-save")? == s)).await?;
    assert_eq!(foreign(&save(&ns, "iptables-nft-save")?), planted);
    Ok(())
}

#[tokio::test]
async fn the_legacy_flavour_works_the_same() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let dir = tempdir()?;
    let ns = Netns::new("iptleg")?;
    plant(&ns, "iptables-legacy")?;
    let planted = foreign(&save(&ns, "iptables-legacy-save")?);
    // auto: the host's rules are in legacy, so legacy is used.
    let d = Daemon::start(&ns, &dir.path().join("dp.sock"), &[])?;
    push(&mut d.connect().await?, vec![msg(1, in_sync())]).await?;
    let s = save(&ns, "iptables-legacy-save")?;
    assert!(ours(&s).len() > 6, "{s:#?}");
    assert!(s.iter().any(|l| l == ":dph-from-wl-dispatch -"), "{s:#?}");
    assert_eq!(foreign(&s), planted);
    assert!(
        ours(&save(&ns, "iptables-nft-save")?).is_empty(),
        "nothing written with the other flavour"
    );
    Ok(())
}
