//! Mooncake-format traces: JSONL, one request a line
//! (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`: one id per 512-token block).

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRequest {
    #[serde(default)]
    pub timestamp: u64,
    #[serde(default)]
    pub input_length: u64,
    #[serde(default)]
    pub output_length: u64,
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: blank line")]
    Blank { path: PathBuf, line: usize },
    #[error("{path}:{line}: malformed request: {reason}")]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// Streams a trace's requests in file order; every blank or malformed line is an error that
/// names its line number.
pub struct TraceReader {
    path: PathBuf,
    lines: std::io::Lines<BufReader<File>>,
    line: usize,
}

impl TraceReader {
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            lines: BufReader::new(file).lines(),
            line: 0,
        })
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        let text = self.lines.next()?;
        self.line += 1;
        Some(parse_line(&self.path, self.line, text))
    }
}

fn parse_line(
    path: &Path,
    line: usize,
    text: std::io::Result<String>,
) -> Result<TraceRequest, TraceError> {
    let text = text.map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    if text.trim().is_empty() {
        return Err(TraceError::Blank {
            path: path.to_owned(),
            line,
        });
    }
    serde_json::from_str(&text).map_err(|e| TraceError::Malformed {
        path: path.to_owned(),
        line,
        reason: e.to_string(),
    })
}

/// Reads a whole trace.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    TraceReader::open(path)?.collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(content: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(content.as_bytes()).unwrap();
        f
    }

    #[test]
    fn reads_requests_and_names_bad_lines() {
        let ok = write("{\"timestamp\": 5, \"input_length\": 1024, \"output_length\": 3, \"hash_ids\": [1, 2]}\n{\"hash_ids\": []}\n");
        let reqs = load_trace(ok.path()).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[0].hash_ids, vec![1, 2]);
        assert_eq!(reqs[0].timestamp, 5);

        let blank = write("{\"hash_ids\": [1]}\n\n{\"hash_ids\": [2]}\n");
        let err = load_trace(blank.path()).unwrap_err();
        assert!(matches!(err, TraceError::Blank { line: 2, .. }), "{err}");

        let bad = write("{\"hash_ids\": [1]}\n{\"hash_ids\": [1]}\n{\"hash_ids\": [-3]}\n");
        let err = load_trace(bad.path()).unwrap_err();
        assert!(
            matches!(err, TraceError::Malformed { line: 3, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(":3:"));
    }
}
