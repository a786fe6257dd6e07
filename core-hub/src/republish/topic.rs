//! Topics: the template, the escaping of its placeholders, and the check every topic passes
//! before it is handed to the MQTT client.
//!
//! **The escaping rule.** A placeholder's value (`{stream}`, `{device}`, `{key}`) can only
//! ever fill the topic level it stands in. Each of these characters of the value is replaced
//! by `%` and two upper-case hex digits per byte of its UTF-8 encoding; every other character
//! is kept as it is:
//! - `%` itself (so the rule is reversible by ordinary percent-decoding),
//! - `/` (the level separator), `+` and `#` (wildcards, invalid in a PUBLISH topic),
//! - the control characters U+0000 to U+001F and U+007F to U+009F (MQTT forbids NUL; brokers
//!   such as mosquitto refuse the others and drop the connection),
//! - the Unicode non-characters U+FDD0 to U+FDEF and U+nFFFE, U+nFFFF (refused likewise),
//! - `$` when it is the value's first character (a topic starting with `$` is the broker's,
//!   `$SYS/...`).
//!
//! So the key `a/b` fills one level as `a%2Fb`, `$SYS` becomes `%24SYS`, NUL becomes `%00`.
//!
//! **The check** ([`check_topic`]) runs on every topic, escaped or taken from a record: not
//! empty, at most [`TOPIC_BYTES_LIMIT`] and the configured `republish.topic_bytes_max` bytes
//! (rumqttc writes the length as `as u16`: a longer topic would be truncated on the wire while
//! the packet length stays right, and the rest of it read as other packet fields), no NUL, no
//! `+` or `#`, no leading `$`, no control characters or non-characters. Rust strings are valid
//! UTF-8 by construction, so that part of the rule holds by type.

use std::fmt::Write;

/// MQTT's limit: a topic's length is a 16-bit field.
pub const TOPIC_BYTES_LIMIT: usize = 65_535;

/// A parsed `republish.topic_template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Stream,
    Device,
    Key,
}

/// The values a template's placeholders take for one record.
#[derive(Debug, Clone, Copy)]
pub struct Values<'a> {
    pub stream: &'a str,
    pub device: &'a str,
    pub key: &'a str,
}

/// Why a topic cannot be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("the topic is empty")]
    Empty,
    #[error("the topic is {len} bytes, over the limit of {max}")]
    TooLong { len: usize, max: usize },
    #[error("the topic starts with `$` (reserved for the broker's own topics)")]
    Dollar,
    #[error("the topic contains {what} at byte {at}")]
    Forbidden { what: &'static str, at: usize },
}

impl Template {
    /// Parses a template; names the first problem (unknown placeholder, wildcard, ...).
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            push_literal(&mut parts, &rest[..open]);
            let after = &rest[open..];
            let close = after.find('}').ok_or_else(|| {
                format!("`{{` at byte {} is never closed", text.len() - after.len())
            })?;
            parts.push(match &after[1..close] {
                "stream" => Part::Stream,
                "device" => Part::Device,
                "key" => Part::Key,
                other => {
                    return Err(format!(
                        "unknown placeholder `{{{other}}}`; use {{stream}}, {{device}} or {{key}}"
                    ));
                }
            });
            rest = &after[close + 1..];
        }
        push_literal(&mut parts, rest);
        let template = Template { parts };
        template.check_literals()?;
        Ok(template)
    }

    /// The literal text must be valid in a topic on its own; placeholders are escaped.
    fn check_literals(&self) -> Result<(), String> {
        let probe = self.render_with(Values {
            stream: "s",
            device: "d",
            key: "k",
        });
        if self.parts.is_empty() {
            return Err("is empty".into());
        }
        check_topic(&probe, TOPIC_BYTES_LIMIT).map_err(|e| e.to_string())
    }

    /// The topic for `v`, every placeholder escaped.
    pub fn render(&self, v: Values<'_>) -> String {
        self.render_with(v)
    }

    fn render_with(&self, v: Values<'_>) -> String {
        let mut out = String::with_capacity(64);
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Stream => escape_into(v.stream, &mut out),
                Part::Device => escape_into(v.device, &mut out),
                Part::Key => escape_into(v.key, &mut out),
            }
        }
        out
    }

    /// As [`Template::render`] with the values pasted in raw (the `RawPlaceholders` mutation).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn render_raw(&self, v: Values<'_>) -> String {
        let mut out = String::new();
        for part in &self.parts {
            out.push_str(match part {
                Part::Literal(s) => s,
                Part::Stream => v.stream,
                Part::Device => v.device,
                Part::Key => v.key,
            });
        }
        out
    }
}

fn push_literal(parts: &mut Vec<Part>, s: &str) {
    if !s.is_empty() {
        parts.push(Part::Literal(s.to_string()));
    }
}

