//! `dphctl felix-driver`: Felix's external dataplane driver, so that a
//! stock Felix drives a dphandler (local or on another host).
//!
//! Felix with `UseInternalDataplaneDriver=false` execs `DataplaneDriver`
//! with no arguments, writes `felix.ToDataplane` frames to the driver's fd
//! 3 and reads `felix.FromDataplane` frames from its fd 4; a frame is an
//! 8-byte little-endian length and the protobuf
//! (`felix/dataplane/external/ext_dataplane.go`). Its stdout and stderr
//! are copied into Felix's log. Because Felix passes no arguments, the
//! driver also runs when `dphctl` is called by the name
//! `dphandler-felix-driver` (a symlink), and takes its settings from the
//! `DPH_*` variables Felix's environment passes on.
//!
//! This forwards every ToDataplane over one gRPC `ToDataplane` stream as
//! the bytes Felix wrote (undecoded: the server reads every Felix's forms,
//! master's and the releases', and says what it cannot take), and
//! writes every `FromDataplane` of a `StatusUpdates` stream to fd 4
//! (DataplaneInSync, endpoint status, WireGuard keys, the process-status
//! heartbeats). Rejections are logged to stderr with their sequence number
//! and reason.
//!
//! Felix sends its snapshot only when it starts the driver, so a lost
//! server cannot be caught up from here: the driver exits non-zero, Felix
//! exits with it and is restarted, and the new driver brings a fresh
//! snapshot to the (restarted) server. The same for a frame over
//! `--max-frame-bytes` (a broken length: the stream cannot be read on),
//! and for fds 3 and 4 not being open (not run by Felix). A frame the
//! server cannot decode is one rejected message, logged: the stream goes
//! on (restarting Felix would send the same message again).
//! On SIGTERM (Felix stopping, which kills after 4 s) or when Felix closes
//! fd 3, it ends at once with 0.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use dphandler_proto::client;
use dphandler_proto::v1::{self, status_update, to_dataplane_reply};
use dphandler_proto::wire::RawToDataplane;
use dphandler_proto::wire::raw::dataplane_client::DataplaneClient;
use prost::Message;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::ConnArgs;

#[derive(clap::Args, Debug)]
pub struct FelixDriverArgs {
    /// Where Felix's ToDataplane frames come from (its pipe on fd 3).
    #[arg(long, env = "DPH_FELIX_IN", default_value = "/dev/fd/3")]
    from_felix: PathBuf,
    /// Where the FromDataplane frames go (Felix's pipe on fd 4).
    #[arg(long, env = "DPH_FELIX_OUT", default_value = "/dev/fd/4")]
    to_felix: PathBuf,
    /// Largest frame accepted from Felix, in bytes (the server's
    /// --max-message-bytes is the limit that matters; this one stops a
    /// corrupt length from allocating gigabytes).
    #[arg(long, env = "DPH_FELIX_MAX_FRAME_BYTES", default_value_t = 64 * 1024 * 1024)]
    max_frame_bytes: u64,
    /// How long to keep trying to reach the server at start (the daemon
    /// may be starting beside Felix on a booting node).
    #[arg(
        long,
        env = "DPH_FELIX_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 30.0
    )]
    connect_timeout_seconds: f64,
}

/// Why the driver stopped.
enum End {
    /// Felix closed fd 3, or asked us to stop: nothing is wrong.
    Felix(&'static str),
    /// Something Felix must hear about by our exit status.
    Failed(anyhow::Error),
}

/// Reads one frame: `Ok(None)` at a clean end (EOF between frames).
pub fn read_frame(r: &mut impl Read, max: u64) -> anyhow::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 8];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => bail!("the stream ended inside a frame's length ({got} of 8 bytes)"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("reading a frame's length"),
        }
    }
    let n = u64::from_le_bytes(len);
    if n > max {
        bail!(
            "a frame of {n} bytes is over the limit of {max} (--max-frame-bytes): \
             not a Felix ToDataplane stream, or a corrupt one"
        );
    }
    let mut buf = vec![0u8; usize::try_from(n)?];
    r.read_exact(&mut buf)
        .with_context(|| format!("the stream ended inside a frame of {n} bytes"))?;
    Ok(Some(buf))
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, msg: &[u8]) -> std::io::Result<()> {
    w.write_all(&(msg.len() as u64).to_le_bytes())?;
    w.write_all(msg)?;
    w.flush()
}

