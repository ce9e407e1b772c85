//! Mooncake-format traces: JSONL, one request a line
//! (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`: one id per 512-token block).

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
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
    #[error("{path}:{line}: line longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong { path: PathBuf, line: usize },
    #[error("{path}:{line}: malformed request: {reason}")]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// Longest line read: a request of a million blocks is about 10 MB of JSON, far beyond any
/// real trace; a longer line (a file that is not a trace, say) is refused, not buffered.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Streams a trace's requests in file order; every blank, overlong or malformed line is an
/// error that names its line number.
pub struct TraceReader {
    path: PathBuf,
    reader: BufReader<File>,
    line: usize,
    done: bool,
}

impl TraceReader {
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            reader: BufReader::new(file),
            line: 0,
            done: false,
        })
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut buf = Vec::new();
        // One byte past the limit tells an overlong line from one exactly at it.
        let limit = MAX_LINE_BYTES as u64 + 1;
        match (&mut self.reader).take(limit).read_until(b'\n', &mut buf) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => return self.fail(Err(e)),
        }
        self.line += 1;
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() as u64 == limit {
            self.done = true;
            return Some(Err(TraceError::LineTooLong {
                path: self.path.clone(),
                line: self.line,
            }));
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        let text = String::from_utf8(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e));
        Some(parse_line(&self.path, self.line, text))
    }
}

impl TraceReader {
    /// An I/O error ends the stream.
    fn fail(&mut self, e: std::io::Result<String>) -> Option<Result<TraceRequest, TraceError>> {
        self.done = true;
        Some(parse_line(&self.path, self.line + 1, e))
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

    #[test]
    fn an_overlong_line_is_refused_not_buffered() {
        let mut long = String::from("{\"hash_ids\": [");
        while long.len() <= MAX_LINE_BYTES {
            long.push_str("1234567,");
        }
        long.push_str("1]}\n");
        let f = write(&format!("{{\"hash_ids\": [1]}}\n{long}"));
        let mut r = TraceReader::open(f.path()).unwrap();
        assert_eq!(r.next().unwrap().unwrap().hash_ids, vec![1]);
        match r.next() {
            Some(Err(TraceError::LineTooLong { line: 2, .. })) => {}
            Some(Ok(req)) => panic!("read a {}-block request", req.hash_ids.len()),
            other => panic!("{:?}", other.map(|r| r.map(|_| ()))),
        }
        assert!(r.next().is_none(), "the rest of the file is not read");
        // CRLF lines and a last line without a newline read as before.
        let crlf = write("{\"hash_ids\": [1]}\r\n{\"hash_ids\": [2]}");
        let reqs = load_trace(crlf.path()).unwrap();
        assert_eq!(
            reqs.iter().map(|r| r.hash_ids[0]).collect::<Vec<_>>(),
            vec![1, 2]
        );
    }
}
