//! InfluxDB drop-in write endpoints: `POST /write` (v1) and `POST /api/v2/write` (v2), so
//! Telegraf's `outputs.influxdb` and `outputs.influxdb_v2` and every Influx client library write
//! to the agent unchanged.
//!
//! - The stream: v1's `db` or v2's `bucket` names it, or `http.influx_streams` maps the name
//!   to one (`{ telegraf = "metrics" }`). Unknown: 404 naming it.
//! - A body may mix measurements (`cpu`, `mem`, `disk` in one Telegraf batch): each record
//!   keeps its measurement as the tag `measurement` (a line that has its own tag of that name
//!   is refused), so the routing key, derived from the tags, tells the measurements apart.
//! - `precision`: v1 `n`, `u`, `ms`, `s` (and `ns`, `us`); v2 `ns`, `us`, `ms`, `s`. Nanoseconds
//!   by default.
//! - Auth, when `http.token` is set: `Authorization: Token <token>` (what Influx clients send)
//!   or `Bearer <token>`, or v1's `p=<token>` query parameter.
//! - Answers: 204 once the batch is durable; 400 `{"code":"invalid","message",...,"line"}` on a
//!   parse error, naming the line; 401; 404; 413; 503 with `Retry-After` when the disk budget
//!   is full. `Content-Encoding: gzip` bodies are decompressed by the shared body layer
//!   ([`super::limits`]).
//! - `Idempotency-Key`: the records route's keyed path (`super::idempotency`); the body digest
//!   covers the precision too ([`digest_label`]). A replay is 204 with
//!   `Idempotency-Replayed: true`; 409, 422 and 503 answer as on the records route.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sync::Record;
use sync::parse::{ParseOptions, parse_line_protocol_with};
use sync::time::TimeUnit;

/// The tag each record's measurement is kept in.
pub const MEASUREMENT_TAG: &str = "measurement";

/// Which write API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    V1,
    V2,
}

impl Api {
    /// The query parameter that names the target.
    fn target_param(self) -> &'static str {
        match self {
            Api::V1 => "db",
            Api::V2 => "bucket",
        }
    }
}

/// What the query string of a write says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteQuery {
    /// `db` or `bucket`.
    pub target: String,
    pub precision: TimeUnit,
    /// v1's `p` (password), which Influx v1 clients use to carry a token.
    pub password: Option<String>,
}

/// Parses the query of a write on `api`; the error is the message of a 400.
pub fn parse_query(api: Api, query: Option<&str>) -> Result<WriteQuery, String> {
    let mut target = None;
    let mut precision = TimeUnit::Ns;
    let mut password = None;
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            k if k == api.target_param() => target = Some(v.into_owned()),
            "precision" => precision = parse_precision(api, &v)?,
            "p" if api == Api::V1 => password = Some(v.into_owned()),
            _ => {}
        }
    }
    let param = api.target_param();
    let target = target
        .filter(|t| !t.is_empty())
        .ok_or_else(|| format!("the query parameter {param} is required: it names the stream"))?;
    Ok(WriteQuery {
        target,
        precision,
        password,
    })
}

fn parse_precision(api: Api, v: &str) -> Result<TimeUnit, String> {
    let unit = match (api, v) {
        (Api::V1, "n") => Ok(TimeUnit::Ns),
        (Api::V1, "u") => Ok(TimeUnit::Us),
        (_, v) => TimeUnit::parse(v),
    };
    unit.map_err(|_| {
        let allowed = match api {
            Api::V1 => "n, u, ms or s",
            Api::V2 => "ns, us, ms or s",
        };
        format!("precision {v:?} is not one of {allowed}")
    })
}

/// The stream a `db` or `bucket` writes to: its mapping in `http.influx_streams`, else itself.
pub fn stream_of<'a>(target: &'a str, map: &'a BTreeMap<String, String>) -> &'a str {
    map.get(target).map_or(target, String::as_str)
}

/// The token a request carries: `Authorization: Token ..` or `Bearer ..`, else v1's `p`.
pub fn given_token<'a>(headers: &'a HeaderMap, query: &'a WriteQuery) -> Option<&'a str> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    auth.and_then(|v| {
        v.strip_prefix("Token ")
            .or_else(|| v.strip_prefix("Bearer "))
    })
    .or(query.password.as_deref())
}

