//! `scripts/chaos`: the full chaos run (tests/suite/kit/chaos.rs), once per seed.
//!   chaos [--seed N]… [--runs N] [--instances 5] [--products-per-shop 2500] [--per-list 100]
//!         [--for 60] [--settle 300] [--transactions off]
//! Needs SEEDLOCK_BIN (the seedlock binary) and SEEDLOCK_TEST_SERVER_BIN (a restartable
//! database) or MONGODB_URI (then the database restart is skipped). Exit 1 if any run failed.
#[path = "../tests/suite/kit/mod.rs"]
mod kit;

use kit::chaos;

use std::path::PathBuf;
use std::time::Duration;

fn usage(message: &str) -> ! {
    eprintln!("chaos: {message}");
    eprintln!("usage: chaos [--seed N]… [--runs N] [--instances N] [--products-per-shop N] [--per-list N] [--for SECONDS] [--settle SECONDS] [--transactions off|auto|on]");
    std::process::exit(2);
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seeds = Vec::new();
    let mut transactions = "off".to_owned();
    let (mut runs, mut instances, mut products, mut per_list, mut chaos_for, mut settle) =
        (3_usize, 5_usize, 2500_u32, 100_u32, 60_u64, 300_u64);
    let mut i = 0;
    while i < args.len() {
        let value = args
            .get(i + 1)
            .unwrap_or_else(|| usage(&format!("{} needs a value", args[i])));
        let number = || -> u64 {
            value
                .parse()
                .unwrap_or_else(|_| usage(&format!("{} needs a number, not {value:?}", args[i])))
        };
        match args[i].as_str() {
            "--seed" => seeds.push(number()),
            "--transactions" => transactions = value.clone(),
            "--runs" => runs = number() as usize,
            "--instances" => instances = number() as usize,
            "--products-per-shop" => products = number() as u32,
            "--per-list" => per_list = number() as u32,
            "--for" => chaos_for = number(),
            "--settle" => settle = number(),
            other => usage(&format!("unknown argument {other:?}")),
        }
        i += 2;
    }
    if per_list == 0 || products < per_list || instances == 0 {
        usage("need --instances ≥ 1, --per-list ≥ 1 and --products-per-shop ≥ --per-list");
    }
    if seeds.is_empty() {
        seeds = (0..runs).map(|_| rand::random::<u32>() as u64).collect();
    }
    let seedlock_bin = std::env::var_os("SEEDLOCK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| usage("SEEDLOCK_BIN is not set (scripts/chaos sets it)"));
    let server_bin = std::env::var_os("SEEDLOCK_TEST_SERVER_BIN").map(PathBuf::from);
    let uri = std::env::var("MONGODB_URI").ok();
    let root = std::env::current_dir().unwrap();
    let mut failed = Vec::new();
    for seed in seeds {
        let dir = chaos::default_dir(&root, seed);
        let _ = std::fs::remove_dir_all(&dir);
        println!("### chaos run, seed {seed} (logs: {})", dir.display());
        let report = chaos::run(chaos::ChaosConfig {
            seed,
            instances,
            products_per_shop: products,
            per_list,
            chaos_for: Duration::from_secs(chaos_for),
            settle_for: Duration::from_secs(settle),
            seedlock_bin: seedlock_bin.clone(),
            server_bin: server_bin.clone(),
            uri: uri.clone(),
            dir,
            transactions: transactions.clone(),
        })
        .await;
        println!("{}", report.render());
        if !report.passed() {
            println!("reproduce: scripts/chaos --seed {seed}\n");
            failed.push(seed);
        }
    }
    if !failed.is_empty() {
        println!("FAILED seeds: {failed:?}");
        std::process::exit(1);
    }
}