/// Whether `c` is a control character or a Unicode non-character.
fn is_control_or_nonchar(c: char) -> bool {
    let u = u32::from(c);
    c.is_control() || (0xFDD0..=0xFDEF).contains(&u) || (u & 0xFFFE) == 0xFFFE
}

/// Appends `value` escaped by the rule in the module docs.
pub fn escape_into(value: &str, out: &mut String) {
    for (i, c) in value.char_indices() {
        let escape =
            matches!(c, '%' | '/' | '+' | '#') || is_control_or_nonchar(c) || (i == 0 && c == '$');
        if escape {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
}

/// `value` escaped by the rule in the module docs.
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    escape_into(value, &mut out);
    out
}

/// Checks a topic before it is published (see the module docs); `max` is the configured
/// `republish.topic_bytes_max`, itself never above [`TOPIC_BYTES_LIMIT`].
pub fn check_topic(topic: &str, max: usize) -> Result<(), TopicError> {
    let max = max.min(TOPIC_BYTES_LIMIT);
    if topic.is_empty() {
        return Err(TopicError::Empty);
    }
    if topic.len() > max {
        return Err(TopicError::TooLong {
            len: topic.len(),
            max,
        });
    }
    if topic.starts_with('$') {
        return Err(TopicError::Dollar);
    }
    for (at, c) in topic.char_indices() {
        let what = match c {
            '\0' => "NUL",
            '+' => "the wildcard `+`",
            '#' => "the wildcard `#`",
            c if is_control_or_nonchar(c) => "a control character or non-character",
            _ => continue,
        };
        return Err(TopicError::Forbidden { what, at });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(key: &str) -> Values<'_> {
        Values {
            stream: "telemetry",
            device: "dev1",
            key,
        }
    }

    #[test]
    fn escaping_table() {
        let cases = [
            ("plain", "plain"),
            ("a/b", "a%2Fb"),
            ("+", "%2B"),
            ("#", "%23"),
            ("$SYS", "%24SYS"),
            ("a$b", "a$b"),
            ("100%", "100%25"),
            ("nul\0", "nul%00"),
            ("tab\t", "tab%09"),
            ("\u{85}", "%C2%85"),
            ("\u{FFFF}", "%EF%BF%BF"),
            ("münchen", "münchen"),
            ("", ""),
        ];
        for (input, want) in cases {
            assert_eq!(escape(input), want, "{input:?}");
        }
    }

    #[test]
    fn a_key_fills_one_level() {
        let t = Template::parse("hub/{stream}/{device}/{key}").unwrap();
        for key in ["a/b", "+", "#", "$SYS/broker", "x\0y", "/", "//a//"] {
            let topic = t.render(v(key));
            assert_eq!(topic.split('/').count(), 4, "{key:?} -> {topic}");
            assert!(topic.starts_with("hub/telemetry/dev1/"), "{topic}");
            check_topic(&topic, 1024).unwrap();
        }
        assert_eq!(t.render(v("a/b")), "hub/telemetry/dev1/a%2Fb");
    }

    #[test]
    fn template_problems_are_named() {
        for (text, want) in [
            ("hub/{nope}", "unknown placeholder `{nope}`"),
            ("hub/{key", "never closed"),
            ("hub/+/{key}", "wildcard `+`"),
            ("hub/#", "wildcard `#`"),
            ("$SYS/{key}", "starts with `$`"),
            ("", "is empty"),
        ] {
            let err = Template::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        // A leading placeholder cannot start the topic with `$`: its `$` is escaped.
        let t = Template::parse("{key}/x").unwrap();
        assert_eq!(t.render(v("$SYS")), "%24SYS/x");
    }

    #[test]
    fn topic_check_table() {
        let long = "a".repeat(70_000);
        let cases: [(&str, Option<&str>); 9] = [
            ("sensors/d1/temp", None),
            ("", Some("empty")),
            ("$SYS/x", Some("starts with `$`")),
            ("a/+/b", Some("wildcard `+`")),
            ("a/#", Some("wildcard `#`")),
            ("a\0b", Some("NUL")),
            ("a\u{1}b", Some("control")),
            ("a\u{FDD0}", Some("non-character")),
            (&long, Some("70000 bytes, over the limit of 1024")),
        ];
        for (topic, want) in cases {
            match (check_topic(topic, 1024), want) {
                (Ok(()), None) => {}
                (Err(e), Some(w)) => assert!(e.to_string().contains(w), "{e}"),
                (got, _) => panic!("{:?}: {got:?}", &topic[..topic.len().min(20)]),
            }
        }
        // The MQTT limit holds whatever is configured.
        assert_eq!(
            check_topic(&long, usize::MAX),
            Err(TopicError::TooLong {
                len: 70_000,
                max: TOPIC_BYTES_LIMIT
            })
        );
    }
}
