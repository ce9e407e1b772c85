//! `kvrouter creds`: one NATS identity per role: an nkey per replica, frontend, bridge (one
//! worker id) and peer router, the nats-server authorization block that confines each to
//! the subjects its job needs and to its own replies, and the Kubernetes Secrets holding
//! them.
//!
//! The permissions follow from the subjects in `kvrouter_protocol::subjects`, role by role:
//! - replica `ID`: answers the router endpoints (in their queue group), its own
//!   `router.replica.ID.>` (mark_prefill, free, add_output_block, sync_state), abandon, every
//!   replica's sync subject, the catch-up queue group, what workers publish and the indexer
//!   subjects; publishes its own sync subject, catch-up and state requests to peers, the
//!   JSON API's lease updates to the replica that routed, roll calls, worker state queries
//!   and the indexer subjects;
//! - frontend / peer router: asks for routes and overlaps, reports progress and abandons to
//!   the replicas, streams from mocker workers; reads nothing but its replies;
//! - bridge `WORKER` (a `kvrouter bridge` or a `kvrouter mocker` worker): publishes and
//!   serves only `NS.model.M.worker.WORKER.>` and hears roll calls.
//!
//! Every user reads replies only on `_INBOX.<its public key>.>` (kvrouter sets that prefix
//! itself when it connects with an nkey), and those that answer requests do so through
//! `allow_responses` (only to requests they received). Nobody gets `_INBOX.>`.

use anyhow::{bail, ensure, Context};
use clap::Args;
use kvrouter_protocol::subjects::{
    model_token, Subjects, WorkerSubject, INDEXER_QUEUE_GROUP, ROUTER_QUEUE_GROUP, SYNC_QUEUE_GROUP,
};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The most identities one run writes (a static users file for more does not scale; see
/// docs/operations.md for decentralized JWT authentication).
const MAX_IDENTITIES: usize = 10_000;

#[derive(Args)]
pub struct CredsArgs {
    /// Directory to write into (created if missing): seeds/<role>.nk, nats-users.conf and
    /// kubernetes.yaml.
    #[arg(long, env = "KVROUTER_OUT", value_name = "DIR")]
    pub out: PathBuf,
    /// Namespace of every subject.
    #[arg(
        long,
        env = "KVROUTER_NAMESPACE",
        default_value = "kvrouter",
        value_name = "NS"
    )]
    pub namespace: String,
    /// The replicas' ids (each runs with --replica-id ID and its own seed).
    #[arg(
        long,
        env = "KVROUTER_REPLICA_IDS",
        value_delimiter = ',',
        required = true,
        value_name = "ID,..."
    )]
    pub replica_ids: Vec<String>,
    /// The workers' ids: one bridge (or mocker worker) identity each.
    #[arg(
        long,
        env = "KVROUTER_WORKER_IDS",
        value_delimiter = ',',
        required = true,
        value_name = "ID,..."
    )]
    pub worker_ids: Vec<u64>,
    /// Frontend identities (frontend-0, ...): OpenAI frontends, `kvrouter route` and
    /// `generate`.
    #[arg(long, env = "KVROUTER_FRONTENDS", default_value_t = 1)]
    pub frontends: u32,
    /// Endpoint-picker identities (epp-0, ...): `kvrouter epp` behind a gateway. A
    /// frontend's permissions, and it follows the workers' registrations (for the gateway's
    /// subset hints).
    #[arg(long, env = "KVROUTER_EPPS", default_value_t = 0)]
    pub epps: u32,
    /// Peer-router identities (peer-0, ...): routers that call the replicas with the client
    /// library. Same permissions as a frontend.
    #[arg(long, env = "KVROUTER_PEERS", default_value_t = 0)]
    pub peers: u32,
    /// Confine the bridges to this model's subjects (default: any model).
    #[arg(long, env = "KVROUTER_MODEL")]
    pub model: Option<String>,
    /// Overwrite files a previous run wrote (new keys: every process needs its new seed).
    #[arg(long, env = "KVROUTER_FORCE")]
    pub force: bool,
}

/// Who an identity is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Replica(String),
    Frontend(u32),
    Epp(u32),
    Bridge(u64),
    Peer(u32),
}

