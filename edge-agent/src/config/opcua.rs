//! `kind = "opcua"` sources: the endpoint, its security and the monitored items as the file
//! holds them, and their typed form.
//!
//! Everything is checked here, once, at load: the endpoint is an `opc.tcp://` URL, the security
//! policy and mode fit each other (policy `None` only with mode `None`, and the reverse), a
//! secure policy has a PKI directory for its trust list, node ids parse, field names are unique,
//! intervals are above zero and deadbands finite and non-negative (a percent one at most 100).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, StreamConfig, host_name, parse_duration, required, resolve_path};

/// The security policies a source may name, as OPC UA spells them.
pub const POLICIES: [&str; 4] = [
    "None",
    "Basic256Sha256",
    "Aes128Sha256RsaOaep",
    "Aes256Sha256RsaPss",
];

/// The longest node id accepted, in bytes (OPC UA string ids have no limit of their own).
const NODE_ID_BYTES_MAX: usize = 4096;

/// An OPC UA server whose variables the agent subscribes to. See `sources::opcua`.
#[derive(Clone, PartialEq)]
pub struct OpcuaSourceConfig {
    /// `endpoint`: the server's `opc.tcp://host:port/path` URL.
    pub endpoint: String,
    /// `security_policy`: one of [`POLICIES`]; default `None`.
    pub security_policy: String,
    /// `security_mode`: message security; default `None` (`Sign` or `SignAndEncrypt` with a
    /// secure policy).
    pub security_mode: SecurityMode,
    /// `user` and `password`: a user name token; anonymous without them.
    pub user: Option<(String, String)>,
    /// `pki_dir`: the client's own key pair (`own/`, `private/`), the trust list (`trusted/`)
    /// and the server certificates refused (`rejected/`); default `data_dir/opcua-pki`.
    pub pki_dir: PathBuf,
    /// `trust_unknown`: accept (and store in `trusted/`) a server certificate the trust list
    /// does not hold; default false.
    pub trust_unknown: bool,
    /// `publishing_interval`: how often the server sends the queued changes; default 1 s.
    pub publishing_interval: Duration,
    /// `timeout`: for each request and for the connect; default 5 s.
    pub timeout: Duration,
    pub stream: String,
    /// `key`: the routing key of every record; default the host name.
    pub key: String,
    /// `queue_max`: data changes held between the client and the log; default 10000.
    pub queue_max: usize,
    /// `[[sources.items]]`: one monitored item each, one field of its records.
    pub items: Vec<OpcuaItem>,
}

impl Eq for OpcuaSourceConfig {}

/// Shows every setting but the password.
impl fmt::Debug for OpcuaSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpcuaSourceConfig")
            .field("endpoint", &self.endpoint)
            .field("security_policy", &self.security_policy)
            .field("security_mode", &self.security_mode)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("pki_dir", &self.pki_dir)
            .field("trust_unknown", &self.trust_unknown)
            .field("publishing_interval", &self.publishing_interval)
            .field("timeout", &self.timeout)
            .field("stream", &self.stream)
            .field("key", &self.key)
            .field("queue_max", &self.queue_max)
            .field("items", &self.items)
            .finish()
    }
}

/// OPC UA message security.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecurityMode {
    None,
    Sign,
    SignAndEncrypt,
}

/// One monitored item: a variable's value changes, sampled by the server.
#[derive(Debug, Clone, PartialEq)]
pub struct OpcuaItem {
    /// `node_id`: such as `ns=2;s=Temp` or `i=2258`.
    pub node_id: String,
    /// `name`: the field its values are stored under.
    pub name: String,
    /// `sampling_interval`: how often the server samples it; default 1 s.
    pub sampling_interval: Duration,
    /// `queue_size`: changes the server queues between publishes; default 10.
    pub queue_size: u32,
    /// `deadband` with `deadband_type`: changes smaller than this are not reported.
    pub deadband: Option<Deadband>,
    /// `tags`: added to each record, after `node`.
    pub tags: Vec<(String, String)>,
}

/// A data change filter's deadband.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Deadband {
    Absolute(f64),
    /// Of the variable's EURange, 0 to 100.
    Percent(f64),
}

/// The settings of a `kind = "opcua"` source, as `RawSource` collects them.
#[derive(Debug, Default)]
pub(super) struct RawOpcua {
    pub endpoint: Option<String>,
    pub security_policy: Option<String>,
    pub security_mode: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub pki_dir: Option<String>,
    pub trust_unknown: Option<String>,
    pub publishing_interval: Option<String>,
    pub timeout: Option<String>,
    pub stream: Option<String>,
    pub key: Option<String>,
    pub queue_max: Option<String>,
    pub items: Option<Vec<RawItem>>,
}

