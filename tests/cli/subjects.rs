//! `kvrouter subjects`: the fleet's subjects, no NATS needed.

use crate::common;

use common::{kvrouter, run};

fn lines(out: &std::process::Output) -> Vec<(String, String)> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let mut parts = l.split_whitespace();
            let name = parts.next().expect("a name").to_string();
            let subject = parts.next().expect("a subject").to_string();
            assert!(parts.next().is_none(), "one pair per line: {l:?}");
            (name, subject)
        })
        .collect()
}

fn valid_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| {
            !t.is_empty()
                && (t == "*"
                    || t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'~'))
        })
}

#[test]
fn subjects_of_a_model_are_valid_and_namespaced() {
    let out = run(&[
        "subjects",
        "--namespace",
        "team-a",
        "--model",
        "Qwen/Qwen3-0.6B",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = lines(&out);
    assert!(list.len() >= 10, "{list:?}");
    for (name, subject) in &list {
        assert!(subject.starts_with("team-a."), "{name} {subject}");
        assert!(valid_subject(subject), "{name} {subject}");
    }
    let route = list
        .iter()
        .find(|(n, _)| n == "route")
        .expect("a route line");
    assert_eq!(route.1, "team-a.router.route");
    // The model becomes one subject token.
    let gen = list
        .iter()
        .find(|(n, _)| n == "generate")
        .expect("a generate line");
    assert!(gen.1.contains(".Qwen~2FQwen3-0~2E6B."), "{}", gen.1);
    let names: std::collections::HashSet<_> = list.iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), list.len());
}

#[test]
fn namespace_comes_from_the_environment_or_defaults() {
    let out = run(&["subjects", "--model", "m"]);
    assert!(out.status.success());
    assert!(lines(&out).iter().all(|(_, s)| s.starts_with("kvrouter.")));
    let out = kvrouter()
        .args(["subjects", "--model", "m"])
        .env("KVROUTER_NAMESPACE", "from-env")
        .output()
        .expect("kvrouter runs");
    assert!(out.status.success());
    assert!(lines(&out).iter().all(|(_, s)| s.starts_with("from-env.")));
}

#[test]
fn bad_namespace_fails_with_a_message() {
    for bad in ["bad namespace", "a..b", "a.*"] {
        let out = run(&["subjects", "--namespace", bad, "--model", "m"]);
        assert!(!out.status.success(), "{bad:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error:") && err.contains("namespace"), "{err}");
        assert!(out.stdout.is_empty());
    }
    let out = run(&["subjects", "--model", ""]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("model"));
}
