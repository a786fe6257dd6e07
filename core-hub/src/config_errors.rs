//! Config errors in the operator's words: the key as written in TOML
//! (`streams[0].scale.target_records_per_s`, where the `config` crate says
//! `streams[0]scale.target_records_per_s`), and the environment variable when the value came
//! from one (`TRIBUTARY_HUB__LISTEN__HTTP`).

use super::{ConfigError, ENV_PREFIX, ENV_SEPARATOR};
use std::collections::BTreeMap;

/// The keys the environment set, dotted and lowercase as the `config` crate reads them, each
/// with the variable that set it.
#[derive(Debug, Default)]
pub(super) struct EnvKeys(BTreeMap<String, String>);

impl EnvKeys {
    /// From `env` when given (tests), else from the process environment.
    pub(super) fn collect(env: Option<&config::Map<String, String>>) -> EnvKeys {
        let vars: Vec<String> = match env {
            Some(m) => m.keys().cloned().collect(),
            None => std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .collect(),
        };
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}").to_lowercase();
        let keys = vars.into_iter().filter_map(|var| {
            let lower = var.to_lowercase();
            let rest = lower.strip_prefix(&prefix)?;
            Some((rest.replace(ENV_SEPARATOR, "."), var))
        });
        EnvKeys(keys.collect())
    }

    /// `e` with the variable named when the environment set its key.
    pub(super) fn annotate(&self, e: ConfigError) -> ConfigError {
        let ConfigError::Key { key, problem } = e else {
            return e;
        };
        match self.0.get(&key) {
            Some(var) => ConfigError::Env {
                key,
                var: var.clone(),
                problem,
            },
            None => ConfigError::Key { key, problem },
        }
    }
}

/// The `config` crate's error as ours, naming the key as written in TOML.
pub(super) fn from_config_error(e: config::ConfigError) -> ConfigError {
    match e {
        config::ConfigError::Type {
            key: Some(key),
            unexpected,
            expected,
            ..
        } => ConfigError::Key {
            key: dotted(&key),
            problem: format!("expected {expected}, found {unexpected}"),
        },
        config::ConfigError::At {
            error,
            key: Some(key),
            ..
        } => match *error {
            config::ConfigError::Message(m) => match unknown_field(&m) {
                Some((field, tail)) => ConfigError::Key {
                    key: format!("{}.{field}", dotted(&key)),
                    problem: tail,
                },
                None => ConfigError::Key {
                    key: dotted(&key),
                    problem: m,
                },
            },
            other => ConfigError::Key {
                key: dotted(&key),
                problem: other.to_string(),
            },
        },
        config::ConfigError::Message(m) => match unknown_field(&m) {
            Some((field, tail)) => ConfigError::Key {
                key: field,
                problem: tail,
            },
            None => ConfigError::Read(m),
        },
        config::ConfigError::NotFound(key) => ConfigError::Key {
            key: dotted(&key),
            problem: "is required".into(),
        },
        other => ConfigError::Read(other.to_string()),
    }
}

pub(super) use sync::config_key::dotted;

/// serde's "unknown field `x`, expected ..." as the key and "unknown key, expected ...".
fn unknown_field(message: &str) -> Option<(String, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (field, tail) = rest.split_once('`')?;
    Some((field.to_owned(), format!("unknown key{tail}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_keys_name_their_variable() {
        let mut env = config::Map::new();
        env.insert("TRIBUTARY_HUB__LISTEN__HTTP".into(), "x".into());
        env.insert("OTHER__LISTEN__QUIC".into(), "y".into());
        let keys = EnvKeys::collect(Some(&env));
        let e = keys.annotate(ConfigError::Key {
            key: "listen.http".into(),
            problem: "bad".into(),
        });
        let shown = e.to_string();
        assert!(shown.contains("TRIBUTARY_HUB__LISTEN__HTTP"), "{shown}");
        assert!(shown.contains("`listen.http`"), "{shown}");
        let e = keys.annotate(ConfigError::Key {
            key: "listen.quic".into(),
            problem: "bad".into(),
        });
        assert!(matches!(e, ConfigError::Key { .. }), "{e}");
    }
}
