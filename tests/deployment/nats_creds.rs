//! `kvrouter creds` as an operator runs it: what it writes (and with which modes), that it
//! says nothing secret, that it will not overwrite keys without --force, that its Secrets
//! carry the seeds, that a process refuses a bad seed file clearly, and that the shipped
//! deploy/nats/least-privilege.conf is its authorization block.

use crate::common;
use crate::nats_permissions::Creds;

use common::*;
use std::path::Path;

/// Every `U` + 55 base32 characters word (an nkey user public key) replaced by `<KEY>`.
fn without_keys(text: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let is_key = word.len() == 56
            && word.starts_with('U')
            && word
                .bytes()
                .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b));
        out.push_str(if is_key { "<KEY>" } else { word });
        word.clear();
    };
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn authorization_block(text: &str) -> &str {
    &text[text
        .find("authorization {")
        .expect("an authorization block")..]
}

#[cfg(unix)]
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn seeds_of(dir: &Path) -> Vec<(String, String)> {
    let mut seeds: Vec<(String, String)> = std::fs::read_dir(dir.join("seeds"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            (name, std::fs::read_to_string(e.path()).unwrap())
        })
        .collect();
    seeds.sort();
    seeds
}

#[test]
fn creds_writes_one_identity_per_role_and_keeps_quiet_about_them() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("fleet");
    let args = [
        "creds",
        "--namespace",
        "team-a",
        "--replica-ids",
        "r1,r2",
        "--worker-ids",
        "10",
        "--frontends",
        "2",
        "--model",
        "Qwen/Qwen3-0.6B",
    ];
    let out = kvrouter()
        .args(args)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(stdout.lines().count(), 1, "one summary line: {stdout}");
    assert!(
        stdout.contains("5 NATS identities") && stdout.contains("team-a"),
        "{stdout}"
    );
    let seeds = seeds_of(&out_dir);
    let names: Vec<&str> = seeds.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "bridge-10.nk",
            "frontend-0.nk",
            "frontend-1.nk",
            "replica-r1.nk",
            "replica-r2.nk"
        ]
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (name, seed) in &seeds {
        let seed = seed.trim();
        assert!(seed.starts_with("SU") && seed.len() == 58, "{name}");
        assert!(
            !stdout.contains(seed) && !stderr.contains(seed),
            "{name}'s seed printed"
        );
    }
    #[cfg(unix)]
    {
        assert_eq!(mode(&out_dir.join("seeds")), 0o700);
        for (name, _) in &seeds {
            assert_eq!(mode(&out_dir.join("seeds").join(name)), 0o600, "{name}");
        }
        assert_eq!(mode(&out_dir.join("kubernetes.yaml")), 0o600);
    }
    let users = std::fs::read_to_string(out_dir.join("nats-users.conf")).unwrap();
    assert!(!users.contains("\"_INBOX.>\""), "nobody reads every reply");
    assert!(users.contains("\"team-a.model.Qwen~2FQwen3-0~2E6B.worker.10.>\""));
    assert!(users.contains("\"team-a.router.sync.r1\""));
    for (_, seed) in &seeds {
        assert!(!users.contains(seed.trim()), "public keys only");
    }
    // The Secrets: the users file, every replica's seed in one, one each for the others.
    let yaml = std::fs::read_to_string(out_dir.join("kubernetes.yaml")).unwrap();
    for name in [
        "kvrouter-nats-users",
        "kvrouter-nats-replicas",
        "kvrouter-nats-frontend",
        "kvrouter-nats-frontend-1",
        "kvrouter-nats-bridge-10",
    ] {
        assert_eq!(
            yaml.matches(&format!("  name: {name}\n")).count(),
            1,
            "{name}"
        );
    }
    for (name, seed) in &seeds {
        assert!(yaml.contains(&format!("    {}", seed.trim())), "{name}");
    }
    assert!(yaml.contains("  replica-r1.nk: |\n") && yaml.contains("  nats-users.conf: |\n"));

    // Again without --force: refused, nothing replaced.
    let again = kvrouter()
        .args(args)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains("exists already") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(seeds_of(&out_dir), seeds);
    // With it: new keys.
    let forced = kvrouter()
        .args(args)
        .args(["--force", "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(forced.status.success());
    let new = seeds_of(&out_dir);
    assert_eq!(new.len(), seeds.len());
    assert!(new
        .iter()
        .zip(&seeds)
        .all(|(a, b)| a.0 == b.0 && a.1 != b.1));
    // Bad ids are refused before anything is written.
    let bad = kvrouter()
        .args([
            "creds",
            "--replica-ids",
            "a.b",
            "--worker-ids",
            "1",
            "--out",
        ])
        .arg(dir.path().join("bad"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("replica id \"a.b\""));
    assert!(!dir.path().join("bad").exists());
}

#[test]
fn the_shipped_least_privilege_file_is_the_generators_block() {
    let creds = Creds::generate();
    let generated = std::fs::read_to_string(creds.dir.path().join("nats-users.conf")).unwrap();
    let shipped = std::fs::read_to_string(repo_file("deploy/nats/least-privilege.conf")).unwrap();
    assert_eq!(
        without_keys(authorization_block(&shipped)),
        without_keys(authorization_block(&generated)),
        "deploy/nats/least-privilege.conf is out of date: regenerate its block with \
         `kvrouter creds --out DIR --replica-ids a,b --worker-ids 10,11 --peers 1 --epps 1` \
         (DIR/nats-users.conf)"
    );
    assert!(!shipped.contains("\"_INBOX.>\""));
    let check = std::process::Command::new("nats-server")
        .args(["-t", "-c"])
        .arg(repo_file("deploy/nats/least-privilege.conf"))
        .output()
        .expect("nats-server on PATH (scripts/test.sh installs it)");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

#[test]
fn a_process_refuses_a_bad_seed_file_without_echoing_it() {
    let creds = Creds::generate();
    let dir = tempfile::tempdir().unwrap();
    let seed = std::fs::read_to_string(creds.seed("frontend-0")).unwrap();
    // An account seed where a user seed belongs, and a user seed with a broken checksum.
    let account = nkeys::KeyPair::new_account().seed().unwrap();
    let mut broken = seed.trim().to_string();
    let flipped = if broken.ends_with('A') { "B" } else { "A" };
    broken.replace_range(broken.len() - 1.., flipped);
    for (name, content, want) in [
        ("account.nk", account.as_str(), "an account seed"),
        ("broken.nk", broken.as_str(), "malformed"),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        let out = kvrouter()
            .args(["route", "--nats", "nats://127.0.0.1:1", "--model", "m"])
            .args(["--tokens", "1,2"])
            .arg("--nats-nkey-file")
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want) && err.contains(name), "{err}");
        assert!(!err.contains(content), "the seed is printed: {err}");
    }
    // Beside another authentication method it is refused as any two are.
    let out = kvrouter()
        .args(["route", "--nats", "nats://127.0.0.1:1", "--model", "m"])
        .args(["--tokens", "1,2", "--nats-token", "t"])
        .args(["--nats-nkey-file", &creds.seed_arg("frontend-0")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("token and nkey file"), "{err}");
    assert!(!err.contains(seed.trim()), "{err}");
}