impl Role {
    /// `replica-a`, `frontend-0`, `epp-0`, `bridge-10`, `peer-0`: the seed file's name
    /// without `.nk`.
    pub fn name(&self) -> String {
        match self {
            Role::Replica(id) => format!("replica-{id}"),
            Role::Frontend(i) => format!("frontend-{i}"),
            Role::Epp(i) => format!("epp-{i}"),
            Role::Bridge(id) => format!("bridge-{id}"),
            Role::Peer(i) => format!("peer-{i}"),
        }
    }
}

/// What one user may do on the bus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    /// `subject` or `subject queue-group` (a queue subscription in that group only).
    pub subscribe: Vec<String>,
    /// May answer requests it received (streams included).
    pub responds: bool,
}

/// The permissions of `role` whose public key is `key`, in namespace `subjects`; `model`
/// confines bridges to one model.
pub fn permissions(
    role: &Role,
    key: &str,
    subjects: &Subjects,
    model: Option<&str>,
) -> anyhow::Result<Permissions> {
    let s = subjects;
    let ns = s.namespace();
    // Worker subjects for any model (`*`) or the one given: built from a stand-in model
    // whose token is then replaced, so every subject comes from the protocol's own list.
    let stand_in = s.model("_")?;
    let model_tok = match model {
        Some(m) => model_token(m).with_context(|| format!("model {m:?}"))?,
        None => "*".to_string(),
    };
    let for_model = |subject: String, token: &str| {
        subject.replacen(
            &format!("{ns}.model._."),
            &format!("{ns}.model.{token}."),
            1,
        )
    };
    let any = |subject: String| for_model(subject, "*");
    let inbox = format!("_INBOX.{key}.>");
    let queue = |subject: String, group: &str| format!("{subject} {group}");
    let lease_updates = || vec![s.mark_prefill("*"), s.free("*"), s.add_output_block("*")];
    Ok(match role {
        Role::Replica(id) => {
            let own_prefix = s
                .sync_own(id)
                .rsplit_once('.')
                .map(|(p, _)| format!("{p}.>"))
                .context("replica subject")?;
            let mut publish = vec![s.sync_of(id), s.sync_state(), s.sync_own("*")];
            publish.extend(lease_updates());
            publish.extend([
                any(stand_in.who_is_there()),
                any(stand_in.every_worker(WorkerSubject::State)),
                any(stand_in.indexer_find_matches()),
                any(stand_in.indexer_record()),
                any(stand_in.indexer_announce()),
                any(stand_in.indexer_dump()),
            ]);
            let mut subscribe = vec![
                queue(s.route(), ROUTER_QUEUE_GROUP),
                queue(s.route_disagg(), ROUTER_QUEUE_GROUP),
                queue(s.overlap_scores(), ROUTER_QUEUE_GROUP),
                queue(s.potential_loads(), ROUTER_QUEUE_GROUP),
                own_prefix,
                s.abandon(),
                s.sync_all(),
                s.legacy_sync(),
                queue(s.sync_state(), SYNC_QUEUE_GROUP),
            ];
            for what in WorkerSubject::PUBLISHED {
                subscribe.push(any(stand_in.every_worker(what)));
            }
            for what in WorkerSubject::PUBLISHED {
                subscribe.extend(stand_in.legacy(what).map(any));
            }
            subscribe.extend([
                queue(any(stand_in.indexer_find_matches()), INDEXER_QUEUE_GROUP),
                queue(any(stand_in.indexer_dump()), INDEXER_QUEUE_GROUP),
                any(stand_in.indexer_record()),
                any(stand_in.indexer_announce()),
                inbox,
            ]);
            Permissions {
                publish,
                subscribe,
                responds: true,
            }
        }
        Role::Frontend(_) | Role::Peer(_) | Role::Epp(_) => {
            let mut publish = vec![
                s.route(),
                s.route_disagg(),
                s.overlap_scores(),
                s.potential_loads(),
            ];
            publish.extend(lease_updates());
            publish.extend([
                s.abandon(),
                any(stand_in.every_worker(WorkerSubject::Generate)),
            ]);
            let mut subscribe = vec![inbox];
            if matches!(role, Role::Epp(_)) {
                // Which workers answer at which endpoint: their registrations, read only,
                // and a roll call at start.
                publish.push(any(stand_in.who_is_there()));
                subscribe.extend([
                    any(stand_in.every_worker(WorkerSubject::Register)),
                    any(stand_in.every_worker(WorkerSubject::Deregister)),
                ]);
            }
            Permissions {
                publish,
                subscribe,
                responds: false,
            }
        }
        Role::Bridge(worker_id) => {
            let own = for_model(
                stand_in
                    .register(*worker_id)
                    .rsplit_once('.')
                    .map(|(p, _)| format!("{p}.>"))
                    .context("worker subject")?,
                &model_tok,
            );
            Permissions {
                publish: vec![own.clone()],
                subscribe: vec![own, for_model(stand_in.who_is_there(), &model_tok), inbox],
                responds: true,
            }
        }
    })
}

