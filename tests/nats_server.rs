//! The test set-up provides a nats-server new enough for async-nats' KV (2.10+), started on a
//! free loopback port and stopped by PID.

mod common;

#[test]
fn a_real_nats_server_starts_and_is_recent_enough() {
    let server = common::NatsServer::start();
    let info = server.info();
    assert!(info.starts_with("INFO "), "{info}");
    let json: serde_json::Value =
        serde_json::from_str(info.trim_start_matches("INFO ").trim()).unwrap();
    let version = json["version"].as_str().unwrap();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap(), parts.next().unwrap());
    assert!(
        major > 2 || (major == 2 && minor >= 10),
        "nats-server {version} is older than 2.10"
    );
    let pid = server.pid();
    drop(server);
    // killed by PID and reaped
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}