/// `[[sources.items]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawItem {
    node_id: Option<String>,
    name: Option<String>,
    sampling_interval: Option<String>,
    queue_size: Option<String>,
    deadband: Option<String>,
    deadband_type: Option<String>,
    tags: Option<BTreeMap<String, String>>,
}

impl RawOpcua {
    pub(super) fn into_typed(
        self,
        index: usize,
        streams: &[StreamConfig],
        base: &Path,
        data_dir: &Path,
    ) -> Result<OpcuaSourceConfig, ConfigError> {
        let key = |k: &str| format!("sources[{index}].{k}");
        if !cfg!(feature = "opcua") {
            return Err(ConfigError::invalid(
                key("kind"),
                "this agent was built without OPC UA support: build it with \
                 `cargo build -p edge-agent --features opcua`",
            ));
        }
        let endpoint = required(&key("endpoint"), self.endpoint)?;
        endpoint_ok(&key("endpoint"), &endpoint)?;
        let (security_policy, security_mode) =
            security(index, self.security_policy, self.security_mode)?;
        let user = match (self.user, self.password) {
            (Some(u), Some(p)) if !u.is_empty() => Some((u, p)),
            (None, None) => None,
            (Some(_), Some(_)) => {
                return Err(ConfigError::invalid(key("user"), "must not be empty"));
            }
            (Some(_), None) => {
                return Err(ConfigError::invalid(key("password"), "required with user"));
            }
            (None, Some(_)) => {
                return Err(ConfigError::invalid(key("user"), "required with password"));
            }
        };
        let pki_dir = match self.pki_dir {
            Some(p) => resolve_path(&key("pki_dir"), &required(&key("pki_dir"), Some(p))?, base)?,
            None => data_dir.join("opcua-pki"),
        };
        let trust_unknown = parse_bool(&key("trust_unknown"), self.trust_unknown)?;
        let publishing_interval =
            positive(&key("publishing_interval"), self.publishing_interval, 1)?;
        let timeout = positive(&key("timeout"), self.timeout, 5)?;
        let stream = required(&key("stream"), self.stream)?;
        super::source_stream_ok(&key("stream"), &stream, streams)?;
        let queue_max = match self.queue_max {
            None => 10_000,
            Some(s) => s
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=1_000_000).contains(n))
                .ok_or_else(|| {
                    ConfigError::invalid(
                        key("queue_max"),
                        format!("expected 1 to 1000000, found {s:?}"),
                    )
                })?,
        };
        let items = items_typed(index, self.items.unwrap_or_default())?;
        Ok(OpcuaSourceConfig {
            endpoint,
            security_policy,
            security_mode,
            user,
            pki_dir,
            trust_unknown,
            publishing_interval,
            timeout,
            stream,
            key: self.key.filter(|k| !k.is_empty()).unwrap_or_else(host_name),
            queue_max,
            items,
        })
    }
}

/// `opc.tcp://host[:port][/path]`.
fn endpoint_ok(key: &str, url: &str) -> Result<(), ConfigError> {
    let host = url
        .strip_prefix("opc.tcp://")
        .map(|rest| rest.split('/').next().unwrap_or(""))
        .unwrap_or("");
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ConfigError::invalid(
            key,
            format!("expected opc.tcp://host:port/path, found {url:?}"),
        ));
    }
    Ok(())
}

/// The policy and the mode, which must agree on whether messages are secured.
fn security(
    index: usize,
    policy: Option<String>,
    mode: Option<String>,
) -> Result<(String, SecurityMode), ConfigError> {
    let key = |k: &str| format!("sources[{index}].{k}");
    let policy = policy.unwrap_or_else(|| "None".into());
    if !POLICIES.contains(&policy.as_str()) {
        return Err(ConfigError::invalid(
            key("security_policy"),
            format!("expected {}, found {policy:?}", POLICIES.join(" | ")),
        ));
    }
    let default_mode = if policy == "None" {
        "None"
    } else {
        "SignAndEncrypt"
    };
    let mode = match mode.as_deref().unwrap_or(default_mode) {
        "None" => SecurityMode::None,
        "Sign" => SecurityMode::Sign,
        "SignAndEncrypt" => SecurityMode::SignAndEncrypt,
        other => {
            return Err(ConfigError::invalid(
                key("security_mode"),
                format!("expected None | Sign | SignAndEncrypt, found {other:?}"),
            ));
        }
    };
    if (policy == "None") != (mode == SecurityMode::None) {
        return Err(ConfigError::invalid(
            key("security_mode"),
            format!(
                "{mode:?} does not go with security_policy = {policy:?}: policy None goes with mode None only"
            ),
        ));
    }
    Ok((policy, mode))
}

