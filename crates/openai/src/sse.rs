//! Server-sent events as engines stream them: an incremental parser of `data:` payloads
//! that accepts bytes split anywhere (mid-line, mid-UTF-8), and the writer of one event.

use bytes::{Bytes, BytesMut};

/// The largest event accepted: an engine sending more without a blank line is broken.
pub const MAX_EVENT_BYTES: usize = 8 << 20;

/// What one event carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// The payload of its `data:` lines (joined by `\n`, as the SSE spec says).
    Data(String),
    /// `data: [DONE]`, the end of an OpenAI stream.
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an event of more than {0} bytes")]
    TooLarge(usize),
    #[error("an event that is not UTF-8")]
    NotUtf8,
}

/// Feeds bytes in, takes whole events out.
#[derive(Debug)]
pub struct SseParser {
    buf: BytesMut,
    /// Bytes of `buf` already searched for a line end.
    scanned: usize,
    data: Vec<u8>,
    has_data: bool,
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::with_max_event_bytes(MAX_EVENT_BYTES)
    }
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// A parser that holds at most `max` bytes of one event (a reader that wants only small
    /// events need not hold [`MAX_EVENT_BYTES`]).
    pub fn with_max_event_bytes(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            scanned: 0,
            data: Vec::new(),
            has_data: false,
            max_event_bytes: max,
        }
    }

    /// Appends `bytes` and returns every event they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(pos) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let line = self.buf.split_to(self.scanned + pos + 1);
            self.scanned = 0;
            let mut line = &line[..line.len() - 1];
            if let [rest @ .., b'\r'] = line {
                line = rest;
            }
            if line.is_empty() {
                if let Some(ev) = self.dispatch()? {
                    out.push(ev);
                }
            } else if let Some(value) = line.strip_prefix(b"data:") {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing we use.
            if self.data.len() > self.max_event_bytes {
                return Err(SseError::TooLarge(self.max_event_bytes));
            }
        }
        self.scanned = self.buf.len();
        if self.buf.len() + self.data.len() > self.max_event_bytes {
            return Err(SseError::TooLarge(self.max_event_bytes));
        }
        Ok(out)
    }

    /// The event the stream's end completes, if its last blank line is missing.
    pub fn finish(&mut self) -> Result<Option<SseEvent>, SseError> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            self.scanned = 0;
            let mut events = self.feed(&rest)?;
            events.extend(self.feed(b"\n\n")?);
            return Ok(events.pop());
        }
        self.dispatch()
    }

    fn dispatch(&mut self) -> Result<Option<SseEvent>, SseError> {
        if !std::mem::take(&mut self.has_data) {
            return Ok(None);
        }
        let data =
            String::from_utf8(std::mem::take(&mut self.data)).map_err(|_| SseError::NotUtf8)?;
        Ok(Some(if data.trim() == "[DONE]" {
            SseEvent::Done
        } else {
            SseEvent::Data(data)
        }))
    }
}

/// One `data:` event.
pub fn event(payload: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(payload.len() + 8);
    b.extend_from_slice(b"data: ");
    b.extend_from_slice(payload.as_bytes());
    b.extend_from_slice(b"\n\n");
    b.freeze()
}

/// The event that ends an OpenAI stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all(p: &mut SseParser, chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.feed(c).unwrap());
        }
        out.extend(p.finish().unwrap());
        out
    }

    #[test]
    fn events_split_anywhere_read_the_same() {
        let stream = "data: {\"a\":\"é\"}\n\n: keep-alive\n\ndata: x\ndata: y\r\n\r\nevent: e\ndata: [DONE]\n\n";
        let expected = vec![
            SseEvent::Data("{\"a\":\"é\"}".into()),
            SseEvent::Data("x\ny".into()),
            SseEvent::Done,
        ];
        let bytes = stream.as_bytes();
        for cut in 0..bytes.len() {
            let mut p = SseParser::new();
            assert_eq!(
                all(&mut p, &[&bytes[..cut], &bytes[cut..]]),
                expected,
                "cut {cut}"
            );
        }
        let mut p = SseParser::new();
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(all(&mut p, &singles), expected);
    }

    #[test]
    fn a_last_event_without_blank_line_still_counts() {
        let mut p = SseParser::new();
        assert_eq!(
            all(&mut p, &[b"data: a\n\ndata: b"]),
            vec![SseEvent::Data("a".into()), SseEvent::Data("b".into())]
        );
    }

    #[test]
    fn oversized_and_invalid_events_are_errors() {
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(p.feed(&big), Err(SseError::TooLarge(MAX_EVENT_BYTES)));
        let mut small = SseParser::with_max_event_bytes(8);
        assert_eq!(small.feed(b"data: 0123456"), Err(SseError::TooLarge(8)));
        let mut p = SseParser::new();
        assert_eq!(p.feed(b"data: \xff\xfe\n\n"), Err(SseError::NotUtf8));
    }

    #[test]
    fn written_events_parse_back() {
        let mut p = SseParser::new();
        let mut bytes = event("{\"k\":1}").to_vec();
        bytes.extend_from_slice(DONE);
        assert_eq!(
            all(&mut p, &[&bytes]),
            vec![SseEvent::Data("{\"k\":1}".into()), SseEvent::Done]
        );
    }

    proptest! {
        #[test]
        fn any_split_of_any_events_reads_the_same(
            payloads in prop::collection::vec("[a-z{}\":é ]{0,20}", 0..6),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..5),
        ) {
            let payloads: Vec<String> = payloads.into_iter().filter(|p| p.trim() != "[DONE]").collect();
            let mut bytes = Vec::new();
            for p in &payloads {
                bytes.extend_from_slice(&event(p));
            }
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut parser = SseParser::new();
            let mut got = Vec::new();
            let mut at = 0;
            for p in points {
                got.extend(parser.feed(&bytes[at..p]).unwrap());
                at = p;
            }
            got.extend(parser.feed(&bytes[at..]).unwrap());
            got.extend(parser.finish().unwrap());
            let want: Vec<SseEvent> = payloads.into_iter().map(SseEvent::Data).collect();
            prop_assert_eq!(got, want);
        }
    }
}