/// What an `Idempotency-Key`'s body digest covers besides the body: the precision, which
/// changes the records the same lines become. Stored in the log with the key: stable.
pub fn digest_label(precision: TimeUnit) -> String {
    format!("text/plain; influx precision={}", precision.name())
}

/// Why a body could not be taken, with the 1-based line it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    pub line: usize,
    pub message: String,
}

/// Parses a line-protocol body of any measurements: each record gets its measurement as the
/// [`MEASUREMENT_TAG`] tag, and its key derived from all its tags.
pub fn parse_body(text: &str, opts: &ParseOptions) -> Result<Vec<Record>, LineError> {
    let lines =
        parse_line_protocol_with(text, opts, Some(MEASUREMENT_TAG)).map_err(|e| LineError {
            line: e.line,
            message: e.to_string(),
        })?;
    let records: Vec<Record> = lines.into_iter().map(|l| l.record).collect();
    if records.is_empty() {
        return Err(LineError {
            line: 1,
            message: "the body holds no lines".into(),
        });
    }
    Ok(records)
}

/// An error in the shape Influx clients log: `{"code","message"}`, plus the line when known.
pub fn influx_error(
    status: StatusCode,
    code: &str,
    message: &str,
    line: Option<usize>,
) -> Response {
    let mut body = json!({ "code": code, "message": message });
    if let Some(line) = line {
        body["line"] = line.into();
    }
    let mut r = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Token"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ParseOptions {
        ParseOptions {
            default_ts: Some(7),
            ..ParseOptions::default()
        }
    }

    #[test]
    fn queries_name_the_target_and_the_precision() {
        let q = parse_query(Api::V1, Some("db=telegraf&precision=u&p=s3cret")).unwrap();
        assert_eq!(
            q,
            WriteQuery {
                target: "telegraf".into(),
                precision: TimeUnit::Us,
                password: Some("s3cret".into()),
            }
        );
        let q = parse_query(Api::V2, Some("org=o&bucket=my%20b&precision=ms")).unwrap();
        assert_eq!((q.target.as_str(), q.precision), ("my b", TimeUnit::Ms));
        assert_eq!(
            parse_query(Api::V2, Some("bucket=b")).unwrap().precision,
            TimeUnit::Ns
        );
        let e = parse_query(Api::V2, Some("db=x")).unwrap_err();
        assert!(e.contains("bucket is required"), "{e}");
        let e = parse_query(Api::V2, Some("bucket=b&precision=n")).unwrap_err();
        assert!(e.contains("ns, us, ms or s"), "{e}");
        let e = parse_query(Api::V1, Some("db=b&precision=h")).unwrap_err();
        assert!(e.contains("n, u, ms or s"), "{e}");
    }

    #[test]
    fn mapping_and_tokens() {
        let map = BTreeMap::from([("telegraf".to_owned(), "metrics".to_owned())]);
        assert_eq!(stream_of("telegraf", &map), "metrics");
        assert_eq!(stream_of("other", &map), "other");
        let q = parse_query(Api::V1, Some("db=x&p=pw")).unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(given_token(&h, &q), Some("pw"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Token t1"));
        assert_eq!(given_token(&h, &q), Some("t1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t2"));
        assert_eq!(given_token(&h, &q), Some("t2"));
    }

    #[test]
    fn a_mixed_batch_keeps_each_measurement_as_a_tag() {
        let body = "cpu,host=gw-01 usage=1.5 1\nmem,host=gw-01 used=10i 2\n\ndisk,host=gw-01,path=/ free=3u\n";
        let recs = parse_body(body, &opts()).unwrap();
        let keys: Vec<&str> = recs.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "host=gw-01/measurement=cpu",
                "host=gw-01/measurement=mem",
                "host=gw-01/measurement=disk/path=%2F"
            ]
        );
        assert_eq!(recs[2].tag("path"), Some("/"));
        assert_eq!(recs[2].ts, 7);
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse_body("cpu x=1 1\ncpu x= 2\n", &opts()).unwrap_err();
        assert_eq!(e.line, 2, "{e:?}");
        let e = parse_body("cpu x=1 1\n# c\ncpu,measurement=m x=1 2\n", &opts()).unwrap_err();
        assert_eq!(e.line, 3, "{e:?}");
        assert!(e.message.contains("\"measurement\""), "{e:?}");
        assert_eq!(parse_body("# only\n", &opts()).unwrap_err().line, 1);
    }
}
