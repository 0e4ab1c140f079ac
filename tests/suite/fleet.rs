//! Bots defined in the database (real processes against the server): instances whose config has
//! no `[[bots]]` run what `seedlock bots apply` writes, follow changes of it at runtime — a new
//! bot, a changed spec (at the next pass), a pause, a removal, a broken spec — and `export`
//! streams a bot's records.

use crate::kit;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use futures_util::TryStreamExt;
use kit::crawl::*;
use kit::*;
use nix::sys::signal::Signal;
use serde_json::json;

/// A config with no `[[bots]]`: the instance runs the database's bots.
fn fleet_config(db: &TestDb, dir: &Path) -> PathBuf {
    let mut config = ProcConfig::new(db, String::new());
    config.extra = "[crawl]\nworkers = 2\n";
    config.write(dir)
}

fn bots_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `seedlock -c CONFIG ARGS…` to its end; (exit code, stdout, stderr).
async fn cli(dir: &Path, config: &Path, args: &[&str]) -> (i32, String, String) {
    let name = format!("cli-{}", rand::random::<u32>());
    let mut p = Proc::spawn(dir, config, &name, args, &[]);
    let status = p.wait(Duration::from_secs(60)).await;
    (status.code().unwrap_or(-1), p.out(), p.log())
}

fn instance(dir: &Path, config: &Path, name: &str) -> Proc {
    Proc::spawn(
        dir,
        config,
        name,
        &["run", "--ignore-robots"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    )
}

/// A test's fleet: its database, a demo shop (product pages slowed by `latency_ms`, so a pass
/// is still running when the test acts), and a config with no `[[bots]]`.
struct Fleet {
    db: TestDb,
    dir: tempfile::TempDir,
    base: String,
    config: PathBuf,
}

impl Fleet {
    async fn start(hint: &str, lists: u32, per_list: u32, latency_ms: u64) -> Fleet {
        let db = test_db(hint).await;
        let dir = tempfile::tempdir().unwrap();
        let base = shop(lists, per_list).await;
        if latency_ms > 0 {
            post(
                &format!("{base}/__faults"),
                json!([{"path": "/product/", "latency_ms": latency_ms}]),
            )
            .await;
        }
        let config = fleet_config(&db, dir.path());
        Fleet {
            db,
            dir,
            base,
            config,
        }
    }

    fn instance(&self, name: &str) -> Proc {
        instance(self.dir.path(), &self.config, name)
    }

    async fn cli(&self, args: &[&str]) -> (i32, String, String) {
        cli(self.dir.path(), &self.config, args).await
    }

    /// `bots apply` of `text` (as a file), which must succeed; its stdout.
    async fn apply(&self, text: &str) -> String {
        let file = bots_file(
            self.dir.path(),
            &format!("bots-{}.toml", rand::random::<u32>()),
            text,
        );
        let (code, out, err) = self.cli(&["bots", "apply", file.to_str().unwrap()]).await;
        assert_eq!(code, 0, "{out}{err}");
        out
    }
}

/// SIGTERM, then a clean exit, for each.
async fn stop_all(procs: &mut [&mut Proc]) {
    for p in procs.iter_mut() {
        p.signal(Signal::SIGTERM);
    }
    for p in procs.iter_mut() {
        p.expect_ok(Duration::from_secs(30)).await;
    }
}

/// The shop's spec edited by hand, as in mongosh: `$set` (dotted keys into `spec`), version raised.
async fn edit_spec(db: &TestDb, set: Document) {
    db.bots()
        .update_one(
            doc! {"_id": "shop"},
            doc! {"$set": set, "$inc": {"specVersion": 1_i64}},
        )
        .await
        .unwrap();
}

async fn bot(db: &TestDb, id: &str) -> Option<Document> {
    db.doc(id).await
}

async fn pass_of(db: &TestDb) -> (i64, bool) {
    let d = bot(db, "shop").await.expect("the shop's document");
    let pass = d.get_i64("crawlPass").unwrap_or(0);
    let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
    (pass, ended)
}

async fn wait_for_pass_end(db: &TestDb, pass: i64, within: Duration) {
    eventually(&format!("pass {pass} ends"), within, || async {
        pass_of(db).await == (pass, true)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_without_bots_crawl_a_bot_applied_to_the_database_exactly() {
    // Pages slow enough that the pass outlasts one instance's start.
    let f = Fleet::start("fleetapply", 8, 25, 40).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("fa");
    let mut b = f.instance("fb");
    let (addr_a, addr_b) = (a.http_addr().await, b.http_addr().await);
    assert!(bot(db, "shop").await.is_none(), "nothing runs before apply");

    let out = f.apply(&crawl_bot_toml(base)).await;
    assert_eq!(out.trim(), "shop: created");
    let doc = bot(db, "shop").await.unwrap();
    assert_eq!(doc.get_i64("specVersion").unwrap(), 1);
    assert!(doc.get_document("spec").unwrap().contains_key("crawl"));

    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;
    assert_eq!(live_records(db).await, truth(base).await);
    // Both instances crawled it.
    for addr in [&addr_a, &addr_b] {
        let pages = metric(addr, r#"seedlock_crawl_requests_total{bot="shop"}"#).await;
        assert!(pages.unwrap_or(0.0) > 0.0, "{addr} fetched nothing");
    }
    // Applying the same bots again changes nothing.
    assert_eq!(
        f.apply(&crawl_bot_toml(base)).await.trim(),
        "shop: unchanged"
    );
    stop_all(&mut [&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bot_applied_with_selector_lists_and_tables_runs_from_its_stored_spec() {
    let f = Fleet::start("fleettables", 2, 5, 0).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("ta");
    // HTML listings, the record from the product pages' JSON-LD: list- and table-valued keys,
    // stored in the spec as BSON arrays and documents and read back by the instance.
    let host = base.trim_start_matches("http://");
    let toml = format!(
        r#"[[bots]]
id = "shop"
seeds = {{ url = "{base}/seeds.txt", format = "lines" }}
refresh = "1h"
[bots.crawl]
scope = ["{host}"]
follow = ["a[href]", "$.next"]
[bots.crawl.list]
item = [".item", "$.products[*]"]
item_id = ["@data-id", "$.id"]
item_link = {{ css = "a@href" }}
fingerprint = [".price", {{ css = ".status" }}, "$.price.amount"]
[bots.crawl.record]
match = "/product/"
natural_key = {{ jsonld = "Product", path = "$.sku" }}
[bots.crawl.record.fields]
title = {{ jsonld = "Product", path = "$.name", required = true }}
price = {{ css = ".price", type = "number" }}
status = ".status"
"#
    );
    assert_eq!(f.apply(&toml).await.trim(), "shop: created");
    let spec = bot(db, "shop").await.unwrap();
    let stored = spec
        .get_document("spec")
        .unwrap()
        .get_document("crawl")
        .unwrap();
    assert!(stored.get_array("follow").is_ok(), "{stored:?}");
    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;
    let d = bot(db, "shop").await.unwrap();
    assert!(
        matches!(d.get("specError"), None | Some(Bson::Null)),
        "{d:?}"
    );
    let truth = truth(base).await;
    let records = records(db).await;
    assert_eq!(records.len(), truth.len());
    for r in &records {
        let key = r.get_str("naturalKey").unwrap();
        let data = r.get_document("data").unwrap();
        let (title, price, status) = &truth[key];
        assert_eq!(data.get_str("title").unwrap(), title);
        assert_eq!(
            data.get_f64("price").unwrap(),
            price.trim_start_matches('$').parse::<f64>().unwrap()
        );
        assert_eq!(data.get_str("status").unwrap(), status);
    }
    assert_eq!(f.apply(&toml).await.trim(), "shop: unchanged");
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bots_apply_validates_everything_first_and_dry_run_and_prune_say_what_they_do() {
    let f = Fleet::start("fleetvalid", 1, 1, 0).await;
    let (db, dir) = (&f.db, f.dir.path());
    let good = url_bot("a", "http://127.0.0.1:9/a.txt") + &url_bot("b", "http://127.0.0.1:9/b.txt");
    // A bad selector in the second bot: one line naming the bot and the key, nothing written.
    let bad = format!(
        "{}{}",
        url_bot("a", "http://127.0.0.1:9/a.txt"),
        crawl_bot_toml("http://127.0.0.1:9").replace(".sku", "[[[")
    );
    let bad = bots_file(dir, "bad.toml", &bad);
    let (code, out, err) = f.cli(&["bots", "apply", bad.to_str().unwrap()]).await;
    assert_eq!(code, 2, "{out}{err}");
    let line = err.lines().last().unwrap();
    assert!(
        line.contains("bot \"shop\"") && line.contains("bots[1].crawl.record.natural_key"),
        "{err}"
    );
    assert!(db.store().bots().load_all().await.unwrap().is_empty());

    let file = bots_file(dir, "good.toml", &good);
    let (code, out, _) = f
        .cli(&["bots", "apply", "--dry-run", file.to_str().unwrap()])
        .await;
    assert_eq!(code, 0);
    assert!(
        out.contains("a: created (dry run") && out.contains("b: created (dry run"),
        "{out}"
    );
    assert!(
        db.store().bots().load_all().await.unwrap().is_empty(),
        "a dry run writes nothing"
    );
    let (code, _, _) = f.cli(&["bots", "apply", file.to_str().unwrap()]).await;
    assert_eq!(code, 0);

    let changed = url_bot("a", "http://127.0.0.1:9/a2.txt");
    let file = bots_file(dir, "changed.toml", &changed);
    let (code, out, _) = f
        .cli(&["bots", "apply", "--prune", file.to_str().unwrap()])
        .await;
    assert_eq!(code, 0);
    assert_eq!(out.trim(), "a: changed (seeds.url)\nb: removed");
    assert!(bot(db, "b").await.is_none());
    let a = bot(db, "a").await.unwrap();
    assert_eq!(a.get_i64("specVersion").unwrap(), 2);
    assert!(
        matches!(a.get("refreshRequestedAt"), Some(Bson::DateTime(_))),
        "a changed spec asks for a refresh: its next pass starts on it"
    );
    let (code, out, _) = f.cli(&["bots", "list", "--json"]).await;
    assert_eq!(code, 0);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows[0]["bot"], "a");
    assert_eq!(rows[0]["spec_version"], 2);
    assert_eq!(rows[0]["paused"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bots_apply_reports_in_file_order_and_a_bot_it_cannot_write_does_not_stop_the_rest() {
    let f = Fleet::start("fleetorder", 1, 1, 0).await;
    let (db, dir) = (&f.db, f.dir.path());
    // More bots than are written at once, named so that file order is not sorted order.
    let ids: Vec<String> = (0..150).map(|i| format!("b{}", (i * 37) % 150)).collect();
    // `b74` already exists with a history that is not a list: no write can push onto it.
    db.bots()
        .insert_one(
            doc! {"_id": "b74", "spec": {"old": true}, "specVersion": 1_i64, "history": "broken"},
        )
        .await
        .unwrap();
    let text: String = ids
        .iter()
        .map(|id| url_bot(id, &format!("http://127.0.0.1:9/{id}.txt")))
        .collect();
    let file = bots_file(dir, "many.toml", &text);
    let (code, out, err) = f.cli(&["bots", "apply", file.to_str().unwrap()]).await;
    assert_eq!(code, 1, "{out}{err}");
    let expected: Vec<String> = ids
        .iter()
        .filter(|id| *id != "b74")
        .map(|id| format!("{id}: created"))
        .collect();
    assert_eq!(out.lines().collect::<Vec<_>>(), expected);
    assert!(err.contains("b74:"), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap()
            .contains("1 of 150 bots were not applied"),
        "{err}"
    );
    let stored = db.store().bots().load_all().await.unwrap().len();
    assert_eq!(stored, 150, "every other bot was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_changed_mid_pass_takes_effect_at_the_next_pass() {
    // Slow products: the first pass is still running when the spec changes.
    let f = Fleet::start("fleetchange", 6, 20, 120).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("ca");
    let mut b = f.instance("cb");
    let full = |title: &str| {
        crawl_bot_toml(base).replace("title = \"h1\"", &format!("title = \"{title}\""))
            + "[bots.crawl.incremental]\nmode = \"full\"\n"
    };
    f.apply(&full("h1")).await;
    eventually("pass 1 is under way", Duration::from_secs(30), || async {
        records(db).await.len() >= 10
    })
    .await;
    // The title now comes from the SKU element.
    let out = f.apply(&full(".sku")).await;
    assert_eq!(out.trim(), "shop: changed (crawl.record.fields.title)");
    assert_eq!(pass_of(db).await, (1, false), "the change came mid-pass");

    // Pass 1 ends on the spec it started with (the next starts at once: the apply asked for a
    // refresh). Whenever it is read, a record last stored by pass 1 carries a product name.
    eventually("pass 1 ends", Duration::from_secs(60), || async {
        bot(db, "shop").await.and_then(|d| {
            d.get_document("crawlLastPass")
                .ok()
                .and_then(|l| l.get_i64("pass").ok())
        }) == Some(1)
    })
    .await;
    let truth = truth(base).await;
    let stored = records(db).await;
    assert_eq!(stored.len(), truth.len());
    let mut by_pass_1 = 0;
    for r in &stored {
        let key = r.get_str("naturalKey").unwrap();
        let title = r.get_document("data").unwrap().get_str("title").unwrap();
        match r.get_i64("fetchedPass").unwrap() {
            1 => {
                by_pass_1 += 1;
                assert_eq!(title, truth[key].0, "pass 1 stored {key} with the old spec");
            }
            _ => assert_eq!(title, key, "pass 2 stored {key} with the new spec"),
        }
    }
    assert!(
        by_pass_1 * 2 > truth.len(),
        "read too late: {by_pass_1} of pass 1's records left"
    );
    let doc = bot(db, "shop").await.unwrap();
    // The apply asked for a refresh; the next pass starts on the new spec.
    eventually("pass 2 ends", Duration::from_secs(60), || async {
        let (pass, ended) = pass_of(db).await;
        pass >= 2 && ended
    })
    .await;
    let doc2 = bot(db, "shop").await.unwrap();
    assert_eq!(doc.get_i64("specVersion").unwrap(), 2);
    assert_eq!(doc2.get_i64("crawlPassSpecVersion").unwrap(), 2);
    for r in records(db).await {
        let key = r.get_str("naturalKey").unwrap();
        assert_eq!(
            r.get_document("data").unwrap().get_str("title").unwrap(),
            key,
            "pass 2 used the new spec"
        );
    }
    stop_all(&mut [&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_bot_stops_fetching_and_resumes_to_an_exact_end() {
    let f = Fleet::start("fleetpause", 8, 20, 100).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("pa");
    let mut b = f.instance("pb");
    let addr = a.http_addr().await;
    let _ = b.http_addr().await;
    f.apply(&crawl_bot_toml(base)).await;
    eventually("the pass is under way", Duration::from_secs(30), || async {
        Requests::peek(base).await.under("/product/") >= 20
    })
    .await;

    let (code, out, _) = f.cli(&["pause", "shop", "--reason", "maintenance"]).await;
    assert_eq!(code, 0, "{out}");
    let doc = bot(db, "shop").await.unwrap();
    assert!(doc.get_bool("paused").unwrap());
    assert_eq!(doc.get_str("pauseReason").unwrap(), "maintenance");
    // After the in-flight pages settle, the shop sees no more requests.
    let mut last = Requests::peek(base).await.under("/");
    let mut steady_since = Instant::now();
    let settled = Instant::now();
    while steady_since.elapsed() < Duration::from_secs(2) {
        assert!(
            settled.elapsed() < Duration::from_secs(20),
            "requests did not stop"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = Requests::peek(base).await.under("/");
        if now != last {
            last = now;
            steady_since = Instant::now();
        }
    }
    assert_eq!(pass_of(db).await, (1, false), "paused mid-pass");
    eventually(
        "status and metrics show it paused",
        Duration::from_secs(10),
        || async { metric(&addr, r#"seedlock_bot_paused{bot="shop"}"#).await == Some(1.0) },
    )
    .await;
    let (_, status, _) = f.cli(&["status"]).await;
    assert!(status.contains("(paused)"), "{status}");
    let leased = frontier(db, doc! {"botId": "shop", "status": "leased"}).await;
    assert!(leased.is_empty(), "the leases went back: {leased:?}");

    let (code, _, _) = f.cli(&["resume", "shop"]).await;
    assert_eq!(code, 0);
    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;
    assert_eq!(live_records(db).await, truth(base).await);
    // No page fetched twice beyond those in flight at the pause (2 workers on each of 2 instances).
    let repeated = Requests::peek(base).await.repeated();
    assert!(repeated <= 4, "{repeated} pages fetched twice");
    stop_all(&mut [&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_bot_stops_on_every_instance_and_purge_leaves_nothing_of_it() {
    let f = Fleet::start("fleetremove", 3, 10, 0).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("ra");
    let mut b = f.instance("rb");
    f.apply(&crawl_bot_toml(base)).await;
    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;
    assert!(!records(db).await.is_empty());

    let removed = Instant::now();
    let (code, out, err) = f.cli(&["bots", "remove", "shop", "--purge"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("shop: removed"), "{out}");
    assert!(out.contains("purged"), "{out}");
    // Within one poll (200 ms here), plus the process's own start and the check's step.
    for p in [&a, &b] {
        eventually(
            "the instance stops the bot",
            Duration::from_secs(5),
            || async { p.log().contains("was removed") },
        )
        .await;
    }
    assert!(removed.elapsed() < Duration::from_secs(5));
    assert!(bot(db, "shop").await.is_none(), "nothing re-created it");
    assert!(frontier(db, doc! {"botId": "shop"}).await.is_empty());
    assert!(records(db).await.is_empty());
    stop_all(&mut [&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_spec_puts_only_its_bot_in_error_naming_the_key_until_fixed() {
    let f = Fleet::start("fleetbad", 2, 10, 0).await;
    let (db, base) = (&f.db, &f.base);
    let source = SeedSourceServer::start().await;
    let mut a = f.instance("ma");
    f.apply(&(crawl_bot_toml(base) + &url_bot("other", &source.url()) + "refresh = \"1s\"\n"))
        .await;
    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;

    // Hand-edited in mongosh into something no instance can parse.
    edit_spec(db, doc! {"spec.crawl.list.item": "[[["}).await;
    eventually(
        "the bot shows Error naming the key",
        Duration::from_secs(10),
        || async {
            let (_, out, _) = f.cli(&["status", "--json"]).await;
            let rows: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            rows.as_array().is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["bot"] == "shop"
                        && r["state"] == "error"
                        && r["last_error"]
                            .as_str()
                            .is_some_and(|e| e.contains("spec.crawl.list.item"))
                })
            })
        },
    )
    .await;
    // The other bot runs on: it keeps refreshing.
    let hits = source.hits();
    eventually(
        "the other bot refreshes",
        Duration::from_secs(10),
        || async { source.hits() > hits },
    )
    .await;
    assert!(a.log().contains("spec.crawl.list.item"));

    edit_spec(db, doc! {"spec.crawl.list.item": ".item"}).await;
    eventually(
        "the fixed spec runs again",
        Duration::from_secs(10),
        || async {
            let d = bot(db, "shop").await.unwrap();
            matches!(d.get("specError"), Some(Bson::Null)) && d.get_bool("isReady").unwrap_or(false)
        },
    )
    .await;

    // A spec overwritten with something that is no document at all; `bots apply` repairs it.
    edit_spec(db, doc! {"spec": "oops"}).await;
    eventually(
        "Error: spec is no document",
        Duration::from_secs(10),
        || async {
            bot(db, "shop")
                .await
                .and_then(|d| d.get_str("specError").ok().map(str::to_owned))
                .is_some_and(|e| e.contains("key `spec`: must be a document"))
        },
    )
    .await;
    let out = f
        .apply(&(crawl_bot_toml(base) + &url_bot("other", &source.url()) + "refresh = \"1s\"\n"))
        .await;
    assert!(out.contains("shop: changed (spec)"), "{out}");
    eventually("the applied spec runs", Duration::from_secs(10), || async {
        let d = bot(db, "shop").await.unwrap();
        matches!(d.get("specError"), Some(Bson::Null)) && d.get_document("spec").is_ok()
    })
    .await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_a_newer_version_wrote_with_keys_this_one_does_not_know_is_left_unmarked() {
    let f = Fleet::start("fleetnewer", 1, 3, 0).await;
    let (db, base) = (&f.db, &f.base);
    let mut a = f.instance("na");
    f.apply(&crawl_bot_toml(base)).await;
    wait_for_pass_end(db, 1, Duration::from_secs(60)).await;
    let applied = bot(db, "shop").await.unwrap();
    assert_eq!(
        applied.get_str("specBy").unwrap(),
        env!("CARGO_PKG_VERSION"),
        "an apply records the version that wrote the spec"
    );
    // A rolling upgrade: a newer seedlock applied a spec with a key this version lacks.
    edit_spec(
        db,
        doc! {"spec.crawl.a_key_from_the_future": 5, "specBy": "999.0.0"},
    )
    .await;
    eventually(
        "the instance leaves the bot to newer ones",
        Duration::from_secs(10),
        || async { a.log().contains("left to the newer instances") },
    )
    .await;
    let d = bot(db, "shop").await.unwrap();
    assert!(
        matches!(d.get("specError"), None | Some(Bson::Null)),
        "not marked: {d:?}"
    );
    // The same spec written by this version: a bad spec, Error naming the key.
    edit_spec(db, doc! {"specBy": env!("CARGO_PKG_VERSION")}).await;
    eventually(
        "Error naming the unknown key",
        Duration::from_secs(10),
        || async {
            bot(db, "shop")
                .await
                .and_then(|d| d.get_str("specError").ok().map(str::to_owned))
                .is_some_and(|e| e.contains("a_key_from_the_future"))
        },
    )
    .await;
    a.signal(Signal::SIGTERM);
    a.expect_ok(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_streams_every_record_as_json_lines_or_csv() {
    let f = Fleet::start("fleetexport", 1, 1, 0).await;
    let db = &f.db;
    f.apply(&crawl_bot_toml("http://127.0.0.1:9")).await;
    let n = 5_000u32;
    let now = bson::DateTime::now();
    let docs: Vec<Document> = (0..n)
        .map(|i| {
            doc! {
                "_id": format!("r{i:06}"), "botId": "shop", "naturalKey": format!("SKU-{i}"),
                "url": format!("http://127.0.0.1:9/product/SKU-{i}"),
                "data": {"title": format!("Thing, \"{i}\""), "price": "1", "status": "ok"},
                "firstSeen": now, "lastChanged": now, "removedAt": if i % 10 == 0 { Bson::DateTime(now) } else { Bson::Null },
            }
        })
        .collect();
    db.db
        .collection::<Document>("records")
        .insert_many(docs)
        .await
        .unwrap();

    let (code, out, err) = f.cli(&["export", "shop", "--include-removed"]).await;
    assert_eq!(code, 0, "{err}");
    let mut stored: Vec<Document> = db
        .db
        .collection::<Document>("records")
        .find(doc! {"botId": "shop"})
        .sort(doc! {"_id": 1})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let exported: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(exported.len(), stored.len());
    stored.sort_by(|a, b| a.get_str("_id").unwrap().cmp(b.get_str("_id").unwrap()));
    for (line, record) in exported.iter().zip(&stored) {
        assert_eq!(
            line,
            &seedlock::ops::admin::to_json(&Bson::Document(record.clone()))
        );
    }
    // Without --include-removed: the live ones; CSV: a header, then one row each.
    let (_, live, _) = f.cli(&["export", "shop"]).await;
    assert_eq!(live.lines().count() as u32, n - n / 10);
    let (code, csv, _) = f.cli(&["export", "shop", "--format", "csv"]).await;
    assert_eq!(code, 0);
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "naturalKey,url,price,status,title,firstSeen,lastChanged,removedAt"
    );
    assert!(lines.next().unwrap().contains(",\"Thing, \"\"1\"\"\","));
    assert_eq!(csv.lines().count() as u32, 1 + n - n / 10);
    // --changed-since after every change: nothing.
    let (_, none, _) = f
        .cli(&["export", "shop", "--changed-since", "2999-01-01T00:00:00Z"])
        .await;
    assert_eq!(none, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_bot_takes_no_lock_until_it_is_resumed() {
    let f = Fleet::start("fleetpauselock", 1, 1, 0).await;
    let source = SeedSourceServer::start().await;
    let mut a = f.instance("la");
    let mut b = f.instance("lb");
    f.apply(&url_bot("feed", &source.url())).await;
    eventually("the bot is ready", Duration::from_secs(20), || async {
        bot(&f.db, "feed")
            .await
            .is_some_and(|d| d.get_bool("isReady").unwrap_or(false))
    })
    .await;
    let epoch = f.db.epoch("feed").await;
    assert_eq!(f.cli(&["pause", "feed"]).await.0, 0);
    // A refresh asked for while paused: no instance takes the lock for it.
    assert_eq!(f.cli(&["refresh", "feed"]).await.0, 0);
    let hits = source.hits();
    let asked = Instant::now();
    while asked.elapsed() < Duration::from_millis(1500) {
        assert_eq!(f.db.epoch("feed").await, epoch, "a paused bot was locked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(source.hits(), hits, "a paused bot's seeds were fetched");
    // Resumed: the refresh asked for happens.
    assert_eq!(f.cli(&["resume", "feed"]).await.0, 0);
    eventually(
        "the refresh runs after resume",
        Duration::from_secs(10),
        || async { f.db.epoch("feed").await > epoch && source.hits() > hits },
    )
    .await;
    stop_all(&mut [&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_bots_on_three_instances_are_each_refreshed_exactly_once() {
    // A fleet larger than the refresh permits of all three instances together (3 × 16), each
    // bot with a seed source of its own that answers at once: every bot becomes ready, each
    // refreshed by exactly one request, and no instance loses a lock or times out.
    let f = Fleet::start("fleet200", 1, 1, 0).await;
    let source = SeedSourceServer::start().await;
    let names: Vec<String> = (0..200).map(|i| format!("b{i:03}")).collect();
    let file: String = names
        .iter()
        .map(|bot| url_bot(bot, &source.bot_url(bot)))
        .collect();
    let mut procs: Vec<Proc> = ["f1", "f2", "f3"].iter().map(|n| f.instance(n)).collect();
    f.apply(&file).await;
    let ready = || async {
        let mut cursor =
            f.db.bots()
                .find(doc! { "isReady": true, "isEditing": false })
                .await
                .unwrap();
        let mut n = 0;
        while cursor.try_next().await.unwrap().is_some() {
            n += 1;
        }
        n
    };
    eventually("all 200 bots ready", Duration::from_secs(120), || async {
        ready().await == 200
    })
    .await;
    let hits = source.bot_hits();
    let wrong: Vec<(&String, usize)> = names
        .iter()
        .map(|bot| (bot, hits.get(bot).copied().unwrap_or(0)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        wrong.is_empty(),
        "bots not refreshed exactly once: {wrong:?}"
    );
    // Nobody is left waiting, and the refreshes did not trip over each other.
    assert_eq!(
        f.db.bots()
            .count_documents(doc! { "$or": [{ "isReady": false }, { "isEditing": true }] })
            .await
            .unwrap(),
        0
    );
    let mut refs: Vec<&mut Proc> = procs.iter_mut().collect();
    stop_all(&mut refs).await;
    for p in &procs {
        let log = p.log();
        for bad in [
            "edit lock lost",
            "did not finish within",
            "cannot read the bots",
        ] {
            assert!(!log.contains(bad), "{bad:?} in an instance's log:\n{log}");
        }
    }
}
