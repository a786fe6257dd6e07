//! `core-hub streams [NAME] [--json]` and `core-hub completeness STREAM --from --to [--json]`.

use super::error::{Exit, coded};
use super::output::{self, Table};
use super::target::{self, Target};
use anyhow::Result;
use core_hub::client::query_escape;
use serde_json::Value;

pub fn streams(stream: Option<&str>, json: bool, t: &Target) -> Result<()> {
    super::runtime()?.block_on(async {
        let target = target::api_target(t)?;
        let path = match stream {
            Some(s) => format!("/v1/streams/{}", query_escape(s)),
            None => "/v1/streams".into(),
        };
        let v = target::get_json(&target, &path).await?;
        if json {
            return output::json(&v);
        }
        let text = match stream {
            Some(_) => render_detail(&v),
            None => render_list(&v),
        };
        Ok(output::print(&text)?)
    })
}

/// The stream table.
pub fn render_list(list: &Value) -> String {
    let mut t = Table::new(&["STREAM", "RECORDS", "NEXT OFFSET"]);
    for s in list.as_array().into_iter().flatten() {
        t.row(vec![
            s["name"].as_str().unwrap_or("?").into(),
            s["records"].to_string(),
            s["next_offset"].to_string(),
        ]);
    }
    if t.is_empty() {
        return "no streams yet: nothing has been committed\n".into();
    }
    t.render()
}

/// One stream: counts, rates, segments and per-device completeness.
pub fn render_detail(d: &Value) -> String {
    let mut out = format!(
        "stream        {}\nrecords       {}\nrate          {:.1} records/s (10 s), {:.1} records/s (60 s), {}/s (60 s)\n",
        d["name"].as_str().unwrap_or("?"),
        d["records"],
        d["rates"]["records_per_s_10s"].as_f64().unwrap_or(0.0),
        d["rates"]["records_per_s_60s"].as_f64().unwrap_or(0.0),
        output::size(d["rates"]["bytes_per_s_60s"].as_f64().unwrap_or(0.0) as u64),
    );
    let c = &d["completeness"];
    out.push_str(&format!(
        "watermark     {}\ncomplete to   {}\n",
        output::time(c["watermark_ns"].as_i64()),
        output::time(c["complete_through_ns"].as_i64()),
    ));
    if let Some(segs) = d["segments"]["segments"].as_array() {
        out.push_str(&format!("segments      {}\n", segs.len()));
    }
    let mut t = Table::new(&[
        "DEVICE",
        "ACTIVE",
        "NEWEST EVENT",
        "COMPLETE THROUGH",
        "BACKLOG",
    ]);
    for dev in c["devices"].as_array().into_iter().flatten() {
        t.row(vec![
            dev["device"].as_str().unwrap_or("?").into(),
            if dev["active"] == true { "yes" } else { "no" }.into(),
            output::time(dev["max_event_ts"].as_i64()),
            output::time(dev["complete_through_ns"].as_i64()),
            format!(
                "{} blocks, {}",
                dev["backlog_blocks"],
                output::size(dev["backlog_bytes"].as_u64().unwrap_or(0))
            ),
        ]);
    }
    if !t.is_empty() {
        out.push('\n');
        out.push_str(&t.render());
    }
    out
}

#[derive(clap::Args, Debug)]
pub struct CompletenessArgs {
    pub stream: String,
    /// Start of the window (inclusive): RFC 3339, ns since the Unix epoch, or relative
    /// (`-1h`). Default: the beginning.
    #[arg(long, allow_hyphen_values = true)]
    pub from: Option<String>,
    /// End of the window (exclusive), in the same forms; default: now.
    #[arg(long, allow_hyphen_values = true)]
    pub to: Option<String>,
    /// Print the API's JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub target: Target,
}

/// Asks whether `[from, to)` is complete; the exit code says the answer (0 complete, 4 owed,
/// 5 complete with gaps).
pub fn completeness(a: &CompletenessArgs) -> Result<()> {
    let from = a
        .from
        .as_deref()
        .map(|f| super::time::parse("--from", f))
        .transpose()?;
    let to = match a.to.as_deref() {
        Some(t) => super::time::parse("--to", t)?,
        None => super::time::now_ns(),
    };
    let mut path = format!(
        "/v1/streams/{}/completeness?to={to}",
        query_escape(&a.stream)
    );
    if let Some(from) = from {
        path.push_str(&format!("&from={from}"));
    }
    let v = super::runtime()?.block_on(async {
        let target = target::api_target(&a.target)?;
        target::get_json(&target, &path).await
    })?;
    if a.json {
        output::json(&v)?;
    } else {
        output::print(&render_answer(&v))?;
    }
    match v["status"].as_str() {
        Some("complete") => Ok(()),
        Some("complete_with_gaps") => Err(coded(Exit::Gaps, "")),
        _ => Err(coded(Exit::Owed, "")),
    }
}

/// The answer for people: the verdict, then who owes what and which gaps are lost.
pub fn render_answer(v: &Value) -> String {
    let from = match v["from_ns"].as_i64() {
        Some(i64::MIN) | None => "the beginning".to_string(),
        f => output::time(f),
    };
    let mut out = format!(
        "{} [{from}, {}): {}\n",
        v["stream"].as_str().unwrap_or("?"),
        output::time(v["to_ns"].as_i64()),
        v["status"].as_str().unwrap_or("?").replace('_', " "),
    );
    let mut owed = Table::new(&["OWED BY", "REASON", "LAST CONTACT", "BACKLOG"]);
    for o in v["owed"].as_array().into_iter().flatten() {
        owed.row(vec![
            o["device"].as_str().unwrap_or("?").into(),
            o["reason"].as_str().unwrap_or("?").replace('_', " "),
            output::time(o["last_contact_ns"].as_i64()),
            format!(
                "{} blocks, {}",
                o["blocks"],
                output::size(o["bytes"].as_u64().unwrap_or(0))
            ),
        ]);
    }
    if !owed.is_empty() {
        out.push('\n');
        out.push_str(&owed.render());
    }
    let mut gaps = Table::new(&["GAP IN", "EPOCH", "SEQS", "RECORDS", "REASON"]);
    for g in v["gaps"].as_array().into_iter().flatten() {
        gaps.row(vec![
            g["device"].as_str().unwrap_or("?").into(),
            output::epoch_of(&g["epoch"]),
            format!("{}..={}", g["first_seq"], g["last_seq"]),
            g["records"].to_string(),
            g["reason"].as_str().unwrap_or("").into(),
        ]);
    }
    if !gaps.is_empty() {
        out.push('\n');
        out.push_str(&gaps.render());
    }
    out
}