fn parse_bool(key: &str, v: Option<String>) -> Result<bool, ConfigError> {
    match v.as_deref().map(str::trim) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(ConfigError::invalid(
            key,
            format!("expected true | false, found {other:?}"),
        )),
    }
}

/// A duration above zero, `default_s` seconds when unset.
fn positive(key: &str, v: Option<String>, default_s: u64) -> Result<Duration, ConfigError> {
    let d = match v {
        None => Duration::from_secs(default_s),
        Some(s) => parse_duration(key, &s)?,
    };
    if d.is_zero() {
        return Err(ConfigError::invalid(key, "must be above zero, such as 1s"));
    }
    Ok(d)
}

fn items_typed(index: usize, raw: Vec<RawItem>) -> Result<Vec<OpcuaItem>, ConfigError> {
    let key = |k: &str| format!("sources[{index}].{k}");
    if raw.is_empty() {
        return Err(ConfigError::invalid(
            key("items"),
            "expected at least one [[sources.items]] entry",
        ));
    }
    let mut items: Vec<OpcuaItem> = Vec::with_capacity(raw.len());
    for (j, it) in raw.into_iter().enumerate() {
        let it = it.into_typed(&key(&format!("items[{j}]")))?;
        if items.iter().any(|o| o.name == it.name) {
            return Err(ConfigError::invalid(
                key(&format!("items[{j}].name")),
                format!("{:?} is already the name of another item", it.name),
            ));
        }
        items.push(it);
    }
    Ok(items)
}

impl RawItem {
    fn into_typed(self, prefix: &str) -> Result<OpcuaItem, ConfigError> {
        let key = |k: &str| format!("{prefix}.{k}");
        let node_id = required(&key("node_id"), self.node_id)?;
        node_id_ok(&key("node_id"), &node_id)?;
        let name = required(&key("name"), self.name)?;
        let sampling_interval = positive(&key("sampling_interval"), self.sampling_interval, 1)?;
        let queue_size = match self.queue_size {
            None => 10,
            Some(s) => s
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=10_000).contains(n))
                .ok_or_else(|| {
                    ConfigError::invalid(
                        key("queue_size"),
                        format!("expected 1 to 10000, found {s:?}"),
                    )
                })?,
        };
        let deadband = deadband(prefix, self.deadband, self.deadband_type)?;
        let mut tags = vec![("node".to_owned(), node_id.clone())];
        for (k, v) in self.tags.unwrap_or_default() {
            if k == "node" || k.is_empty() {
                return Err(ConfigError::invalid(
                    key(&format!("tags.{k}")),
                    "tag names must not be empty or `node` (the agent sets `node` to the node id)",
                ));
            }
            tags.push((k, v));
        }
        Ok(OpcuaItem {
            node_id,
            name,
            sampling_interval,
            queue_size,
            deadband,
            tags,
        })
    }
}

/// The forms OPC UA's text encoding gives a node id: `ns=N;` then `i=`, `s=`, `g=` or `b=`.
fn node_id_ok(key: &str, id: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| {
        ConfigError::invalid(
            key,
            format!("{why}: expected such as \"ns=2;s=Temp\" or \"i=2258\", found {id:?}"),
        )
    };
    if id.len() > NODE_ID_BYTES_MAX {
        return Err(bad("too long"));
    }
    let rest = match id.strip_prefix("ns=") {
        Some(r) => {
            let (ns, rest) = r.split_once(';').ok_or_else(|| bad("no `;` after ns=N"))?;
            ns.parse::<u16>()
                .map_err(|_| bad("the namespace is not 0 to 65535"))?;
            rest
        }
        None => id,
    };
    let (kind, value) = rest
        .split_at_checked(2)
        .ok_or_else(|| bad("no identifier"))?;
    let ok = match kind {
        "i=" => value.parse::<u32>().is_ok(),
        "s=" | "b=" => !value.is_empty(),
        "g=" => value.len() == 36,
        _ => false,
    };
    if !ok {
        return Err(bad("not a node id"));
    }
    Ok(())
}