fn open_pipes(args: &FelixDriverArgs) -> anyhow::Result<(std::fs::File, std::fs::File)> {
    // Opened by path (/dev/fd/N) rather than adopted by number: the same
    // pipe, without unsafe code; a missing fd is a clear error.
    let not_open = |which: &str, p: &PathBuf| {
        format!(
            "{which} ({}) is not open: `dphctl felix-driver` is run by Felix \
             (UseInternalDataplaneDriver=false, DataplaneDriver pointing at it), \
             with its pipes on fds 3 and 4",
            p.display()
        )
    };
    let input = std::fs::File::open(&args.from_felix)
        .with_context(|| not_open("Felix's ToDataplane pipe", &args.from_felix))?;
    let output = std::fs::OpenOptions::new()
        .write(true)
        .open(&args.to_felix)
        .with_context(|| not_open("Felix's FromDataplane pipe", &args.to_felix))?;
    Ok((input, output))
}

async fn connect(conn: &ConnArgs, timeout: Duration) -> anyhow::Result<Channel> {
    let until = Instant::now() + timeout;
    loop {
        match conn.channel().await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= until => {
                return Err(e.context(format!(
                    "no dphandler within {timeout:?}: Felix will restart the driver"
                )));
            }
            // Settings or TLS files that are wrong stay wrong: no waiting
            // out the timeout for them.
            Err(e)
                if !e
                    .downcast_ref::<client::ConnectError>()
                    .is_some_and(client::ConnectError::is_retryable) =>
            {
                return Err(
                    e.context("cannot connect to dphandler, and trying again will not help")
                );
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

pub async fn run(conn: &ConnArgs, args: FelixDriverArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::try_from_secs_f64(args.connect_timeout_seconds)
        .context("--connect-timeout-seconds must be a non-negative number")?;
    let (input, mut output) = open_pipes(&args)?;
    let channel = connect(conn, timeout).await?;
    let mut client = v1::dataplane_client::DataplaneClient::new(channel.clone());
    let mut raw_client = DataplaneClient::new(channel);

    // Status first: a DataplaneInSync is replayed to a new watcher anyway.
    let mut status = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await
        .context("opening the StatusUpdates stream")?
        .into_inner();

    // Felix's frames, read on a thread of their own (blocking pipe reads).
    let (to_server, requests) = mpsc::channel::<RawToDataplane>(1024);
    let (end_tx, mut ended) = mpsc::channel::<End>(4);
    let max = args.max_frame_bytes;
    {
        let end_tx = end_tx.clone();
        std::thread::spawn(move || {
            let mut input = std::io::BufReader::with_capacity(1 << 20, input);
            let mut frames = 0u64;
            let end = loop {
                match read_frame(&mut input, max) {
                    Ok(None) => break End::Felix("Felix closed fd 3"),
                    Ok(Some(buf)) => {
                        frames += 1;
                        if to_server.blocking_send(RawToDataplane(buf.into())).is_err() {
                            return; // the stream is gone; said elsewhere
                        }
                    }
                    Err(e) => {
                        break End::Failed(
                            e.context(format!("reading frame {} from Felix", frames + 1)),
                        );
                    }
                }
            };
            let _ = end_tx.blocking_send(end);
        });
    }
    let mut replies = raw_client
        .to_dataplane(tokio_stream::wrappers::ReceiverStream::new(requests))
        .await
        .context("opening the ToDataplane stream")?
        .into_inner();
    // Rejections to stderr (Felix copies it into its log).
    {
        let end_tx = end_tx.clone();
        tokio::spawn(async move {
            let end = loop {
                match replies.message().await {
                    Ok(Some(r)) => {
                        if let Some(to_dataplane_reply::Kind::Rejected(r)) = r.kind {
                            eprintln!(
                                "dphctl felix-driver: rejected: sequence {}: {}: {}",
                                r.sequence_number, r.field, r.reason
                            );
                        }
                    }
                    Ok(None) => {
                        break End::Failed(anyhow::anyhow!(
                            "the server ended the ToDataplane stream"
                        ));
                    }
                    Err(e) => {
                        break End::Failed(anyhow::anyhow!(
                            "lost the server ({}): Felix must restart the driver \
                             to send its snapshot again",
                            e.message()
                        ));
                    }
                }
            };
            let _ = end_tx.send(end).await;
        });
    }
    // FromDataplane frames to fd 4, on a thread (blocking pipe writes).
    let (to_felix, mut frames_out) = mpsc::channel::<Vec<u8>>(1024);
    {
        let end_tx = end_tx.clone();
        std::thread::spawn(move || {
            while let Some(frame) = frames_out.blocking_recv() {
                if let Err(e) = write_frame(&mut output, &frame) {
                    let end = if e.kind() == std::io::ErrorKind::BrokenPipe {
                        End::Felix("Felix closed fd 4")
                    } else {
                        End::Failed(anyhow::Error::from(e).context("writing to Felix (fd 4)"))
                    };
                    let _ = end_tx.blocking_send(end);
                    return;
                }
            }
        });
    }
    {
        let end_tx = end_tx.clone();
        tokio::spawn(async move {
            let end = loop {
                match status.message().await {
                    Ok(Some(u)) => match u.kind {
                        Some(status_update::Kind::Update(f))
                            if to_felix.send(f.encode_to_vec()).await.is_err() =>
                        {
                            return;
                        }
                        Some(status_update::Kind::Update(_)) => {}
                        Some(status_update::Kind::Lagged(l)) => eprintln!(
                            "dphctl felix-driver: {} status updates were lost (Felix read \
                             too slowly); endpoint status may be stale until the next change",
                            l.missed
                        ),
                        None => {}
                    },
                    Ok(None) => {
                        break End::Failed(anyhow::anyhow!(
                            "the server ended the StatusUpdates stream"
                        ));
                    }
                    Err(e) => {
                        break End::Failed(anyhow::anyhow!(
                            "lost the server's StatusUpdates ({})",
                            e.message()
                        ));
                    }
                }
            };
            let _ = end_tx.send(end).await;
        });
    }
    drop(end_tx);

    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("catching SIGINT")?;
    let end = tokio::select! {
        e = ended.recv() => e.unwrap_or(End::Failed(anyhow::anyhow!("every task ended"))),
        _ = term.recv() => End::Felix("SIGTERM"),
        _ = int.recv() => End::Felix("SIGINT"),
    };
    match end {
        End::Felix(why) => {
            eprintln!("dphctl felix-driver: stopping: {why}");
            Ok(ExitCode::SUCCESS)
        }
        End::Failed(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_named() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        write_frame(&mut buf, b"").unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_frame(&mut r, 100).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 100).unwrap().unwrap(), b"");
        assert!(read_frame(&mut r, 100).unwrap().is_none(), "clean end");

        let e = read_frame(&mut &buf[..3], 100).unwrap_err().to_string();
        assert!(e.contains("inside a frame's length"), "{e}");
        let e = format!("{:#}", read_frame(&mut &buf[..10], 100).unwrap_err());
        assert!(e.contains("inside a frame of 5 bytes"), "{e}");
        let e = read_frame(&mut buf.as_slice(), 4).unwrap_err().to_string();
        assert!(e.contains("5 bytes is over the limit of 4"), "{e}");
    }
}
