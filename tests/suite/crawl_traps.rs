//! Crawl-trap bounds on the demo shop's endless calendar: the chain ends at `max_depth`, its
//! dropped links counted by bound in the bot document and `status`; a pass that hits
//! `max_pages_per_host` is incomplete and removes nothing, and the next complete pass does.

use crate::kit;

use bson::doc;
use kit::crawl::*;
use kit::shop::Shop;
use kit::test_db;
use seedlock::demo_site::SiteOptions;
use serde_json::json;

/// A shop whose listing pages link to the endless calendar.
async fn calendar_shop(lists: u32, per_list: u32) -> String {
    Shop::start_options(SiteOptions {
        lists,
        per_list,
        seed: 11,
        calendar: true,
        ..SiteOptions::default()
    })
    .await
    .leak()
}

/// A pass of the shop's HTML bot with `bounds` added to `[bots.crawl]`.
async fn pass_with(db: &kit::TestDb, base: &str, bounds: &str) {
    let host = base.trim_start_matches("http://");
    let rules = seedlock::demo_site::crawl_rules_toml(&[host], ".sku").replacen(
        "[bots.crawl]\n",
        &format!("[bots.crawl]\n{bounds}\n"),
        1,
    );
    let setup = Setup {
        rules: Some(rules),
        ..Setup::default()
    };
    once(settings(db, base, &setup, "a")).await;
}

fn calendar_pages(requests: &Requests) -> u64 {
    requests.under("/calendar/")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_trap_ends_at_max_depth_and_its_dropped_links_are_counted() {
    let db = test_db("trap_depth").await;
    let base = calendar_shop(1, 5).await;
    Requests::take(&base).await;
    pass_with(&db, &base, "max_depth = 6").await;
    // The seed is depth 0, its calendar link 1: the months within 5 of the first, both ways.
    assert_eq!(calendar_pages(&Requests::take(&base).await), 11);
    assert_eq!(
        live_records(&db).await,
        truth(&base).await,
        "the shop itself whole"
    );
    let bot = bot_doc(&db).await;
    let dropped = bot.get_document("crawlPassDropped").unwrap();
    assert_eq!(dropped.get_i64("pass").unwrap(), 1);
    // The two months at depth 6 link on (earlier and later): 4 links past the bound.
    assert_eq!(dropped.get_i64("max_depth").unwrap(), 4);
    let last = bot.get_document("crawlLastPass").unwrap();
    assert_eq!(
        last.get_document("dropped")
            .unwrap()
            .get_i64("max_depth")
            .unwrap(),
        4,
        "the pass's summary counts them"
    );
    assert_eq!(
        last.get_str("deletion").unwrap(),
        "applied",
        "a depth bound leaves the pass complete"
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("status.toml");
    std::fs::write(
        &config,
        format!(
            "[mongo]\nuri = \"{}\"\ndatabase = \"{}\"\n[http]\nlisten = \"off\"\n",
            db.uri, db.name
        ),
    )
    .unwrap();
    let status = |json: bool| {
        let mut args = vec!["-c", config.to_str().unwrap(), "status"];
        if json {
            args.push("--json");
        }
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_seedlock"))
            .args(&args)
            .env_remove("MONGODB_URI")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let rows: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    assert_eq!(rows[0]["dropped"], "pass 1: max_depth 4");
    let table = status(false);
    assert!(
        table.contains("dropped pass 1: max_depth 4"),
        "status shows them:\n{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_that_hits_max_pages_per_host_is_incomplete_and_removes_nothing() {
    let db = test_db("trap_pages").await;
    let base = calendar_shop(2, 10).await;
    // The default bounds: the calendar ends at depth 50, the pass is complete.
    pass_with(&db, &base, "").await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let calendar = frontier(&db, doc! { "url": { "$regex": "/calendar/" }, "pass": 1 }).await;
    assert_eq!(
        calendar.len(),
        99,
        "months within 49 of the first, both ways"
    );

    let report = post(&format!("{base}/__mutate"), json!({"delete": 1})).await;
    let deleted = skus(&report, "deleted");
    request_refresh(&db).await;
    pass_with(&db, &base, "max_pages_per_host = 30").await;
    let in_pass = frontier(&db, doc! { "pass": 2 }).await.len();
    assert!(
        in_pass <= 31,
        "the pass stopped near its bound: {in_pass} pages; {:?}",
        bot_doc(&db).await
    );
    assert!(removed_keys(&db).await.is_empty(), "nothing removed");
    let last = bot_doc(&db).await;
    let last = last.get_document("crawlLastPass").unwrap();
    let why = last.get_str("deletion").unwrap();
    assert!(
        why.starts_with("skipped: the pass is incomplete: it hit max_pages_per_host ("),
        "the gate says why: {why}"
    );
    assert!(
        last.get_document("dropped")
            .unwrap()
            .get_i64("max_pages_per_host")
            .unwrap()
            > 0
    );

    request_refresh(&db).await;
    pass_with(&db, &base, "").await;
    assert_eq!(
        removed_keys(&db).await,
        deleted,
        "the next complete pass removes it"
    );
    assert_eq!(live_records(&db).await, truth(&base).await);
}
