//! The chaos suite, small: 3 instances, 3 bots, two shops of 120 products, 15 s of faults
//! (SIGKILL + restart, SIGSTOP of a lock holder past ttl, a partition of one instance from the
//! database past ttl and a database restart when the suite runs its own server,
//! an admin unlock mid-refresh, a seed source failing), then every
//! invariant checked (tests/suite/kit/chaos.rs). `scripts/chaos` runs the full size.
use crate::kit;

use kit::chaos;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use bson::{doc, Document};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kills_stops_partitions_a_database_restart_and_unlocks_every_invariant_holds() {
    let seed = std::env::var("SEEDLOCK_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u32>) as u64;
    // Printed first, so a run that hangs or panics can still be replayed.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("chaos-seed-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "chaos seed {seed} (SEEDLOCK_CHAOS_SEED={seed} replays it); logs in {}",
        dir.display()
    );
    let report = chaos::run(chaos::ChaosConfig {
        seed,
        instances: 3,
        products_per_shop: 120,
        per_list: 20,
        chaos_for: Duration::from_secs(15),
        settle_for: Duration::from_secs(150),
        seedlock_bin: PathBuf::from(env!("CARGO_BIN_EXE_seedlock")),
        server_bin: std::env::var_os("SEEDLOCK_TEST_SERVER_BIN").map(PathBuf::from),
        uri: std::env::var("MONGODB_URI").ok(),
        dir: dir.clone(),
        transactions: std::env::var("SEEDLOCK_CHAOS_TRANSACTIONS").unwrap_or_else(|_| "off".into()),
    })
    .await;
    println!("{}", report.render());
    assert!(
        report.kills >= 5,
        "faults were injected:\n{}",
        report.render()
    );
    assert!(
        report.passed(),
        "reproduce with SEEDLOCK_CHAOS_SEED={seed}; logs in {}\n{}",
        dir.display(),
        report.render()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn entry(event: &str, by: &str, epoch: i64) -> Document {
    doc! { "at": bson::DateTime::now(), "event": event, "by": by, "epoch": epoch, "reason": "" }
}

fn violations(entries: Vec<Document>) -> Vec<String> {
    let mut report = chaos::ChaosReport::default();
    chaos::check_history(
        &HashMap::from([("shop-a".to_owned(), entries)]),
        &mut report,
    );
    report.violations
}

#[test]
fn the_history_check_accepts_a_clean_history_and_catches_each_kind_of_split_brain() {
    let clean = vec![
        entry("created", "i1", 0),
        entry("acquired", "i1", 1),
        entry("refreshed", "i1", 1),
        entry("took_over", "i2", 2),
        entry("unlocked", "admin", 3),
        entry("acquired", "i3", 4),
        entry("refresh_failed", "i3", 4),
    ];
    assert_eq!(violations(clean.clone()), Vec::<String>::new());

    // Two instances won one epoch.
    let mut twice = clean.clone();
    twice.insert(2, entry("took_over", "i2", 1));
    let v = violations(twice);
    assert!(v.iter().any(|v| v.contains("does not exceed")), "{v:?}");

    // A stale holder's write accepted after a later epoch began.
    let mut late = clean.clone();
    late.insert(4, entry("refreshed", "i1", 1));
    let v = violations(late);
    assert!(v.iter().any(|v| v.contains("after epoch 2 began")), "{v:?}");

    // A write under an epoch someone else holds, or nobody won.
    let mut other = clean.clone();
    other.push(entry("refreshed", "i2", 4));
    let v = violations(other);
    assert!(v.iter().any(|v| v.contains("which i3 holds")), "{v:?}");
    let mut nobody = clean;
    nobody.insert(5, entry("released", "i1", 3));
    let v = violations(nobody);
    assert!(v.iter().any(|v| v.contains("which nobody won")), "{v:?}");
}
