//! `dphctl`: push desired state to a dphandler daemon, watch its status
//! updates, query its state.
//!
//! Exit codes: 0 success; 1 error (connection, input, timeout); 2 usage;
//! 3 the server rejected some messages (the rest were applied);
//! 4 accepted but not programmed, because no feeder has sent InSync yet.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use dphandler_proto::client::{self, TlsFiles};
use dphandler_proto::v1::dataplane_client::DataplaneClient;
use tonic::transport::Channel;

mod felix_driver;
mod push;
mod status;
mod watch;

#[derive(Parser, Debug)]
#[command(
    name = "dphctl",
    version,
    about = "Push state to, watch and query a dphandler daemon",
    after_help = "Exit codes: 0 ok, 1 error, 2 usage, 3 messages rejected, \
                  4 accepted but not programmed (no InSync yet)."
)]
struct Cli {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    command: Command,
}

/// Where the daemon is; the same names (and `DPH_*` variables) as
/// `dphandler serve`.
#[derive(clap::Args, Debug)]
struct ConnArgs {
    /// The daemon's unix socket.
    #[arg(
        long,
        env = "DPH_SOCKET",
        default_value = "/run/dphandler/dataplane.sock",
        global = true
    )]
    socket: PathBuf,
    /// Connect over TCP to HOST:PORT instead of the unix socket (TLS unless
    /// --insecure-tcp).
    #[arg(long, env = "DPH_TCP", global = true)]
    tcp: Option<String>,
    /// CA bundle (PEM) that signed the server's certificate.
    #[arg(long, env = "DPH_TLS_CA", global = true)]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to the server.
    #[arg(long, env = "DPH_TLS_CERT", global = true)]
    tls_cert: Option<PathBuf>,
    /// Key (PEM) of the client certificate.
    #[arg(long, env = "DPH_TLS_KEY", global = true)]
    tls_key: Option<PathBuf>,
    /// Name the server's certificate must carry (default: the host of --tcp).
    #[arg(long, env = "DPH_TLS_SERVER_NAME", global = true)]
    tls_server_name: Option<String>,
    /// Plain TCP, without TLS (only for a server started with --insecure-tcp).
    #[arg(long, env = "DPH_INSECURE_TCP", global = true)]
    insecure_tcp: bool,
}

impl ConnArgs {
    /// For what only reads (status, watch): the socket, else (one that
    /// may not be written: a user outside its group) the read-only status
    /// socket beside it.
    async fn connect_to_read(&self) -> anyhow::Result<DataplaneClient<Channel>> {
        if self.tcp.is_some() {
            return self.connect().await;
        }
        match client::connect_unix(&self.socket).await {
            Ok(c) => Ok(c),
            Err(e) => {
                let status = client::status_socket(&self.socket);
                if !status.exists() {
                    return Err(e)
                        .context("is `dphandler serve` running, and may you use its socket?");
                }
                client::connect_unix(&status).await.with_context(|| {
                    format!(
                        "neither {} ({e}) nor its read-only {} answers",
                        self.socket.display(),
                        status.display()
                    )
                })
            }
        }
    }

    async fn connect(&self) -> anyhow::Result<DataplaneClient<Channel>> {
        self.channel().await.map(DataplaneClient::new)
    }

    /// The connection of [`ConnArgs::connect`], for a client of any stubs.
    async fn channel(&self) -> anyhow::Result<Channel> {
        let Some(addr) = &self.tcp else {
            return client::channel_unix(&self.socket)
                .await
                .context("is `dphandler serve` running, and may you use its socket?");
        };
        let tls = match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => Some(TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                server_name: self.tls_server_name.clone(),
            }),
            (None, None, None) if self.insecure_tcp => None,
            (None, None, None) => bail!(
                "--tcp needs --tls-ca, --tls-cert and --tls-key (or --insecure-tcp for a \
                 server started with --insecure-tcp)"
            ),
            _ => bail!("--tls-ca, --tls-cert and --tls-key go together"),
        };
        Ok(client::channel_tcp(addr, tls.as_ref()).await?)
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Send felix.ToDataplane messages (YAML, JSON or NDJSON, canonical
    /// protobuf JSON mapping) and wait until they are programmed.
    Push(push::PushArgs),
    /// Print the daemon's status updates (felix.FromDataplane) as they come.
    Watch(watch::WatchArgs),
    /// Show whether the dataplane is in sync and what it holds.
    Status(status::StatusArgs),
    /// Felix's external dataplane driver: run by Felix
    /// (UseInternalDataplaneDriver=false) with its pipes on fds 3 and 4;
    /// forwards its messages to the daemon and the daemon's status back.
    /// Also what `dphctl` does when called as `dphandler-felix-driver`.
    FelixDriver(felix_driver::FelixDriverArgs),
}

/// The name under which `dphctl` is Felix's driver: Felix runs its
/// `DataplaneDriver` without arguments.
const DRIVER_NAME: &str = "dphandler-felix-driver";

#[tokio::main]
async fn main() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.first().is_some_and(|a| {
        std::path::Path::new(a)
            .file_name()
            .is_some_and(|n| n == DRIVER_NAME)
    }) {
        argv.insert(1, "felix-driver".into());
    }
    let cli = Cli::parse_from(argv);
    let result = match cli.command {
        Command::FelixDriver(a) => felix_driver::run(&cli.conn, a).await,
        Command::Push(a) => push::run(&cli.conn, a).await,
        Command::Watch(a) => watch::run(&cli.conn, a).await,
        Command::Status(a) => status::run(&cli.conn, a).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dphctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
