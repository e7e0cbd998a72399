//! `dphctl status`: GetStatus, as a table or JSON.

use std::process::ExitCode;

use anyhow::Context;
use dphandler_proto::v1;

use crate::ConnArgs;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The canonical-JSON `dphandler.v1.DataplaneStatus`.
    #[arg(long, env = "DPH_STATUS_JSON")]
    json: bool,
}

pub fn render(s: &v1::DataplaneStatus) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut out = format!(
        "in sync:                  {}\n\
         datastore in sync:        {}\n\
         interfaces in sync:       {}\n\
         dirty:                    {}\n\
         last programmed sequence: {}\n\
         applies:                  {} ({} failed)\n\
         feeders / watchers:       {} / {}\n\
         uptime:                   {:.1}s\n",
        yes(s.in_sync),
        yes(s.datastore_in_sync),
        yes(s.interfaces_in_sync),
        yes(s.dirty),
        s.last_programmed_sequence,
        s.applies,
        s.failed_applies,
        s.feeders,
        s.watchers,
        s.uptime_seconds,
    );
    if s.apply_samples > 0 {
        out.push_str(&format!(
            "apply time:               p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (last {} applies)\n",
            s.apply_p50_ms, s.apply_p99_ms, s.apply_max_ms, s.apply_samples
        ));
    }
    if !s.last_error.is_empty() {
        out.push_str(&format!("last error:               {}\n", s.last_error));
    }
    out.push_str("objects:\n");
    let mut kinds: Vec<_> = s.objects.iter().collect();
    kinds.sort();
    if kinds.is_empty() {
        out.push_str("  (none)\n");
    }
    for (kind, n) in kinds {
        out.push_str(&format!("  {kind:<24}{n}\n"));
    }
    if !s.details.is_empty() {
        out.push_str("details:\n");
        let mut details: Vec<_> = s.details.iter().collect();
        details.sort();
        for (k, v) in details {
            out.push_str(&format!("  {k:<32}{v}\n"));
        }
    }
    out
}

pub async fn run(conn: &ConnArgs, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let mut client = conn.connect_to_read().await?;
    let s = client
        .get_status(v1::GetStatusRequest {})
        .await
        .context("GetStatus")?
        .into_inner();
    if args.json {
        println!(
            "{}",
            dphandler_proto::text::to_json("dphandler.v1.DataplaneStatus", &s)?
        );
    } else {
        print!("{}", render(&s));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_kinds_sorted() {
        let s = v1::DataplaneStatus {
            in_sync: true,
            last_programmed_sequence: 42,
            objects: [("policy".to_string(), 3), ("ipset".to_string(), 2)].into(),
            ..Default::default()
        };
        let t = render(&s);
        assert!(t.contains("in sync:                  yes"), "{t}");
        assert!(t.contains("last programmed sequence: 42"), "{t}");
        let ipset = t.find("ipset").unwrap();
        let policy = t.find("policy").unwrap();
        assert!(ipset < policy, "{t}");
        assert!(t.contains("  policy                  3"), "{t}");
    }
}
