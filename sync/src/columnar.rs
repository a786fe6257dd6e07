//! Columnar block bodies (format version 2).
//!
//! Not yet written: version 2 blocks are refused with a clear error until this module lands.

use crate::record::Record;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ColumnarError {
    #[error("columnar block bodies (format version 2) are not supported by this build")]
    Unsupported,
}

pub fn encode(_records: &[Record]) -> Result<Vec<u8>, ColumnarError> {
    Err(ColumnarError::Unsupported)
}

pub fn decode(_raw: &[u8], _count: u32) -> Result<Vec<Record>, ColumnarError> {
    Err(ColumnarError::Unsupported)
}
