//! Records the git revision the binary was built from, for benchmark reports.
//!
//! Reruns when HEAD moves (a commit or a checkout), not on every edit or `git add`: each
//! rerun rebuilds this package's binary and tests. So a `-dirty` suffix is as of that moment.

fn main() {
    let rev = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=KVROUTER_GIT_REV={rev}");
    let head = std::fs::read_to_string(".git/HEAD").unwrap_or_default();
    let mut watched = vec![".git/HEAD".to_owned(), ".git/packed-refs".to_owned()];
    if let Some(r) = head.trim().strip_prefix("ref: ") {
        watched.push(format!(".git/{r}"));
    }
    for path in watched {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