/// One identity: its role and key pair.
pub struct Identity {
    pub role: Role,
    pub key: nkeys::KeyPair,
}

impl Identity {
    fn public_key(&self) -> String {
        self.key.public_key()
    }

    fn seed(&self) -> anyhow::Result<String> {
        self.key
            .seed()
            .map_err(|e| anyhow::anyhow!("cannot encode the seed of {}: {e}", self.role.name()))
    }
}

/// The roles a run makes, in file order; checks the ids.
pub fn roles(args: &CredsArgs) -> anyhow::Result<Vec<Role>> {
    let mut seen = std::collections::HashSet::new();
    for id in &args.replica_ids {
        ensure!(
            !id.is_empty()
                && id.len() <= kvrouter_protocol::limits::MAX_REPLICA_ID_BYTES
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "replica id {id:?} is not valid: use letters, digits, '-' and '_' (at most {} \
             bytes), as `kvrouter serve --replica-id` does",
            kvrouter_protocol::limits::MAX_REPLICA_ID_BYTES
        );
        ensure!(seen.insert(id.clone()), "replica id {id:?} is given twice");
    }
    let mut workers = std::collections::HashSet::new();
    for id in &args.worker_ids {
        ensure!(workers.insert(*id), "worker id {id} is given twice");
    }
    let total = args.replica_ids.len()
        + args.worker_ids.len()
        + args.frontends as usize
        + args.epps as usize
        + args.peers as usize;
    ensure!(
        total <= MAX_IDENTITIES,
        "{total} identities asked for; at most {MAX_IDENTITIES} in one static users file (use \
         NATS decentralized JWT authentication for more, see docs/operations.md)"
    );
    let mut roles: Vec<Role> = args
        .replica_ids
        .iter()
        .cloned()
        .map(Role::Replica)
        .collect();
    roles.extend((0..args.frontends).map(Role::Frontend));
    roles.extend((0..args.epps).map(Role::Epp));
    roles.extend(args.worker_ids.iter().copied().map(Role::Bridge));
    roles.extend((0..args.peers).map(Role::Peer));
    Ok(roles)
}

/// The nats-server `authorization` block: one nkey user per `(role, public key)`.
pub fn users_conf(
    subjects: &Subjects,
    model: Option<&str>,
    users: &[(Role, String)],
) -> anyhow::Result<String> {
    let mut out = String::new();
    let list = |out: &mut String, what: &str, items: &[String]| {
        let _ = writeln!(out, "        {what}: {{");
        let _ = writeln!(out, "          allow: [");
        for i in items {
            let _ = writeln!(out, "            \"{i}\"");
        }
        let _ = writeln!(out, "          ]");
        let _ = writeln!(out, "        }}");
    };
    out.push_str("authorization {\n  users = [\n");
    for (role, key) in users {
        let p = permissions(role, key, subjects, model)?;
        let _ = writeln!(out, "    # {}", role.name());
        let _ = writeln!(out, "    {{");
        let _ = writeln!(out, "      nkey: \"{key}\"");
        let _ = writeln!(out, "      permissions: {{");
        list(&mut out, "publish", &p.publish);
        list(&mut out, "subscribe", &p.subscribe);
        if p.responds {
            // Streamed answers (worker state, generate, sync and indexer dumps) are many
            // messages to one reply subject.
            out.push_str("        allow_responses: { max: 1000000, expires: \"1h\" }\n");
        }
        out.push_str("      }\n    }\n");
    }
    out.push_str("  ]\n}\n");
    Ok(out)
}

/// The header of nats-users.conf.
fn users_header(namespace: &str, model: Option<&str>) -> String {
    format!(
        "# NATS users of the kvrouter fleet in namespace \"{namespace}\"{}, written by `kvrouter \
         creds`:\n\
         # one nkey user per replica, frontend, bridge (worker id) and peer router, each confined\n\
         # to the subjects its job needs and to its own replies (_INBOX.<its public key>.>).\n\
         # Public keys only: the seeds are in seeds/ and kubernetes.yaml. Include this file from\n\
         # nats-server's configuration: include \"nats-users.conf\"\n",
        model.map_or(String::new(), |m| format!(
            " (bridges confined to model {m:?})"
        ))
    )
}

