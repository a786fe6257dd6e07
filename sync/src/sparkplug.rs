//! The Sparkplug B payload (Eclipse Tahu `sparkplug_b.proto`, `org.eclipse.tahu.protobuf`) as
//! hand-written prost messages, and the decoding of one metric's value by its datatype
//! (cargo feature `sparkplug`). One copy of the wire types for both sides: the edge agent's
//! host application decodes them (`edge-agent/src/sources/sparkplug/`), the hub's Sparkplug
//! republisher encodes them (`core-hub/src/republish/sparkplug.rs`).
//!
//! Only what a host application reads is declared: `Payload` and `Metric` with their scalar
//! fields and the value `oneof`. Metadata, properties, data sets, templates and extensions are
//! kept as opaque bytes (prost skips nothing it is told to keep, and a message field declared as
//! `bytes` reads the same wire bytes), so a payload holding them still decodes. Field numbers
//! follow the Tahu file: Payload {timestamp=1, metrics=2, seq=3, uuid=4, body=5}; Metric
//! {name=1, alias=2, timestamp=3, datatype=4, is_historical=5, is_transient=6, is_null=7,
//! metadata=8, properties=9, value 10..=19}.
//!
//! Decoding ([`decode_value`]) always takes the datatype from the BIRTH: a DATA metric need not
//! carry one, and small signed integers arrive as two's complement in the unsigned `int_value`,
//! so `-1` as an Int8 is `255` (Tahu's Python) or `0xFFFF_FFFF` (Tahu's Java); both read as -1.

use crate::Value;

/// `Payload`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
    #[prost(uint64, optional, tag = "3")]
    pub seq: Option<u64>,
    #[prost(string, optional, tag = "4")]
    pub uuid: Option<String>,
    #[prost(bytes = "vec", optional, tag = "5")]
    pub body: Option<Vec<u8>>,
}

/// `Payload.Metric`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(uint64, optional, tag = "2")]
    pub alias: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "4")]
    pub datatype: Option<u32>,
    #[prost(bool, optional, tag = "5")]
    pub is_historical: Option<bool>,
    #[prost(bool, optional, tag = "6")]
    pub is_transient: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub is_null: Option<bool>,
    /// `MetaData`, kept undecoded.
    #[prost(bytes = "vec", optional, tag = "8")]
    pub metadata: Option<Vec<u8>>,
    /// `PropertySet`, kept undecoded.
    #[prost(bytes = "vec", optional, tag = "9")]
    pub properties: Option<Vec<u8>>,
    #[prost(oneof = "MetricValue", tags = "10, 11, 12, 13, 14, 15, 16, 17, 18, 19")]
    pub value: Option<MetricValue>,
}

/// `Metric.value`. Data sets, templates and extensions are kept as their encoded bytes.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum MetricValue {
    #[prost(uint32, tag = "10")]
    IntValue(u32),
    #[prost(uint64, tag = "11")]
    LongValue(u64),
    #[prost(float, tag = "12")]
    FloatValue(f32),
    #[prost(double, tag = "13")]
    DoubleValue(f64),
    #[prost(bool, tag = "14")]
    BooleanValue(bool),
    #[prost(string, tag = "15")]
    StringValue(String),
    #[prost(bytes = "vec", tag = "16")]
    BytesValue(Vec<u8>),
    #[prost(bytes = "vec", tag = "17")]
    DatasetValue(Vec<u8>),
    #[prost(bytes = "vec", tag = "18")]
    TemplateValue(Vec<u8>),
    #[prost(bytes = "vec", tag = "19")]
    ExtensionValue(Vec<u8>),
}

/// Sparkplug B datatype numbers (`DataType` in the Tahu file).
pub mod datatype {
    pub const INT8: u32 = 1;
    pub const INT16: u32 = 2;
    pub const INT32: u32 = 3;
    pub const INT64: u32 = 4;
    pub const UINT8: u32 = 5;
    pub const UINT16: u32 = 6;
    pub const UINT32: u32 = 7;
    pub const UINT64: u32 = 8;
    pub const FLOAT: u32 = 9;
    pub const DOUBLE: u32 = 10;
    pub const BOOLEAN: u32 = 11;
    pub const STRING: u32 = 12;
    pub const DATETIME: u32 = 13;
    pub const TEXT: u32 = 14;
    pub const UUID: u32 = 15;
    pub const DATASET: u32 = 16;
    pub const BYTES: u32 = 17;
    pub const FILE: u32 = 18;
    pub const TEMPLATE: u32 = 19;
}

