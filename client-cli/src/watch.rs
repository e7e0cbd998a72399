//! `dphctl watch`: the StatusUpdates stream, one line per update.

use std::process::ExitCode;

use anyhow::Context;
use dphandler_proto::text::to_json;
use dphandler_proto::v1::{self, status_update::Kind};

use crate::ConnArgs;

#[derive(clap::Args, Debug)]
pub struct WatchArgs {
    /// One canonical-JSON `dphandler.v1.StatusUpdate` per line.
    #[arg(long, env = "DPH_WATCH_JSON")]
    json: bool,
    /// Stop after this many updates.
    #[arg(long, env = "DPH_WATCH_COUNT")]
    count: Option<u64>,
    /// Stop once DataplaneInSync has been seen.
    #[arg(long, env = "DPH_WATCH_UNTIL_IN_SYNC")]
    until_in_sync: bool,
}

/// `DataplaneInSync`, or `WorkloadEndpointStatusUpdate {"id":…,"status":…}`:
/// the payload's name and its fields in canonical JSON.
pub fn human(update: &v1::StatusUpdate) -> anyhow::Result<String> {
    match &update.kind {
        Some(Kind::Lagged(l)) => Ok(format!(
            "Lagged: this watcher read too slowly and missed {} updates",
            l.missed
        )),
        Some(Kind::Update(f)) => {
            let json: serde_json::Value =
                serde_json::from_str(&to_json("felix.FromDataplane", f)?)?;
            let obj = json
                .as_object()
                .context("FromDataplane renders as an object")?;
            let Some((key, value)) = obj.iter().find(|(k, _)| *k != "sequenceNumber") else {
                return Ok("(empty update)".into());
            };
            let mut name = key.clone();
            if let Some(first) = name.get_mut(0..1) {
                first.make_ascii_uppercase();
            }
            match value.as_object() {
                Some(o) if o.is_empty() => Ok(name),
                _ => Ok(format!("{name} {value}")),
            }
        }
        None => Ok("(empty update)".into()),
    }
}

fn is_in_sync(update: &v1::StatusUpdate) -> bool {
    use dphandler_proto::felix::from_dataplane::Payload;
    matches!(
        &update.kind,
        Some(Kind::Update(f)) if matches!(f.payload, Some(Payload::DataplaneInSync(_)))
    )
}

pub async fn run(conn: &ConnArgs, args: WatchArgs) -> anyhow::Result<ExitCode> {
    let mut client = conn.connect_to_read().await?;
    let mut stream = client
        .status_updates(v1::StatusUpdatesRequest {})
        .await
        .context("opening StatusUpdates")?
        .into_inner();
    let mut seen = 0u64;
    while let Some(update) = stream.message().await.context("StatusUpdates failed")? {
        if args.json {
            println!("{}", to_json("dphandler.v1.StatusUpdate", &update)?);
        } else {
            println!("{}", human(&update)?);
        }
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) || (args.until_in_sync && is_in_sync(&update)) {
            break;
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dphandler_proto::felix::{self, from_dataplane::Payload};

    fn upd(p: Payload) -> v1::StatusUpdate {
        v1::StatusUpdate {
            kind: Some(Kind::Update(felix::FromDataplane {
                sequence_number: 0,
                payload: Some(p),
            })),
        }
    }

    #[test]
    fn human_lines() {
        let in_sync = upd(Payload::DataplaneInSync(felix::DataplaneInSync {}));
        assert_eq!(human(&in_sync).unwrap(), "DataplaneInSync");
        assert!(is_in_sync(&in_sync));
        let ps = upd(Payload::ProcessStatusUpdate(felix::ProcessStatusUpdate {
            iso_timestamp: "2026-12-03T10:00:00Z".into(),
            uptime: 1.5,
        }));
        assert_eq!(
            human(&ps).unwrap(),
            r#"ProcessStatusUpdate {"isoTimestamp":"2026-12-03T10:00:00Z","uptime":1.5}"#
        );
        assert!(!is_in_sync(&ps));
        let lag = v1::StatusUpdate {
            kind: Some(Kind::Lagged(v1::Lagged { missed: 7 })),
        };
        assert!(human(&lag).unwrap().contains("missed 7"));
    }
}