/// A Kubernetes Secret with string data (each value a literal block).
fn secret(name: &str, data: &[(String, String)]) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  labels:\n    \
         app.kubernetes.io/part-of: kvrouter\n    app.kubernetes.io/component: nats-credentials\n\
         type: Opaque\nstringData:\n"
    );
    for (key, value) in data {
        let _ = writeln!(out, "  {key}: |");
        for line in value.lines() {
            if line.is_empty() {
                out.push('\n');
            } else {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    out
}

/// kubernetes.yaml: the users file and every seed as Secrets; returns it and the number of
/// Secrets.
fn kubernetes_yaml(users: &str, ids: &[Identity]) -> anyhow::Result<(String, usize)> {
    let mut docs = vec![secret(
        "kvrouter-nats-users",
        &[("nats-users.conf".into(), users.to_string())],
    )];
    let mut replicas = Vec::new();
    for id in ids {
        let seed = format!("{}\n", id.seed()?);
        let name = match &id.role {
            Role::Replica(_) => {
                replicas.push((format!("{}.nk", id.role.name()), seed));
                continue;
            }
            Role::Frontend(0) => "kvrouter-nats-frontend".to_string(),
            other => format!("kvrouter-nats-{}", other.name()),
        };
        docs.push(secret(&name, &[("seed.nk".into(), seed)]));
    }
    if !replicas.is_empty() {
        docs.insert(1, secret("kvrouter-nats-replicas", &replicas));
    }
    let n = docs.len();
    let head = "# NATS identities of a kvrouter fleet, written by `kvrouter creds`: SECRET (nkey \
                seeds).\n# Apply it (kubectl apply -f), never commit it. Mount each seed with \
                defaultMode 0400.\n";
    Ok((format!("{head}{}", docs.join("---\n")), n))
}

/// Writes `contents` to `path` with `mode` (Unix), replacing what is there.
fn write_file(path: &Path, contents: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    let mut f = opts
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    #[cfg(unix)]
    {
        // A file that existed (--force) keeps its old mode otherwise.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    f.write_all(contents.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

fn make_dir(path: &Path, mode: u32) -> anyhow::Result<()> {
    std::fs::create_dir_all(path).with_context(|| format!("cannot create {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    Ok(())
}

pub fn run(args: CredsArgs) -> anyhow::Result<()> {
    let subjects = Subjects::new(&args.namespace)
        .with_context(|| format!("namespace {:?}", args.namespace))?;
    let model = args.model.as_deref();
    if let Some(m) = model {
        model_token(m).with_context(|| format!("model {m:?}"))?;
    }
    let roles = roles(&args)?;
    let seeds = args.out.join("seeds");
    let users_path = args.out.join("nats-users.conf");
    let k8s_path = args.out.join("kubernetes.yaml");
    let mut targets: Vec<PathBuf> = roles
        .iter()
        .map(|r| seeds.join(format!("{}.nk", r.name())))
        .collect();
    targets.extend([users_path.clone(), k8s_path.clone()]);
    if !args.force {
        if let Some(there) = targets.iter().find(|p| p.exists()) {
            bail!(
                "{} exists already (from an earlier run?); new keys replace every seed, so \
                 pass --force to overwrite, or choose another --out",
                there.display()
            );
        }
    }
    let ids: Vec<Identity> = roles
        .into_iter()
        .map(|role| Identity {
            role,
            key: nkeys::KeyPair::new_user(),
        })
        .collect();
    let users: Vec<(Role, String)> = ids
        .iter()
        .map(|i| (i.role.clone(), i.public_key()))
        .collect();
    let conf = format!(
        "{}{}",
        users_header(&args.namespace, model),
        users_conf(&subjects, model, &users)?
    );
    let (yaml, secrets) = kubernetes_yaml(&conf, &ids)?;

    make_dir(&args.out, 0o755)?;
    make_dir(&seeds, 0o700)?;
    for id in &ids {
        let path = seeds.join(format!("{}.nk", id.role.name()));
        write_file(&path, &format!("{}\n", id.seed()?), 0o600)?;
    }
    write_file(&users_path, &conf, 0o644)?;
    write_file(&k8s_path, &yaml, 0o600)?;
    let count = |f: fn(&Role) -> bool| ids.iter().filter(|i| f(&i.role)).count();
    println!(
        "wrote {} NATS identities for namespace {} (replicas {}, frontends {}, endpoint \
         pickers {}, bridges {}, peers {}) to {}: seeds/*.nk, nats-users.conf, kubernetes.yaml \
         ({secrets} Secrets)",
        ids.len(),
        args.namespace,
        count(|r| matches!(r, Role::Replica(_))),
        count(|r| matches!(r, Role::Frontend(_))),
        count(|r| matches!(r, Role::Epp(_))),
        count(|r| matches!(r, Role::Bridge(_))),
        count(|r| matches!(r, Role::Peer(_))),
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "UKEY";

    fn perms(role: Role, model: Option<&str>) -> Permissions {
        permissions(&role, KEY, &Subjects::new("ns").unwrap(), model).unwrap()
    }

    /// Whether NATS would let `allowed` (a permission subject, maybe with a queue group)
    /// cover `subject`.
    fn covers(allowed: &[String], subject: &str) -> bool {
        allowed.iter().any(|a| {
            let pattern = a.split(' ').next().unwrap();
            kvrouter_bus::subject::matches(pattern, subject)
        })
    }

    #[test]
    fn nobody_reads_every_reply() {
        for role in [
            Role::Replica("a".into()),
            Role::Frontend(0),
            Role::Epp(0),
            Role::Bridge(10),
            Role::Peer(1),
        ] {
            let p = perms(role.clone(), None);
            for s in &p.subscribe {
                if s.starts_with("_INBOX") {
                    assert_eq!(s, "_INBOX.UKEY.>", "{role:?}");
                }
                assert!(!s.starts_with('>') && !s.starts_with('*'), "{role:?}: {s}");
            }
            assert!(!covers(&p.subscribe, "_INBOX.OTHER.x"), "{role:?}");
            assert!(covers(&p.subscribe, "_INBOX.UKEY.abc.1"), "{role:?}");
            assert!(!covers(&p.publish, "_INBOX.OTHER.x"), "{role:?}");
        }
    }

    #[test]
    fn a_frontend_asks_but_never_answers_nor_syncs() {
        let p = perms(Role::Frontend(0), None);
        let s = Subjects::new("ns").unwrap();
        for ok in [s.route(), s.free("a"), s.abandon(), s.mark_prefill("b")] {
            assert!(covers(&p.publish, &ok), "{ok}");
        }
        assert!(covers(&p.publish, "ns.model.M.worker.10.generate"));
        for no in [
            s.sync_of("a"),
            s.legacy_sync(),
            s.sync_state(),
            s.sync_own("a"),
        ] {
            assert!(!covers(&p.publish, &no), "{no}");
        }
        assert!(!covers(&p.publish, "ns.model.M.worker.10.register"));
        assert_eq!(p.subscribe, ["_INBOX.UKEY.>"]);
        assert!(!p.responds, "cannot answer a route request");
        assert_eq!(perms(Role::Peer(3), None), p);
    }

    /// An endpoint picker asks as a frontend does, and reads the workers' registrations
    /// (never their events, loads or generate streams), and calls the roll.
    #[test]
    fn an_endpoint_picker_asks_and_follows_registrations_only() {
        let p = perms(Role::Epp(0), None);
        let s = Subjects::new("ns").unwrap();
        let frontend = perms(Role::Frontend(0), None);
        for f in &frontend.publish {
            assert!(p.publish.contains(f), "{f}");
        }
        assert!(covers(&p.publish, "ns.model.M.discovery.who_is_there"));
        for ok in [
            "ns.model.M.worker.10.register",
            "ns.model.M.worker.10.deregister",
        ] {
            assert!(covers(&p.subscribe, ok), "{ok}");
        }
        for no in [
            "ns.model.M.worker.10.kv_events",
            "ns.model.M.worker.10.load",
            "ns.model.M.worker.10.generate",
            "ns.model.M.worker.10.heartbeat",
        ] {
            assert!(!covers(&p.subscribe, no), "{no}");
        }
        assert!(!covers(&p.subscribe, &s.route()));
        assert!(!covers(&p.publish, "ns.model.M.worker.10.register"));
        assert!(!p.responds);
    }

    #[test]
    fn a_replica_publishes_only_its_own_sync_subject_and_hears_its_own_updates() {
        let p = perms(Role::Replica("a".into()), None);
        let s = Subjects::new("ns").unwrap();
        assert!(covers(&p.publish, &s.sync_of("a")));
        assert!(!covers(&p.publish, &s.sync_of("b")));
        assert!(!covers(&p.publish, &s.legacy_sync()));
        assert!(!covers(&p.publish, &s.route()), "a replica asks no routes");
        assert!(
            covers(&p.publish, &s.free("b")),
            "JSON API updates go to the router"
        );
        assert!(covers(&p.subscribe, &s.free("a")));
        assert!(covers(&p.subscribe, &s.sync_own("a")));
        assert!(
            !covers(&p.subscribe, &s.free("b")),
            "another replica's updates"
        );
        assert!(covers(&p.subscribe, &s.sync_of("b")));
        assert!(covers(&p.subscribe, "ns.model.M.worker.10.kv_events"));
        assert!(!covers(&p.publish, "ns.model.M.worker.10.kv_events"));
        assert!(covers(&p.publish, "ns.model.M.worker.10.state"));
        assert!(p
            .subscribe
            .contains(&format!("{} {ROUTER_QUEUE_GROUP}", s.route())));
        assert!(p.responds);
    }

    #[test]
    fn a_bridge_speaks_only_for_its_worker_and_model() {
        let p = perms(Role::Bridge(10), None);
        assert!(covers(&p.publish, "ns.model.M.worker.10.register"));
        assert!(!covers(&p.publish, "ns.model.M.worker.11.register"));
        assert!(!covers(&p.publish, "ns.model.M.kv_events"));
        assert!(covers(&p.subscribe, "ns.model.M.worker.10.state"));
        assert!(covers(&p.subscribe, "ns.model.M.discovery.who_is_there"));
        let p = perms(Role::Bridge(10), Some("Qwen/Qwen3-0.6B"));
        assert_eq!(p.publish, ["ns.model.Qwen~2FQwen3-0~2E6B.worker.10.>"]);
        assert!(!covers(&p.publish, "ns.model.M.worker.10.register"));
    }

    #[test]
    fn ids_are_checked() {
        let args = |replicas: &[&str], workers: &[u64]| CredsArgs {
            out: "x".into(),
            namespace: "ns".into(),
            replica_ids: replicas.iter().map(|s| s.to_string()).collect(),
            worker_ids: workers.to_vec(),
            frontends: 2,
            epps: 1,
            peers: 1,
            model: None,
            force: false,
        };
        let r = roles(&args(&["a", "b"], &[10])).unwrap();
        let names: Vec<String> = r.iter().map(Role::name).collect();
        assert_eq!(
            names,
            [
                "replica-a",
                "replica-b",
                "frontend-0",
                "frontend-1",
                "epp-0",
                "bridge-10",
                "peer-0"
            ]
        );
        for bad in [&["a.b"][..], &[""], &["a", "a"], &["x y"]] {
            assert!(roles(&args(bad, &[10])).is_err(), "{bad:?}");
        }
        assert!(roles(&args(&["a"], &[10, 10])).is_err());
    }

    #[test]
    fn secrets_carry_the_seeds_under_their_names() {
        let ids: Vec<Identity> = [
            Role::Replica("a".into()),
            Role::Replica("b".into()),
            Role::Frontend(0),
            Role::Frontend(1),
            Role::Bridge(10),
            Role::Peer(0),
        ]
        .into_iter()
        .map(|role| Identity {
            role,
            key: nkeys::KeyPair::new_user(),
        })
        .collect();
        let (yaml, n) = kubernetes_yaml("authorization {\n}\n", &ids).unwrap();
        assert_eq!(n, 6);
        for name in [
            "kvrouter-nats-users",
            "kvrouter-nats-replicas",
            "kvrouter-nats-frontend",
            "kvrouter-nats-frontend-1",
            "kvrouter-nats-bridge-10",
            "kvrouter-nats-peer-0",
        ] {
            assert!(yaml.contains(&format!("  name: {name}\n")), "{name}");
        }
        for key in ["replica-a.nk:", "replica-b.nk:", "nats-users.conf:"] {
            assert!(yaml.contains(key), "{key}");
        }
        for id in &ids {
            assert!(yaml.contains(&format!("    {}\n", id.seed().unwrap())));
        }
    }
}