/// Why a metric's value was not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricProblem {
    /// DataSet or Template: not mapped to a field (counted as skipped).
    Unsupported(&'static str),
    /// The value does not fit its datatype, or has the wrong wire type (counted as bad).
    Bad(String),
}

/// The field value of metric `m` read as `dt` (the BIRTH's datatype). `Ok(None)`: a null
/// metric (`is_null`), which becomes no field.
pub fn decode_value(m: &Metric, dt: u32) -> Result<Option<Value>, MetricProblem> {
    use MetricValue as V;
    use datatype::*;
    if m.is_null == Some(true) {
        return Ok(None);
    }
    let bad = |what: &str| MetricProblem::Bad(format!("{what} (datatype {dt})"));
    let Some(v) = &m.value else {
        return Err(bad("no value and not is_null"));
    };
    let value = match (dt, v) {
        (INT8, V::IntValue(i)) => {
            Value::I64(signed_small(*i, 8).ok_or_else(|| bad("out of Int8 range"))?)
        }
        (INT16, V::IntValue(i)) => {
            Value::I64(signed_small(*i, 16).ok_or_else(|| bad("out of Int16 range"))?)
        }
        (INT32, V::IntValue(i)) => Value::I64(i64::from(*i as i32)),
        (INT64, V::LongValue(l)) => Value::I64(*l as i64),
        (UINT8, V::IntValue(i)) if *i <= 0xFF => Value::I64(i64::from(*i)),
        (UINT16, V::IntValue(i)) if *i <= 0xFFFF => Value::I64(i64::from(*i)),
        (UINT32, V::IntValue(i)) => Value::I64(i64::from(*i)),
        (UINT64, V::LongValue(l)) => Value::I64(
            i64::try_from(*l)
                .map_err(|_| bad("UInt64 above i64::MAX, which a field cannot hold"))?,
        ),
        // NaN and infinities are refused as everywhere in the agent: no reader could show them.
        (FLOAT, V::FloatValue(f)) if f.is_finite() => Value::F64(f64::from(*f)),
        (DOUBLE, V::DoubleValue(d)) if d.is_finite() => Value::F64(*d),
        (BOOLEAN, V::BooleanValue(b)) => Value::Bool(*b),
        (STRING | TEXT | UUID, V::StringValue(s)) => Value::Str(s.clone()),
        (BYTES | FILE, V::BytesValue(b)) => Value::Bytes(b.clone()),
        // Milliseconds since the Unix epoch, as sent.
        (DATETIME, V::LongValue(l)) => Value::I64(*l as i64),
        (DATASET, _) => return Err(MetricProblem::Unsupported("DataSet")),
        (TEMPLATE, _) => return Err(MetricProblem::Unsupported("Template")),
        (1..=19, _) => return Err(bad("value of the wrong type or out of range")),
        _ => return Err(bad("unknown datatype")),
    };
    Ok(Some(value))
}

