//! `core-hub devices [list|retire ID [--undo]] [--json]`.

use super::output::{self, Table};
use super::target::{self, Target};
use anyhow::Result;
use serde_json::Value;

#[derive(clap::Subcommand, Debug)]
pub enum DevicesCmd {
    /// List devices (the default).
    List {
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Take a scrapped device out of every completeness answer and watermark.
    Retire {
        /// The device id (its certificate CN).
        id: String,
        /// Put a retired device back instead.
        #[arg(long)]
        undo: bool,
        #[command(flatten)]
        target: Target,
    },
}

pub fn devices(cmd: Option<DevicesCmd>, json: bool, t: Target) -> Result<()> {
    let rt = super::runtime()?;
    match cmd {
        None => rt.block_on(list(json, &t)),
        Some(DevicesCmd::List { json, target }) => rt.block_on(list(json, &target)),
        Some(DevicesCmd::Retire { id, undo, target }) => rt.block_on(retire(&id, undo, &target)),
    }
}

async fn list(json: bool, t: &Target) -> Result<()> {
    let target = target::api_target(t)?;
    let list = target::get_json(&target, "/v1/devices").await?;
    if json {
        return output::json(&list);
    }
    output::print(&render(&list))?;
    Ok(())
}

/// The device table: one row per device and stream mark.
pub fn render(list: &Value) -> String {
    let mut t = Table::new(&[
        "DEVICE",
        "STATE",
        "LAST CONTACT",
        "STREAM",
        "EPOCH",
        "DURABLE",
        "TIERED",
        "BACKLOG",
        "GAPS",
    ]);
    for d in list.as_array().into_iter().flatten() {
        let state = if d["retired"] == true {
            "retired".to_string()
        } else if let Some(r) = d["revoked"]["reason"].as_str() {
            format!("revoked: {r}")
        } else if let Some(f) = d["fenced"].as_str() {
            format!("fenced: {f}")
        } else {
            "active".to_string()
        };
        let id = d["id"].as_str().unwrap_or("?").to_string();
        let contact = output::time(d["last_contact_ns"].as_i64());
        let gaps = d["gaps"].as_array().map_or(0, Vec::len);
        let marks: Vec<&Value> = d["marks"].as_array().into_iter().flatten().collect();
        if marks.is_empty() {
            t.row(vec![
                id,
                state,
                contact,
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                gaps.to_string(),
            ]);
            continue;
        }
        for m in marks {
            let stream = m["stream"].as_str().unwrap_or("?");
            let backlog = d["backlog"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|b| b["stream"] == stream)
                .map_or("-".into(), |b| {
                    format!(
                        "{} blocks, {}",
                        b["blocks"],
                        output::size(b["bytes"].as_u64().unwrap_or(0))
                    )
                });
            t.row(vec![
                id.clone(),
                state.clone(),
                contact.clone(),
                stream.to_string(),
                output::epoch_of(&m["epoch"]),
                m["durable_seq"].to_string(),
                m["tiered_seq"].to_string(),
                backlog,
                gaps.to_string(),
            ]);
        }
    }
    if t.is_empty() {
        return "no devices have connected yet\n".into();
    }
    t.render()
}

async fn retire(id: &str, undo: bool, t: &Target) -> Result<()> {
    let target = target::api_target(t)?;
    let path = format!(
        "/v1/devices/{}/retire{}",
        core_hub::client::query_escape(id),
        if undo { "?undo=true" } else { "" }
    );
    target::post_ok(&target, &path).await?;
    let msg = if undo {
        format!("{id} is active again\n")
    } else {
        format!("retired {id}: it is left out of completeness answers and watermarks\n")
    };
    Ok(output::print(&msg)?)
}
