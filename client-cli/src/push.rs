//! `dphctl push`: one ToDataplane stream carrying the file's messages.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use dphandler_proto::felix::{self, to_dataplane::Payload};
use dphandler_proto::v1::{self, to_dataplane_reply::Kind};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};

use crate::ConnArgs;

/// Pushes of at least this many messages get a progress bar (on a terminal).
const PROGRESS_FROM: usize = 1000;

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// File of messages, or `-` for standard input.
    file: PathBuf,
    /// Append an InSync message: this push is a complete snapshot, and
    /// objects of an earlier session that it lacks are removed.
    #[arg(long, env = "DPH_PUSH_IN_SYNC")]
    in_sync: bool,
    /// Seconds to wait for the server to program everything.
    #[arg(long, env = "DPH_PUSH_TIMEOUT", default_value_t = 60.0)]
    timeout: f64,
    /// Return once the server has validated the messages; do not wait for
    /// them to be programmed.
    #[arg(long, env = "DPH_PUSH_NO_WAIT")]
    no_wait: bool,
    /// Print nothing on success.
    #[arg(long, short, env = "DPH_PUSH_QUIET")]
    quiet: bool,
}

fn read_input(file: &PathBuf) -> anyhow::Result<String> {
    if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
    }
}

pub async fn run(conn: &ConnArgs, args: PushArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .context("--timeout must be a non-negative number of seconds")?;
    let input = read_input(&args.file)?;
    let mut msgs = dphandler_proto::text::parse_to_dataplane(&input)
        .with_context(|| format!("in {}", args.file.display()))?;
    if args.in_sync {
        msgs.push(felix::ToDataplane {
            sequence_number: 0,
            payload: Some(Payload::InSync(felix::InSync {})),
        });
    }
    if msgs.is_empty() {
        bail!("{} holds no messages", args.file.display());
    }
    dphandler_proto::text::number(&mut msgs);
    let in_sync_seqs: Vec<u64> = msgs
        .iter()
        .filter(|m| matches!(m.payload, Some(Payload::InSync(_))))
        .map(|m| m.sequence_number)
        .collect();
    let total = msgs.len();

    let mut client = conn.connect().await?;
    let started = Instant::now();
    let bar = if total >= PROGRESS_FROM {
        let b = ProgressBar::new(total as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg:12} [{bar:40}] {pos}/{len} {per_sec} eta {eta}",
            )
            .expect("the template is valid")
            .progress_chars("=> "),
        );
        b.set_message("sending");
        b
    } else {
        ProgressBar::hidden()
    };
    let sending = {
        let bar = bar.clone();
        futures::stream::iter(msgs).inspect(move |_| bar.inc(1))
    };
    let mut replies = client
        .to_dataplane(sending)
        .await
        .context("opening the ToDataplane stream")?
        .into_inner();

    let deadline = tokio::time::Instant::now() + timeout;
    let mut rejections: Vec<v1::Rejection> = Vec::new();
    let mut programmed = 0u64;
    let mut received: Option<v1::Received> = None;
    loop {
        let reply = match tokio::time::timeout_at(deadline, replies.message()).await {
            Err(_) => {
                bar.abandon();
                let what = match &received {
                    None => "the server to read all messages".to_string(),
                    Some(r) => format!(
                        "sequence {} to be programmed (programmed so far: {programmed})",
                        r.last_accepted_sequence
                    ),
                };
                report_rejections(&rejections);
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            Ok(r) => r.context("the ToDataplane stream failed")?,
        };
        let Some(reply) = reply else { break };
        match reply.kind {
            Some(Kind::Rejected(r)) => rejections.push(r),
            Some(Kind::Programmed(p)) => programmed = programmed.max(p.sequence_number),
            Some(Kind::Received(r)) => {
                bar.set_message("programming");
                let our_in_sync_accepted = in_sync_seqs
                    .iter()
                    .any(|s| !rejections.iter().any(|r| r.sequence_number == *s));
                let waiting_pointless = !r.datastore_in_sync && !our_in_sync_accepted;
                received = Some(r);
                if args.no_wait || waiting_pointless {
                    break;
                }
            }
            None => {}
        }
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    report_rejections(&rejections);
    let Some(received) = received else {
        bail!("the server ended the stream before reading all messages");
    };
    let accepted = received.messages - received.rejected;
    let summary = format!(
        "{} messages sent, {accepted} accepted, {} rejected",
        received.messages, received.rejected
    );
    let all_programmed =
        received.messages == received.rejected || programmed >= received.last_accepted_sequence;
    if all_programmed {
        if !args.quiet {
            println!(
                "{summary}; programmed up to sequence {programmed} in {:.3}s",
                elapsed.as_secs_f64()
            );
        }
    } else if args.no_wait {
        if !args.quiet {
            println!("{summary}; not waiting for them to be programmed");
        }
    } else {
        println!("{summary}; not programmed yet");
        eprintln!(
            "dphctl: nothing is applied until a feeder sends InSync (the end of a complete \
             snapshot); push with --in-sync when this file is the whole desired state"
        );
        return Ok(ExitCode::from(4));
    }
    Ok(if rejections.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

fn report_rejections(rejections: &[v1::Rejection]) {
    for r in rejections {
        eprintln!(
            "rejected: sequence {}: {}: {}",
            r.sequence_number, r.field, r.reason
        );
    }
}
