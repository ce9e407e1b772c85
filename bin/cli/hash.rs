//! `kvrouter hash`: local and sequence hashes of a token list, as the router computes them.

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_protocol::{local_block_hashes, sequence_hashes};

#[derive(Args)]
pub struct HashArgs {
    /// Tokens per block.
    #[arg(long, env = "KVROUTER_BLOCK_SIZE")]
    block_size: usize,
    /// LoRA adapter name (changes the hash seed); empty means none.
    #[arg(long, env = "KVROUTER_LORA")]
    lora: Option<String>,
    /// Print JSON: {"local": [...], "sequence": [...]}.
    #[arg(long, env = "KVROUTER_JSON")]
    json: bool,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, env = "KVROUTER_TOKENS")]
    tokens: String,
}

fn parse_tokens(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(i, t)| {
            t.parse::<u32>()
                .with_context(|| format!("token {} ({t:?}) is not a u32", i + 1))
        })
        .collect()
}

pub fn run(args: HashArgs) -> anyhow::Result<()> {
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let tokens = parse_tokens(&args.tokens)?;
    let local = local_block_hashes(&tokens, args.block_size, args.lora.as_deref())?;
    let sequence = sequence_hashes(&local);
    let hex = |v: u64| format!("{v:#018x}");
    let local: Vec<String> = local.iter().map(|h| hex(h.0)).collect();
    let sequence: Vec<String> = sequence.iter().map(|h| hex(h.0)).collect();
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "local": local, "sequence": sequence })
        );
    } else {
        println!("block  local               sequence");
        for (i, (l, s)) in local.iter().zip(&sequence).enumerate() {
            println!("{i:<6} {l} {s}");
        }
        let rest = tokens.len() % args.block_size;
        if rest > 0 {
            println!("({rest} trailing tokens form no full block)");
        }
    }
    Ok(())
}
