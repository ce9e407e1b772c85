//! An OTLP/HTTP traces receiver for tests: it takes `POST /v1/traces` (protobuf) on a
//! loopback port and decodes each request with the `opentelemetry-proto` crate's own types,
//! so what kvrouter sends is checked against the real schema, not against its own structs.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::AnyValue;
use prost::Message;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One span as the receiver decoded it; ids in lowercase hex as in `traceparent`.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// `None` for a root span.
    pub parent_span_id: Option<String>,
    pub name: String,
    /// OTLP `SpanKind` (1 internal, 2 server, 3 client).
    pub kind: i32,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub flags: u32,
    /// OTLP `Status.code` (0 unset, 2 error).
    pub status_code: i32,
    /// Every attribute's value as text (integers in decimal).
    pub attributes: BTreeMap<String, String>,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// Decodes an `ExportTraceServiceRequest` body into its spans.
pub fn decode_traces(body: &[u8]) -> Result<Vec<ReceivedSpan>, String> {
    let req = ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(&kv.value))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                if s.trace_id.len() != 16 || s.span_id.len() != 8 {
                    return Err(format!(
                        "span {:?}: trace id of {} bytes, span id of {}",
                        s.name,
                        s.trace_id.len(),
                        s.span_id.len()
                    ));
                }
                if !s.parent_span_id.is_empty() && s.parent_span_id.len() != 8 {
                    return Err(format!(
                        "span {:?}: parent id of {} bytes",
                        s.name,
                        s.parent_span_id.len()
                    ));
                }
                out.push(ReceivedSpan {
                    service: service.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: (!s.parent_span_id.is_empty()).then(|| hex(&s.parent_span_id)),
                    name: s.name,
                    kind: s.kind,
                    start_unix_nano: s.start_time_unix_nano,
                    end_unix_nano: s.end_time_unix_nano,
                    flags: s.flags,
                    status_code: s.status.map_or(0, |st| st.code),
                    attributes: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(&kv.value)))
                        .collect(),
                });
            }
        }
    }
    Ok(out)
}

#[derive(Default)]
struct State {
    spans: Mutex<Vec<ReceivedSpan>>,
    requests: AtomicUsize,
    rejected: AtomicUsize,
    /// The status the receiver answers (200, or a failure a test asks for).
    status: AtomicU16,
    stop: AtomicBool,
}

/// A running receiver; stops when dropped.
pub struct OtlpReceiver {
    port: u16,
    state: Arc<State>,
}

impl OtlpReceiver {
    /// Listens on a free loopback port.
    pub fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State {
            status: AtomicU16::new(200),
            ..State::default()
        });
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(conn) = conn {
                    let s = s.clone();
                    std::thread::spawn(move || serve(conn, &s));
                }
            }
        });
        Ok(Self { port, state })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL to export to.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/v1/traces", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.state.spans.lock().unwrap().clone()
    }

    /// Export requests taken (decoded and answered 200).
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Requests refused: wrong path or content type, a body that does not decode, or
    /// answered with a failure status.
    pub fn rejected(&self) -> usize {
        self.state.rejected.load(Ordering::Relaxed)
    }

    /// Answers every later request with `status` (e.g. 503 for a collector in trouble).
    pub fn answer_with(&self, status: u16) {
        self.state.status.store(status, Ordering::Relaxed);
    }

    /// Waits until `pred` holds for the spans received, up to `timeout`; returns them.
    pub fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        crate::wait_until(timeout, || pred(&self.spans()));
        self.spans()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port)); // wakes the accept loop
    }
}

/// One connection: requests one after another (keep-alive) until the peer closes.
fn serve(conn: TcpStream, state: &State) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let mut w = match conn.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let (mut len, mut content_type) = (0usize, String::new());
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => len = v.trim().parse().unwrap_or(0),
                    "content-type" => content_type = v.trim().to_string(),
                    _ => {}
                }
            }
        }
        if len > 64 << 20 {
            return;
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let status = state.status.load(Ordering::Relaxed);
        let taken = path == "/v1/traces"
            && content_type == "application/x-protobuf"
            && status == 200
            && match decode_traces(&body) {
                Ok(spans) => {
                    state.spans.lock().unwrap().extend(spans);
                    true
                }
                Err(_) => false,
            };
        let status = if taken {
            state.requests.fetch_add(1, Ordering::Relaxed);
            200
        } else {
            state.rejected.fetch_add(1, Ordering::Relaxed);
            if status == 200 {
                400
            } else {
                status
            }
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
        );
        if w.write_all(head.as_bytes()).is_err() {
            return;
        }
    }
}
