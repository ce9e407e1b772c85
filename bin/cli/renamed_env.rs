//! Environment twins renamed because one name meant different things in different
//! subcommands (`KVROUTER_BLOCK_SIZE` was a number for the bridge and the mocker but
//! MODEL=TOKENS for `serve`). The old name keeps working for one release, for the subcommand
//! that read it: while clap builds the command (before it reads the environment), a renamed
//! flag's twin comes from [`env`], which copies the old variable to the new one if only the
//! old one is set and keeps a warning; the subcommand logs it ([`log_warnings`]) once
//! tracing is up.

use std::ffi::OsString;
use std::sync::Mutex;

/// One renamed environment twin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renamed {
    /// The subcommand whose flag it is.
    pub subcommand: &'static str,
    pub new: &'static str,
    /// Still read, with a warning, until the release after next.
    pub old: &'static str,
}

/// Every renamed twin.
pub const RENAMED: &[Renamed] = &[
    Renamed {
        subcommand: "serve",
        new: "KVROUTER_MODEL_BLOCK_SIZE",
        old: "KVROUTER_BLOCK_SIZE",
    },
    Renamed {
        subcommand: "frontend",
        new: "KVROUTER_ENGINE_TIMEOUT_SECS",
        old: "KVROUTER_REQUEST_TIMEOUT_SECS",
    },
    Renamed {
        subcommand: "frontend",
        new: "KVROUTER_LORA_ADAPTERS",
        old: "KVROUTER_LORA",
    },
    Renamed {
        subcommand: "frontend",
        new: "KVROUTER_MODEL_DIRS",
        old: "KVROUTER_MODEL",
    },
    Renamed {
        subcommand: "bench bridge",
        new: "KVROUTER_BLOCK_RATE",
        old: "KVROUTER_RATE",
    },
];

