//! Where tier 2 lives: a local directory (the default) or an S3-compatible bucket.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Tier-2 location, as it appears in the hub's config (`kind = "local"` or `kind = "s3"`).
/// Its `Debug` shows the secret key as `<redacted>`: configs end up in logs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum TierConfig {
    /// A directory on the hub's own file system (created if missing).
    Local { root: PathBuf },
    /// An S3 or S3-compatible bucket, always with path-style addressing.
    S3 {
        /// e.g. `https://s3.eu-west-1.amazonaws.com` or `http://127.0.0.1:9000`.
        endpoint: String,
        #[serde(default = "default_region")]
        region: String,
        bucket: String,
        /// Falls back to `AWS_ACCESS_KEY_ID` when absent.
        #[serde(default)]
        access_key_id: Option<String>,
        /// Falls back to `AWS_SECRET_ACCESS_KEY` when absent.
        #[serde(default)]
        secret_access_key: Option<String>,
        /// Allow a plain-http endpoint (test servers, a store on a private network).
        #[serde(default)]
        allow_http: bool,
    },
}

fn default_region() -> String {
    "us-east-1".to_owned()
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig::Local {
            root: PathBuf::from("tier2"),
        }
    }
}

impl std::fmt::Debug for TierConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TierConfig::Local { root } => f.debug_struct("Local").field("root", root).finish(),
            TierConfig::S3 {
                endpoint,
                region,
                bucket,
                access_key_id,
                secret_access_key,
                allow_http,
            } => f
                .debug_struct("S3")
                .field("endpoint", endpoint)
                .field("region", region)
                .field("bucket", bucket)
                .field("access_key_id", access_key_id)
                .field(
                    "secret_access_key",
                    &secret_access_key.as_ref().map(|_| "<redacted>"),
                )
                .field("allow_http", allow_http)
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_secret_key() {
        let c = TierConfig::S3 {
            endpoint: "http://127.0.0.1:9000".into(),
            region: "us-east-1".into(),
            bucket: "fleet".into(),
            access_key_id: Some("AKIAEXAMPLE".into()),
            secret_access_key: Some("wJalrXUtnFEMI-secret".into()),
            allow_http: true,
        };
        for shown in [format!("{c:?}"), format!("{c:#?}")] {
            assert!(!shown.contains("wJalrXUtnFEMI"), "{shown}");
            assert!(
                shown.contains("<redacted>") && shown.contains("AKIAEXAMPLE"),
                "{shown}"
            );
        }
    }
}
