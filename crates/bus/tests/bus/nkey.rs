//! An nkey identity on a real nats-server: the client authenticates with its seed, its reply
//! subjects carry its public key, and a server that lets it read only `_INBOX.<key>.>` still
//! answers its requests and streams; a wrong seed is refused at connect.

use bytes::Bytes;
use kvrouter_bus::{Bus, BusError, NatsOptions};
use kvrouter_testkit::NatsServer;
use std::path::Path;
use std::time::Duration;

/// nats-server with two nkey users: `asker` may only publish `svc.>` and read its own
/// inbox; `server` answers on `svc.>` through `allow_responses` (streams included).
fn nkey_server(dir: &Path, asker: &str, responder: &str) -> NatsServer {
    let conf = format!(
        r#"authorization {{
  users = [
    {{ nkey: "{asker}", permissions: {{
        publish: {{ allow: ["svc.>"] }}
        subscribe: {{ allow: ["_INBOX.{asker}.>"] }} }} }}
    {{ nkey: "{responder}", permissions: {{
        publish: {{ allow: ["nothing"] }}
        subscribe: {{ allow: ["svc.>"] }}
        allow_responses: {{ max: 100, expires: "1m" }} }} }}
  ]
}}
"#
    );
    let path = dir.join("nats.conf");
    std::fs::write(&path, conf).unwrap();
    NatsServer::start_with_args(&["-c", path.to_str().unwrap()])
}

fn seed_file(dir: &Path, name: &str, pair: &nkeys::KeyPair) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pair.seed().unwrap()).unwrap();
    path
}

fn opts(server: &NatsServer, seed: &Path) -> NatsOptions {
    let mut o = NatsOptions::new(server.url());
    o.nkey_file = Some(seed.into());
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_user_reads_its_own_inbox_only_and_still_gets_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (asker, responder) = (nkeys::KeyPair::new_user(), nkeys::KeyPair::new_user());
    let nats = nkey_server(dir.path(), &asker.public_key(), &responder.public_key());
    let ask = Bus::connect(&opts(&nats, &seed_file(dir.path(), "a.nk", &asker)))
        .await
        .expect("the asker connects with its seed");
    let answer = Bus::connect(&opts(&nats, &seed_file(dir.path(), "r.nk", &responder)))
        .await
        .expect("the responder connects with its seed");
    assert!(
        ask.new_inbox()
            .starts_with(&format!("_INBOX.{}.", asker.public_key())),
        "{}",
        ask.new_inbox()
    );
    let mut sub = answer.subscribe("svc.>").await.unwrap();
    answer.flush().await.unwrap();
    let responder_bus = answer.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let reply = m.reply.unwrap();
            for part in [&b"one"[..], b"two"] {
                responder_bus
                    .publish(&reply, Bytes::from_static(part))
                    .await
                    .unwrap();
            }
            if m.subject == "svc.stream" {
                responder_bus.end_stream(&reply).await.unwrap();
            }
        }
    });
    // A flush only writes the responder's SUB to the socket: until the server has read it,
    // a request finds no responder. Ask again until it has.
    let asked = std::time::Instant::now();
    let one = loop {
        match ask
            .request("svc.one", Bytes::from_static(b"q"), Duration::from_secs(5))
            .await
        {
            Err(BusError::NoResponders { .. }) if asked.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            r => break r.expect("a request's answer reaches the asker's own inbox"),
        }
    };
    assert_eq!(&one.payload[..], b"one");
    let mut stream = ask
        .request_stream("svc.stream", Bytes::new(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(part) = stream.next().await {
        got.push(part.unwrap());
    }
    assert_eq!(got, [&b"one"[..], b"two"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_the_server_does_not_know_is_refused_at_connect() {
    let dir = tempfile::tempdir().unwrap();
    let (asker, responder) = (nkeys::KeyPair::new_user(), nkeys::KeyPair::new_user());
    let nats = nkey_server(dir.path(), &asker.public_key(), &responder.public_key());
    let stranger = nkeys::KeyPair::new_user();
    let seed = stranger.seed().unwrap();
    let mut o = opts(&nats, &seed_file(dir.path(), "x.nk", &stranger));
    o.connect_timeout = Duration::from_secs(2);
    let e = Bus::connect(&o)
        .await
        .expect_err("an unknown key is refused");
    let BusError::Connect(m) = &e else {
        panic!("{e:?}")
    };
    assert!(m.contains("nkey file"), "{m}");
    assert!(!m.contains(&seed), "{m}");
}
