//! A real Felix (built from the Go module proxy by `scripts/calico.sh`)
//! and the daemon behind it restarted under traffic, on one node: Felix
//! killed and restarted, then the daemon stopped under a running Felix
//! (its driver and Felix exit; the test starts Felix again, as
//! calico-node's supervisor does). Throughout, an established TCP flow and
//! our filter rules are watched: no exchange lost, no rule missing at any
//! read, the verdicts the same before, between and after. Needs root;
//! skipped, saying so, only without Go.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dphandler_tests::calico::{self, Calico, Proc};
use dphandler_tests::kernel::{self, RuleWatch};
use dphandler_tests::lab::{self, Probe};
use dphandler_tests::traffic::EchoFlow;
use dphandler_tests::{Daemon, Netns, tempdir};

fn restarts(c: &Calico) -> Result<()> {
    let dir = tempdir()?;
    let host = Netns::new("calr")?;
    host.run("ip", &["link", "set", "lo", "up"])?;
    host.run("ip", &["addr", "add", "172.31.50.1/24", "dev", "lo"])?;
    let client = lab::workload_v4(&host, "cali1", 1, "10.65.0.2")?;
    let web = lab::workload_v4(&host, "cali2", 2, "10.65.0.3")?;
    let _echo = lab::echo(&web.0, 8080);
    let _servers = lab::serve(&web.0, &[7070, 9090], &[]);
    let _etcd = calico::etcd(c, &host, dir.path())?;
    let socket = dir.path().join("dp.sock");
    let daemon_args = ["--hostname", "node1", "--ipv6", "false"];
    let mut d = Some(Daemon::start(&host, &socket, &daemon_args)?);
    calico::apply(c, &host, dir.path(), &calico::one_node())?;
    let drv = calico::driver(dir.path())?;
    let start_felix = || {
        calico::felix(
            c,
            &host,
            dir.path(),
            "node1",
            &drv,
            &socket,
            &[("FELIX_IPV6SUPPORT", "false")],
        )
    };
    let in_sync = |f: &Proc, what: &str| {
        calico::until(60, what, || f.logged("DataplaneInSync"))
            .map_err(|e| e.context(format!("Calico {}\n{}", c.label, f.tail(30))))
    };
    let mut felix = start_felix()?;
    in_sync(&felix, "the first DataplaneInSync")?;
    let verdicts = || {
        let v = |port| lab::probe(&client, "10.65.0.3", Probe::Tcp(port));
        (v(8080), v(7070), v(9090))
    };
    assert_eq!(verdicts(), (true, false, false), "the policies before");

    let flow = EchoFlow::start(&client, "10.65.0.3:8080".parse()?)?;
    let baseline = kernel::our_rule_count(&host, false, "filter")?;
    assert!(baseline > 20, "{baseline} rules");
    let watch = RuleWatch::start(&host, baseline, &["cali1", "cali2"]);

    // Felix killed (a crash): its driver sees fd 3 close and ends; the
    // daemon keeps the kernel as it is. Felix restarted (calico-node's
    // supervisor does it): a new driver, a new snapshot, swapped in at its
    // InSync.
    let killed = Instant::now();
    felix.kill();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        verdicts(),
        (true, false, false),
        "the policies without Felix"
    );
    felix = start_felix()?;
    in_sync(&felix, "DataplaneInSync from the restarted Felix")?;
    eprintln!(
        "Calico {}: Felix killed → restarted Felix in sync: {:?}",
        c.label,
        killed.elapsed()
    );
    assert_eq!(verdicts(), (true, false, false), "the policies after");

    // The daemon restarted under a running Felix: the driver loses it and
    // exits non-zero, Felix exits with it (it cannot catch a new daemon up
    // from a driver that lost the old one), and the supervisor starts
    // Felix again; the restarted daemon finds its kernel state and takes
    // the new snapshot. Nothing is flushed on the way.
    let stopped = Instant::now();
    d.take().unwrap().stop()?;
    let st = felix
        .wait_exit(30)
        .with_context(|| format!("Felix did not exit with its driver\n{}", felix.tail(30)))?;
    assert!(
        !st.success(),
        "Felix exits with an error when its driver dies: {st}"
    );
    assert_eq!(
        verdicts(),
        (true, false, false),
        "the policies with neither"
    );
    d = Some(Daemon::start(&host, &socket, &daemon_args)?);
    felix = start_felix()?;
    in_sync(&felix, "DataplaneInSync after the daemon's restart")?;
    eprintln!(
        "Calico {}: daemon stopped → restarted daemon and Felix in sync: {:?}",
        c.label,
        stopped.elapsed()
    );
    assert_eq!(verdicts(), (true, false, false), "the policies after both");

    let (missing, samples, first_bad) = watch.finish();
    let (failed, made) = flow.finish();
    eprintln!(
        "Calico {}: the established flow: {failed} of {made} exchanges failed; \
         rules read {samples} times, {missing} incomplete",
        c.label
    );
    assert_eq!(failed, 0, "an established flow was cut");
    assert!(samples > 20, "the rules were read {samples} times");
    assert_eq!(
        missing, 0,
        "a rule was missing at some instant:\n{first_bad}"
    );
    assert_eq!(calico::rejections(&host)?, 0.0, "{}", felix.tail(40));
    drop(d);
    Ok(())
}

#[test]
fn felix_and_the_daemon_restarted_under_traffic() -> Result<()> {
    calico::each_version(restarts)
}
