//! Where to cut a run of records into blocks that the columnar encoder accepts.
//!
//! A version 2 body holds at most [`COLUMNS_MAX`] distinct (field name, type) columns, and a
//! reader refuses a block that decodes to more than its `decoded_bytes_max`. A producer batch,
//! a pending block or a backlog run can exceed either when its records carry many distinct
//! field names. The sealer and the re-blocker therefore cut such a run into several blocks
//! instead of failing it: [`cut`] gives the run lengths, each within [`CutLimits`], in record
//! order, never empty. A single record over a limit gets a run of its own (its fields are
//! bounded before it reaches a sealer: `fields_per_record_max` on the agent).

use std::collections::HashSet;

use super::COLUMNS_MAX;
use crate::decoded;
use crate::record::Record;

/// What one block may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutLimits {
    /// Records per block.
    pub records_max: usize,
    /// Distinct (field name, type) columns per block; at most [`COLUMNS_MAX`].
    pub columns_max: usize,
    /// Decoded size ([`crate::decoded`]) per block.
    pub decoded_bytes_max: u64,
}

impl Default for CutLimits {
    /// Whatever the format and a default reader accept.
    fn default() -> Self {
        CutLimits {
            records_max: u32::MAX as usize,
            columns_max: COLUMNS_MAX,
            decoded_bytes_max: crate::block::DECODED_BYTES_MAX_DEFAULT,
        }
    }
}

/// The lengths of consecutive runs of `records`, each within `limits` (see the module docs).
/// Empty for no records. Linear in the number of fields: a record whose fields could not add a
/// column (the run cannot reach the column limit) is not hashed at all.
pub fn cut(records: &[Record], limits: &CutLimits) -> Vec<usize> {
    assert!(
        limits.columns_max <= COLUMNS_MAX,
        "columns_max above the format's"
    );
    let mut out = Vec::new();
    let mut run = Run::default();
    for i in 0..records.len() {
        if !run.try_add(&records[i - run.records..=i], limits) {
            out.push(run.records);
            run = Run::default();
            assert!(
                run.try_add(&records[i..=i], limits),
                "an empty run takes any record"
            );
        }
    }
    if run.records > 0 {
        out.push(run.records);
    }
    out
}

/// The run being built: its size, and its columns once they could reach the limit.
#[derive(Default)]
struct Run<'r> {
    records: usize,
    decoded: u64,
    /// Fields in the run so far: an upper bound of its distinct columns.
    fields: usize,
    /// The distinct columns, tracked only once `fields` could exceed the limit.
    columns: Option<HashSet<(&'r str, u8)>>,
}

impl<'r> Run<'r> {
    /// Adds the last record of `run` (the run so far, that record included) if the run stays
    /// within `limits`; a run that is empty takes any record.
    fn try_add(&mut self, run: &'r [Record], limits: &CutLimits) -> bool {
        let (r, before) = run.split_last().expect("a run holds the record added");
        let size = decoded::record_bytes(r);
        let first = self.records == 0;
        if !first
            && (self.records + 1 > limits.records_max
                || self.decoded + size > limits.decoded_bytes_max)
        {
            return false;
        }
        if self.columns.is_none() && self.fields + r.fields.len() > limits.columns_max {
            // The limit is reachable only now: count the run's distinct columns exactly, once.
            self.columns = Some(columns_of(before));
        }
        if let Some(cols) = &mut self.columns {
            let new = r
                .fields
                .iter()
                .filter(|(n, v)| !cols.contains(&(n.as_str(), v.type_tag())))
                .count();
            if !first && cols.len() + new > limits.columns_max {
                return false;
            }
            cols.extend(r.fields.iter().map(|(n, v)| (n.as_str(), v.type_tag())));
        }
        self.records += 1;
        self.decoded += size;
        self.fields += r.fields.len();
        true
    }
}

fn columns_of(records: &[Record]) -> HashSet<(&str, u8)> {
    let mut cols = HashSet::new();
    for r in records {
        cols.extend(r.fields.iter().map(|(n, v)| (n.as_str(), v.type_tag())));
    }
    cols
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Value;

    fn rec(names: &[String]) -> Record {
        Record {
            tags: Vec::new(),
            key: "k".into(),
            ts: 1,
            fields: names.iter().map(|n| (n.clone(), Value::I64(1))).collect(),
        }
    }

    fn limits(columns_max: usize) -> CutLimits {
        CutLimits {
            columns_max,
            ..CutLimits::default()
        }
    }

    #[test]
    fn cuts_at_the_column_limit() {
        let names =
            |from: usize| -> Vec<String> { (from..from + 3).map(|i| format!("f{i}")).collect() };
        // Three records of three new names each, at most five columns a block.
        let recs: Vec<Record> = (0..3).map(|i| rec(&names(i * 3))).collect();
        assert_eq!(cut(&recs, &limits(5)), vec![1, 1, 1]);
        assert_eq!(cut(&recs, &limits(6)), vec![2, 1]);
        // The same names again never add a column.
        let same: Vec<Record> = (0..100).map(|_| rec(&names(0))).collect();
        assert_eq!(cut(&same, &limits(3)), vec![100]);
        // A record over the limit still gets a run of its own.
        let wide = vec![
            rec(&names(0)),
            rec(&(0..10).map(|i| format!("w{i}")).collect::<Vec<_>>()),
        ];
        assert_eq!(cut(&wide, &limits(5)), vec![1, 1]);
        assert!(cut(&[], &limits(5)).is_empty());
    }

    #[test]
    fn a_type_change_is_a_new_column() {
        let mut a = rec(&["x".to_string()]);
        let b = a.clone();
        a.fields[0].1 = Value::F64(1.0);
        assert_eq!(cut(&[a, b], &limits(1)), vec![1, 1]);
    }

    #[test]
    fn cuts_by_records_and_decoded_bytes() {
        let recs: Vec<Record> = (0..10).map(|_| rec(&["x".to_string()])).collect();
        let by_count = CutLimits {
            records_max: 4,
            ..CutLimits::default()
        };
        assert_eq!(cut(&recs, &by_count), vec![4, 4, 2]);
        let one = decoded::record_bytes(&recs[0]);
        let by_size = CutLimits {
            decoded_bytes_max: one * 3,
            ..CutLimits::default()
        };
        assert_eq!(cut(&recs, &by_size), vec![3, 3, 3, 1]);
    }
}