/// A signed `bits`-wide integer from the uint32 `int_value`: its low `bits` bits (Tahu's
/// Python adds 2^bits to a negative value) or the whole word sign-extended (Tahu's Java
/// casts). Anything else is out of range.
fn signed_small(raw: u32, bits: u32) -> Option<i64> {
    let min = -(1i64 << (bits - 1));
    let max = (1i64 << (bits - 1)) - 1;
    let word = i64::from(raw as i32);
    if (min..=max).contains(&word) {
        return Some(word);
    }
    if raw < (1u32 << bits) {
        let v = i64::from(raw);
        return Some(if v > max { v - (1i64 << bits) } else { v });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::datatype::*;
    use super::*;
    use prost::Message as _;

    fn metric(v: MetricValue) -> Metric {
        Metric {
            value: Some(v),
            ..Metric::default()
        }
    }

    fn dec(dt: u32, v: MetricValue) -> Result<Option<Value>, MetricProblem> {
        decode_value(&metric(v), dt)
    }

    #[test]
    fn every_datatype() {
        use MetricValue as V;
        let ok = |dt, v, want: Value| assert_eq!(dec(dt, v), Ok(Some(want)), "datatype {dt}");
        ok(INT8, V::IntValue(255), Value::I64(-1));
        ok(INT8, V::IntValue(0xFFFF_FFFF), Value::I64(-1));
        ok(INT8, V::IntValue(127), Value::I64(127));
        ok(INT8, V::IntValue(128), Value::I64(-128));
        ok(INT16, V::IntValue(65_535), Value::I64(-1));
        ok(INT16, V::IntValue(0xFFFF_8000), Value::I64(-32_768));
        ok(INT16, V::IntValue(300), Value::I64(300));
        ok(INT32, V::IntValue(0xFFFF_FFFE), Value::I64(-2));
        ok(INT64, V::LongValue(u64::MAX), Value::I64(-1));
        ok(UINT8, V::IntValue(255), Value::I64(255));
        ok(UINT16, V::IntValue(65_535), Value::I64(65_535));
        ok(UINT32, V::IntValue(u32::MAX), Value::I64(4_294_967_295));
        ok(UINT64, V::LongValue(i64::MAX as u64), Value::I64(i64::MAX));
        ok(FLOAT, V::FloatValue(1.5), Value::F64(1.5));
        ok(DOUBLE, V::DoubleValue(-2.25), Value::F64(-2.25));
        ok(BOOLEAN, V::BooleanValue(true), Value::Bool(true));
        for dt in [STRING, TEXT, UUID] {
            ok(dt, V::StringValue("s".into()), Value::Str("s".into()));
        }
        for dt in [BYTES, FILE] {
            ok(dt, V::BytesValue(vec![0, 1]), Value::Bytes(vec![0, 1]));
        }
        ok(
            DATETIME,
            V::LongValue(1_764_590_400_000),
            Value::I64(1_764_590_400_000),
        );
    }

    #[test]
    fn refusals_and_nulls() {
        use MetricValue as V;
        let bad = |dt, v| {
            assert!(
                matches!(dec(dt, v), Err(MetricProblem::Bad(_))),
                "datatype {dt}"
            )
        };
        bad(UINT64, V::LongValue(u64::MAX));
        bad(INT8, V::IntValue(256));
        bad(INT16, V::IntValue(70_000));
        bad(UINT8, V::IntValue(256));
        bad(UINT16, V::IntValue(65_536));
        bad(FLOAT, V::DoubleValue(1.0));
        bad(FLOAT, V::FloatValue(f32::NAN));
        bad(DOUBLE, V::DoubleValue(f64::INFINITY));
        bad(INT32, V::LongValue(1));
        bad(0, V::IntValue(1));
        bad(99, V::IntValue(1));
        assert!(matches!(
            decode_value(&Metric::default(), INT32),
            Err(MetricProblem::Bad(_))
        ));
        assert_eq!(
            dec(DATASET, V::DatasetValue(vec![])),
            Err(MetricProblem::Unsupported("DataSet"))
        );
        assert_eq!(
            dec(TEMPLATE, V::TemplateValue(vec![])),
            Err(MetricProblem::Unsupported("Template"))
        );
        let null = Metric {
            is_null: Some(true),
            ..Metric::default()
        };
        assert_eq!(decode_value(&null, DOUBLE), Ok(None));
    }

    #[test]
    fn wire_round_trip_with_field_numbers() {
        // Bytes as Tahu's Python encodes them: Metric{name="a"(1), alias=3(2), datatype=1(4),
        // int_value=255(10)}, in Payload{timestamp=5(1), metrics(2), seq=7(3)}.
        let metric = [0x0a, 0x01, b'a', 0x10, 0x03, 0x20, 0x01, 0x50, 0xff, 0x01];
        let mut payload = vec![0x08, 0x05, 0x12, metric.len() as u8];
        payload.extend_from_slice(&metric);
        payload.extend_from_slice(&[0x18, 0x07]);
        let p = Payload::decode(&payload[..]).unwrap();
        assert_eq!(p.timestamp, Some(5));
        assert_eq!(p.seq, Some(7));
        let m = &p.metrics[0];
        assert_eq!(
            (m.name.as_deref(), m.alias, m.datatype),
            (Some("a"), Some(3), Some(1))
        );
        assert_eq!(decode_value(m, INT8), Ok(Some(Value::I64(-1))));
        assert_eq!(p.encode_to_vec(), payload);
    }
}