/// Warnings for the running subcommand, logged once tracing is up.
static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The environment twin `new` of a renamed flag, for clap's `env = ...`. When the running
/// subcommand is the flag's and only the old variable is set, copies it to `new` first.
pub fn env(new: &'static str) -> &'static str {
    let running = running_subcommand(std::env::args_os().skip(1));
    if let Some((r, value)) = adopt(new, running.as_deref(), |k| std::env::var_os(k)) {
        // Clap builds the command on the main thread before anything else starts.
        std::env::set_var(r.new, value);
        WARNINGS.lock().unwrap().push(warning(r));
    }
    new
}

/// The renamed twin `new` and the old variable's value, if the running subcommand is its
/// flag's, the old variable is set and the new one is not.
pub fn adopt(
    new: &str,
    running: Option<&str>,
    get: impl Fn(&str) -> Option<OsString>,
) -> Option<(Renamed, OsString)> {
    let r = RENAMED
        .iter()
        .find(|r| r.new == new && Some(r.subcommand) == running)?;
    if get(r.new).is_some() {
        return None;
    }
    get(r.old).map(|v| (*r, v))
}

/// What is logged when an old name is used.
pub fn warning(r: Renamed) -> String {
    format!(
        "{} is deprecated for `kvrouter {}` and will stop working in a later release: set {} instead",
        r.old, r.subcommand, r.new
    )
}

/// The subcommand on a command line (without the program name): the first argument that is
/// not a flag (the only global flag, -v, takes no value), and for `bench` the next one too
/// (`bench bridge`).
pub fn running_subcommand(args: impl IntoIterator<Item = OsString>) -> Option<String> {
    let mut words = args
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .filter(|a| !a.starts_with('-'));
    let first = words.next()?;
    match (first.as_str(), words.next()) {
        ("bench", Some(second)) => Some(format!("bench {second}")),
        _ => Some(first),
    }
}

/// Logs (once) the warnings [`env`] kept.
pub fn log_warnings() {
    for w in std::mem::take(&mut *WARNINGS.lock().unwrap()) {
        tracing::warn!("{w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_old_name_fills_the_new_one_for_its_own_subcommand_only() {
        let old = vars(&[("KVROUTER_BLOCK_SIZE", "m=16")]);
        let (r, v) = adopt("KVROUTER_MODEL_BLOCK_SIZE", Some("serve"), &old).unwrap();
        assert_eq!(
            (r.old, v.to_str().unwrap()),
            ("KVROUTER_BLOCK_SIZE", "m=16")
        );
        // The bridge's and the mocker's KVROUTER_BLOCK_SIZE is their own flag's twin.
        assert_eq!(
            adopt("KVROUTER_MODEL_BLOCK_SIZE", Some("bridge"), &old),
            None
        );
        assert_eq!(adopt("KVROUTER_MODEL_BLOCK_SIZE", None, &old), None);
        // The new name wins; nothing set, nothing to do.
        let both = vars(&[
            ("KVROUTER_BLOCK_SIZE", "m=16"),
            ("KVROUTER_MODEL_BLOCK_SIZE", "m=32"),
        ]);
        assert_eq!(
            adopt("KVROUTER_MODEL_BLOCK_SIZE", Some("serve"), both),
            None
        );
        assert_eq!(
            adopt("KVROUTER_MODEL_BLOCK_SIZE", Some("serve"), vars(&[])),
            None
        );
        // Frontend's engine timeout and adapters.
        let front = vars(&[
            ("KVROUTER_REQUEST_TIMEOUT_SECS", "30"),
            ("KVROUTER_LORA", "a=m"),
        ]);
        let got = |new| adopt(new, Some("frontend"), &front).map(|(r, _)| r.old);
        assert_eq!(
            got("KVROUTER_ENGINE_TIMEOUT_SECS"),
            Some("KVROUTER_REQUEST_TIMEOUT_SECS")
        );
        assert_eq!(got("KVROUTER_LORA_ADAPTERS"), Some("KVROUTER_LORA"));
        let front = vars(&[("KVROUTER_MODEL", "m=/models/m")]);
        assert_eq!(
            adopt("KVROUTER_MODEL_DIRS", Some("frontend"), &front).map(|(r, _)| r.old),
            Some("KVROUTER_MODEL")
        );
        // The bench bridge's rate is in blocks per second; route-latency's keeps KVROUTER_RATE.
        let rate = vars(&[("KVROUTER_RATE", "9")]);
        assert!(adopt("KVROUTER_BLOCK_RATE", Some("bench bridge"), &rate).is_some());
        assert!(adopt("KVROUTER_BLOCK_RATE", Some("bench route-latency"), &rate).is_none());
        // serve's KVROUTER_REQUEST_TIMEOUT_SECS keeps its name.
        assert_eq!(
            adopt("KVROUTER_REQUEST_TIMEOUT_SECS", Some("serve"), &front),
            None
        );
        assert!(warning(RENAMED[0]).contains("set KVROUTER_MODEL_BLOCK_SIZE instead"));
    }

    #[test]
    fn renamed_twins_are_distinct_and_their_flags_use_them() {
        for (i, r) in RENAMED.iter().enumerate() {
            assert!(RENAMED[..i].iter().all(|o| o.new != r.new), "{r:?}");
            assert!(r.new.starts_with("KVROUTER_") && r.old.starts_with("KVROUTER_"));
        }
        use clap::Args;
        let twins = |cmd: clap::Command| -> Vec<String> {
            cmd.get_arguments()
                .filter_map(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
                .collect()
        };
        let serve = twins(crate::cli::serve::ServeArgs::augment_args(
            clap::Command::new("s"),
        ));
        let frontend = twins(crate::cli::frontend::FrontendArgs::augment_args(
            clap::Command::new("f"),
        ));
        #[cfg(feature = "bench")]
        let bench_bridge = twins(crate::cli::bench_bridge::BridgeBenchArgs::augment_args(
            clap::Command::new("b"),
        ));
        for r in RENAMED {
            let of = match r.subcommand {
                "serve" => &serve,
                "frontend" => &frontend,
                #[cfg(feature = "bench")]
                "bench bridge" => &bench_bridge,
                #[cfg(not(feature = "bench"))]
                "bench bridge" => continue,
                other => panic!("no flags known for {other}"),
            };
            assert!(of.iter().any(|t| t == r.new), "{r:?}: {of:?}");
            assert!(!of.iter().any(|t| t == r.old), "{r:?}: {of:?}");
        }
    }

    #[test]
    fn the_subcommand_is_the_first_argument_that_is_no_flag() {
        let args = |a: &[&str]| running_subcommand(a.iter().map(OsString::from));
        assert_eq!(
            args(&["-vv", "serve", "--model", "m"]).as_deref(),
            Some("serve")
        );
        assert_eq!(args(&["frontend"]).as_deref(), Some("frontend"));
        assert_eq!(
            args(&["bench", "bridge", "--rate", "5"]).as_deref(),
            Some("bench bridge")
        );
        assert_eq!(args(&["--verbose"]), None);
    }
}
