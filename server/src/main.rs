//! `dphandler`: the dataplane daemon.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use dphandler_dataplane::backends::DesiredKernel;
use dphandler_dataplane::sync_loop::LoopConfig;
use dphandler_proto::v1::dataplane_server::DataplaneServer;
use dphandler_server::{connector, grpc::DataplaneService, listen};
use tokio_stream::wrappers::UnixListenerStream;
use tracing::info;

mod demo;

#[derive(Parser, Debug)]
#[command(
    name = "dphandler",
    version,
    about = "Linux dataplane daemon driven over gRPC by a Calico-style calc graph"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "DPH_LOG", default_value = "info", global = true)]
    log: String,
    /// Log as JSON lines.
    #[arg(long, env = "DPH_LOG_JSON", global = true)]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the Dataplane API.
    Serve(ServeArgs),
    /// Run the real server in a sandbox network namespace, push the bundled
    /// scenario through gRPC, wait for DataplaneInSync and print what was
    /// programmed. Needs root; the host's namespace is left alone.
    Demo(demo::DemoArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Unix socket to listen on (mode 0660).
    #[arg(
        long,
        env = "DPH_SOCKET",
        default_value = "/run/dphandler/dataplane.sock"
    )]
    socket: PathBuf,
    /// Largest message accepted, in bytes.
    #[arg(long, env = "DPH_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024 * 1024)]
    max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per connection.
    #[arg(long, env = "DPH_MAX_CONCURRENT_STREAMS", default_value_t = 64)]
    max_concurrent_streams: u32,
    /// Seconds open streams get to finish after SIGTERM/SIGINT.
    #[arg(long, env = "DPH_SHUTDOWN_GRACE_SECONDS", default_value_t = 2.0)]
    shutdown_grace_seconds: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).context("bad --log filter")?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if cli.log_json {
        fmt.json().init()
    } else {
        fmt.init()
    }
    match cli.command {
        Command::Serve(args) => serve(args).await,
        // On Ctrl-C the demo's future is dropped, and with it the guards that
        // stop the server and remove the namespace.
        Command::Demo(args) => tokio::select! {
            r = demo::run(args, &cli.log) => r,
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; sandbox removed"),
        },
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping; kernel state is left as it is"),
        _ = int.recv() => info!("SIGINT: stopping; kernel state is left as it is"),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let grace = std::time::Duration::try_from_secs_f64(args.shutdown_grace_seconds)
        .context("--shutdown-grace-seconds must be a non-negative number")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let loop_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let listener = listen::bind_unix(&args.socket).await?;
    let (conn, loop_task) =
        connector::start(LoopConfig::default(), DesiredKernel::default(), loop_stop);
    info!(socket = %args.socket.display(), "listening");

    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<DataplaneServer<DataplaneService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(dphandler_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let svc = DataplaneServer::new(DataplaneService::new(conn))
        .max_decoding_message_size(args.max_message_bytes)
        .max_encoding_message_size(args.max_message_bytes);

    let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(args.max_concurrent_streams))
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(svc)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
            shutdown_signal().await;
            let _ = signalled_tx.send(true);
        });
    // Streams get a grace period to end cleanly; then we stop anyway.
    tokio::select! {
        r = server => r.context("gRPC server")?,
        () = async {
            let _ = signalled.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        } => info!(?grace, "streams still open after the grace period; stopping"),
    }
    let _ = stop_tx.send(true);
    let _ = loop_task.await;
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
