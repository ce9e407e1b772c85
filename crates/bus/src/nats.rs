//! The NATS implementation: a thin layer over `async-nats` that maps its errors onto
//! [`BusError`] and logs connection events.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::client::{PublishErrorKind, RequestErrorKind, SubscribeErrorKind};
use async_nats::connection::State;
use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerAddr};
use bytes::Bytes;

use crate::options::UrlAuth;
use crate::{BusError, Message, NatsOptions};

/// A NATS connection. Clones share it. async-nats reconnects on its own (without limit) after
/// the initial connection succeeded; subscriptions survive reconnects.
#[derive(Clone)]
pub struct NatsBus {
    client: async_nats::Client,
    /// The server list with passwords redacted, for messages.
    url: Arc<str>,
    /// Connection losses seen by the client (however short: a metric polling the state
    /// would miss a quick reconnect).
    disconnects: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBus")
            .field("url", &self.url)
            .field("state", &self.client.connection_state())
            .finish_non_exhaustive()
    }
}

impl NatsBus {
    /// Connects once to one of the servers in `opts.url`; fails promptly with
    /// [`BusError::Connect`] if none accepts.
    pub(crate) async fn connect(opts: &NatsOptions) -> Result<NatsBus, BusError> {
        opts.validate()?;
        let shown: Arc<str> = opts.redacted_url().into();
        let fail = |why: String| BusError::Connect(format!("cannot connect to '{shown}': {why}"));

        // async-nats ignores credentials in a URL: they go in the connect options instead.
        let (servers, url_auth) = opts.split_url_auth()?;
        let mut addrs = Vec::new();
        for url in &servers {
            let addr: ServerAddr = url.parse().map_err(|e| {
                fail(format!(
                    "'{url}' is not a valid NATS URL ({e}); expected e.g. nats://host:4222"
                ))
            })?;
            addrs.push(addr);
        }

        let mut co = ConnectOptions::new();
        match url_auth {
            Some(UrlAuth::UserPassword { user, password }) => {
                co = co.user_and_password(user, password);
            }
            Some(UrlAuth::Token(token)) => co = co.token(token),
            None => {}
        }
        if let Some(path) = &opts.credentials_file {
            co = co.credentials_file(path).await.map_err(|e| {
                fail(format!(
                    "cannot load the credentials file {}: {e}",
                    path.display()
                ))
            })?;
        }
        let mut public_key = None;
        if let Some(path) = &opts.nkey_file {
            let key = crate::options::read_nkey(path)
                .map_err(|why| fail(format!("the nkey file {}: {why}", path.display())))?;
            if crate::options::world_readable(path) {
                tracing::warn!(
                    file = %path.display(),
                    "the NATS nkey seed file is readable by every user of this host; make it \
                     readable by this process only (chmod 600, or defaultMode 0400 on a \
                     Kubernetes Secret volume)"
                );
            }
            public_key = Some(key.public_key);
            co = co.nkey(key.seed);
        }
        if let Some(prefix) = opts.reply_prefix()? {
            co = co.custom_inbox_prefix(prefix);
        }
        if let (Some(user), Some(password)) = (&opts.user, &opts.password) {
            co = co.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &opts.token {
            co = co.token(token.clone());
        }
        if let Some(ca) = &opts.tls_ca_file {
            co = co.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&opts.tls_client_cert, &opts.tls_client_key) {
            co = co.add_client_certificate(cert.clone(), key.clone());
        }
        if opts.tls_required {
            co = co.require_tls(true);
        }
        if let Some(name) = &opts.name {
            co = co.name(name);
        }
        let events_url = shown.clone();
        let disconnects = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = disconnects.clone();
        let errors_seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        co = co
            .connection_timeout(opts.connect_timeout)
            .max_reconnects(None)
            .event_callback(move |event| {
                let url = events_url.clone();
                if matches!(event, Event::Disconnected) {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                // Every failed reconnect attempt is a client error: one warning per outage.
                let repeated = match event {
                    Event::ClientError(_) => errors_seen.swap(true, Ordering::Relaxed),
                    Event::Connected => {
                        errors_seen.store(false, Ordering::Relaxed);
                        false
                    }
                    _ => false,
                };
                async move { log_event(&url, event, repeated) }
            });

        let client = co.connect(addrs).await.map_err(|e| {
            let hint = match e.kind() {
                ConnectErrorKind::AuthorizationViolation => {
                    "the server rejected the credentials; check the NATS user/password, token, \
                     credentials file or nkey file (is its public key in the server's users?)"
                        .to_string()
                }
                ConnectErrorKind::Authentication => {
                    "could not sign the server's nonce; is the credentials file a valid .creds \
                     file, or the nkey file a user seed?"
                        .to_string()
                }
                ConnectErrorKind::TimedOut => format!(
                    "no server answered within connect_timeout {:?}; is the host reachable and \
                     the port right?",
                    opts.connect_timeout
                ),
                ConnectErrorKind::Io => {
                    "is nats-server running and listening at that address?".to_string()
                }
                ConnectErrorKind::Dns => "cannot resolve the host name".to_string(),
                ConnectErrorKind::Tls => {
                    "TLS set-up failed; check the CA file, client certificate and key, and \
                     whether the server has TLS enabled"
                        .to_string()
                }
                _ => String::new(),
            };
            if hint.is_empty() {
                fail(e.to_string())
            } else {
                fail(format!("{e} ({hint})"))
            }
        })?;
        match &public_key {
            Some(user) => {
                tracing::info!(url = %shown, max_payload = client.max_payload(), nkey = %user, "connected to NATS")
            }
            None => {
                tracing::info!(url = %shown, max_payload = client.max_payload(), "connected to NATS")
            }
        }
        Ok(NatsBus {
            client,
            url: shown,
            disconnects,
        })
    }

    pub(crate) fn max_payload(&self) -> usize {
        self.client.max_payload()
    }

    pub(crate) fn disconnects(&self) -> u64 {
        self.disconnects.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    pub(crate) fn new_inbox(&self) -> String {
        self.client.new_inbox()
    }

    pub(crate) async fn publish(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: Bytes,
    ) -> Result<(), BusError> {
        let len = payload.len();
        let result = match reply {
            None => self.client.publish(subject.to_string(), payload).await,
            Some(reply) => {
                self.client
                    .publish_with_reply(subject.to_string(), reply.to_string(), payload)
                    .await
            }
        };
        result.map_err(|e| match e.kind() {
            PublishErrorKind::MaxPayloadExceeded => BusError::PayloadTooLarge {
                len,
                max: self.max_payload(),
            },
            PublishErrorKind::InvalidSubject => {
                BusError::InvalidSubject(format!("NATS rejected subject '{subject}': {e}"))
            }
            PublishErrorKind::Send => BusError::Closed,
        })
    }

    pub(crate) async fn subscribe(
        &self,
        subject: &str,
        queue: Option<&str>,
    ) -> Result<async_nats::Subscriber, BusError> {
        let result = match queue {
            None => self.client.subscribe(subject.to_string()).await,
            Some(q) => {
                self.client
                    .queue_subscribe(subject.to_string(), q.to_string())
                    .await
            }
        };
        result.map_err(|e| match e.kind() {
            SubscribeErrorKind::InvalidSubject | SubscribeErrorKind::InvalidQueueName => {
                BusError::InvalidSubject(format!("NATS rejected subscription to '{subject}': {e}"))
            }
            SubscribeErrorKind::Other => {
                BusError::Other(format!("subscribe to '{subject}' failed: {e}"))
            }
        })
    }

    pub(crate) async fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Message, BusError> {
        let len = payload.len();
        let request = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(timeout));
        match self.client.send_request(subject.to_string(), request).await {
            Ok(m) => Ok(from_nats(m)),
            Err(e) => Err(match e.kind() {
                RequestErrorKind::NoResponders => BusError::NoResponders {
                    subject: subject.to_string(),
                },
                RequestErrorKind::TimedOut => BusError::Timeout {
                    subject: subject.to_string(),
                    after: timeout,
                },
                RequestErrorKind::MaxPayloadExceeded => BusError::PayloadTooLarge {
                    len,
                    max: self.max_payload(),
                },
                RequestErrorKind::InvalidSubject => {
                    BusError::InvalidSubject(format!("NATS rejected subject '{subject}': {e}"))
                }
                RequestErrorKind::Other => {
                    BusError::Other(format!("request on '{subject}' failed: {e}"))
                }
            }),
        }
    }

    pub(crate) async fn flush(&self) -> Result<(), BusError> {
        self.client
            .flush()
            .await
            .map_err(|e| BusError::Other(format!("flush to '{}' failed: {e}", self.url)))
    }
}

pub(crate) fn from_nats(m: async_nats::Message) -> Message {
    Message {
        subject: m.subject.to_string(),
        reply: m.reply.map(|r| r.to_string()),
        payload: m.payload,
    }
}

/// Logs a connection event; `repeated`: a client error after another in the same outage
/// (logged at debug).
fn log_event(url: &str, event: Event, repeated: bool) {
    match event {
        Event::Connected => tracing::info!(%url, "NATS connection established"),
        Event::Disconnected => tracing::warn!(
            %url,
            "NATS connection lost; reconnecting in the background (requests fail or time out \
             until it is back)"
        ),
        Event::LameDuckMode => tracing::warn!(
            %url,
            "NATS server entered lame duck mode (shutting down); will move to another server"
        ),
        Event::Draining => tracing::info!(%url, "NATS connection draining"),
        Event::Closed => tracing::info!(%url, "NATS connection closed"),
        Event::SlowConsumer(sid) => tracing::warn!(
            %url,
            sid,
            "NATS slow consumer: subscription dropped messages because its reader fell behind"
        ),
        Event::ServerError(e) => tracing::error!(%url, error = %e, "NATS server error"),
        Event::ClientError(e) if repeated => {
            tracing::debug!(%url, error = %e, "NATS client error (again)")
        }
        Event::ClientError(e) => tracing::warn!(
            %url,
            error = %e,
            "NATS client error (repeats of it until the connection is back are logged at debug)"
        ),
    }
}