fn deadband(
    prefix: &str,
    value: Option<String>,
    ty: Option<String>,
) -> Result<Option<Deadband>, ConfigError> {
    let key = |k: &str| format!("{prefix}.{k}");
    let Some(value) = value else {
        if ty.is_some() {
            return Err(ConfigError::invalid(
                key("deadband"),
                "required with deadband_type",
            ));
        }
        return Ok(None);
    };
    let v = value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| {
            ConfigError::invalid(
                key("deadband"),
                format!("expected a number >= 0, found {value:?}"),
            )
        })?;
    match ty.as_deref().unwrap_or("absolute") {
        "absolute" => Ok(Some(Deadband::Absolute(v))),
        "percent" if v <= 100.0 => Ok(Some(Deadband::Percent(v))),
        "percent" => Err(ConfigError::invalid(
            key("deadband"),
            format!("a percent deadband is 0 to 100, found {v}"),
        )),
        other => Err(ConfigError::invalid(
            key("deadband_type"),
            format!("expected absolute | percent, found {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{EdgeConfig, SourceConfig};
    use super::{Deadband, SecurityMode};

    fn load(source: &str) -> Result<EdgeConfig, super::ConfigError> {
        let text = format!(
            "data_dir = \"d\"\n[[streams]]\nname = \"plant\"\n[[sources]]\nkind = \"opcua\"\n\
             stream = \"plant\"\n{source}"
        );
        EdgeConfig::from_toml(&text, std::path::Path::new("/etc/tributary"), None)
    }

    const ITEM: &str = "[[sources.items]]\nnode_id = \"ns=2;s=Temp\"\nname = \"temp\"\n";

    #[test]
    fn a_full_source_parses_into_types() {
        let cfg = load(&format!(
            "endpoint = \"opc.tcp://127.0.0.1:4840/plc\"\nsecurity_policy = \"Basic256Sha256\"\n\
             user = \"op\"\npassword = \"hunter2\"\npki_dir = \"pki\"\n{ITEM}\
             sampling_interval = \"100ms\"\nqueue_size = \"5\"\ndeadband = \"0.5\"\n\
             deadband_type = \"percent\"\ntags = {{ line = \"3\" }}\n"
        ))
        .unwrap();
        let SourceConfig::Opcua(o) = &cfg.sources[0] else {
            panic!("not an opcua source: {:?}", cfg.sources[0]);
        };
        assert_eq!(o.security_mode, SecurityMode::SignAndEncrypt);
        assert!(o.pki_dir.ends_with("pki"));
        let it = &o.items[0];
        assert_eq!(it.sampling_interval, std::time::Duration::from_millis(100));
        assert_eq!(it.queue_size, 5);
        assert_eq!(it.deadband, Some(Deadband::Percent(0.5)));
        assert_eq!(
            it.tags,
            vec![
                ("node".into(), "ns=2;s=Temp".into()),
                ("line".into(), "3".into())
            ]
        );
        assert!(
            !format!("{cfg:?}").contains("hunter2"),
            "no secret in Debug"
        );
    }

    #[test]
    fn bad_settings_name_their_key() {
        let ep = "endpoint = \"opc.tcp://127.0.0.1:4840\"\n";
        let cases = [
            (
                "endpoint = \"http://x\"\n".to_owned() + ITEM,
                "sources[0].endpoint",
            ),
            (
                format!("{ep}security_policy = \"Basic128\"\n{ITEM}"),
                "sources[0].security_policy",
            ),
            (
                format!("{ep}security_mode = \"Sign\"\n{ITEM}"),
                "sources[0].security_mode",
            ),
            (format!("{ep}user = \"op\"\n{ITEM}"), "sources[0].password"),
            (ep.to_owned(), "sources[0].items"),
            (
                format!("{ep}[[sources.items]]\nnode_id = \"ns=x;s=T\"\nname = \"t\"\n"),
                "sources[0].items[0].node_id",
            ),
            (
                format!("{ep}{ITEM}deadband = \"-1\"\n"),
                "sources[0].items[0].deadband",
            ),
            (
                format!("{ep}{ITEM}deadband = \"1\"\ndeadband_type = \"rel\"\n"),
                "sources[0].items[0].deadband_type",
            ),
            (format!("{ep}{ITEM}{ITEM}"), "sources[0].items[1].name"),
            (
                format!("{ep}{ITEM}tags = {{ node = \"x\" }}\n"),
                "sources[0].items[0].tags.node",
            ),
        ];
        for (text, want) in cases {
            let err = load(&text).expect_err(&text);
            assert_eq!(err.key(), Some(want), "{text}: {err}");
        }
    }
}
