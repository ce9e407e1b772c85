//! `kvrouter subjects`: every bus subject a model's fleet uses (no NATS needed).

use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub struct SubjectsArgs {
    /// Namespace of every subject.
    #[arg(
        long,
        env = "KVROUTER_NAMESPACE",
        default_value = "kvrouter",
        value_name = "NS"
    )]
    pub namespace: String,
    /// Model name, as the workers register it.
    #[arg(long, env = "KVROUTER_MODEL")]
    pub model: String,
}

/// Prints `name subject` a line; `*` stands for a worker id or a replica id.
pub fn run(args: SubjectsArgs) -> anyhow::Result<()> {
    let list =
        kvrouter_protocol::fleet_subjects(&args.namespace, &args.model).with_context(|| {
            format!(
                "cannot list the subjects of namespace {:?}, model {:?}",
                args.namespace, args.model
            )
        })?;
    let width = list.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    for (name, subject) in list {
        println!("{name:<width$} {subject}");
    }
    Ok(())
}
