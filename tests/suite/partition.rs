//! Network partitions with real processes: one instance's traffic to the database is
//! blackholed (not refused, not reset: swallowed) for longer than ttl while its timers keep
//! firing. It must stop refreshing and stop fetching within ttl, the others take over, and once
//! healed its late writes are fenced and nothing is lost.

use crate::kit;

use std::time::{Duration, Instant};

use bson::doc;
use kit::blackhole::Blackhole;
use kit::crawl::*;
use kit::{eventually, test_db, Proc, ProcConfig};
use nix::sys::signal::Signal;
use serde_json::json;

const TTL: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_instance_stops_within_ttl_the_others_take_over_and_its_late_writes_are_fenced(
) {
    let db = test_db("partition").await;
    // 4 lists of 30 at 100 ms a page: a pass of several seconds. The seed source takes 4 s (the
    // first matching rule applies).
    let base = shop(4, 30).await;
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/seeds.txt", "latency_ms": 4000}, {"path": "/", "latency_ms": 100}]),
    )
    .await;
    let proxy = Blackhole::start(&kit::blackhole::server_of(&db.uri)).await;
    let dir = tempfile::tempdir().unwrap();
    let extra = "[crawl]\nworkers = 2\nlease = \"3s\"\ntimeout = \"2s\"\n";
    let config_for = |uri: &str| {
        let mut config = ProcConfig::new(&db, crawl_bot_toml(&base));
        config.uri = uri;
        config.ttl = "2s";
        config.extra = extra;
        config.write(dir.path())
    };
    let a_uri = proxy.uri(&db.uri);
    let (a_config, b_config) = (config_for(&a_uri), config_for(&db.uri));
    let listen = [("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")];
    let mut a = Proc::spawn(dir.path(), &a_config, "a", &["run"], &listen);
    let a_addr = a.http_addr().await;
    eventually("a holds the edit lock", Duration::from_secs(20), || async {
        db.doc("shop")
            .await
            .is_some_and(|d| d.get_str("editingBy") == Ok("a"))
    })
    .await;
    let mut b = Proc::spawn(dir.path(), &b_config, "b", &["run"], &[]);
    eventually("b waits", Duration::from_secs(20), || async {
        b.log().contains("waiting")
    })
    .await;
    let a_epoch = db.epoch("shop").await;

    // 1. Cut while a refreshes under the lock.
    proxy.cut();
    let cut = Instant::now();
    post(
        &format!("{base}/__faults"),
        json!([{"path": "/", "latency_ms": 100}]),
    )
    .await;
    eventually("a gives the lock up", TTL * 5, || async {
        a.log().contains("edit lock lost; stopped without writing")
    })
    .await;
    let gave_up = cut.elapsed();
    // Its lock ran out at most ttl after its last confirmed heartbeat (the cut), plus a poll.
    assert!(
        gave_up <= TTL + Duration::from_millis(900),
        "a gave up after {gave_up:?}"
    );
    eventually(
        "b took over and refreshed",
        Duration::from_secs(20),
        || async {
            db.doc("shop").await.is_some_and(|d| {
                d.get_bool("isReady") == Ok(true) && d.get_i64("lockEpoch").unwrap_or(0) > a_epoch
            })
        },
    )
    .await;
    let history = db.history("shop").await;
    assert!(
        history.iter().any(|h| h.get_str("event") == Ok("took_over")
            && h.get_str("by") == Ok("b")
            && h.get_str("reason").is_ok_and(|r| r.starts_with("B-1"))),
        "{history:?}"
    );

    // 2. Healed: a's held heartbeat reaches the server late, matches nothing, and a crawls
    // beside b.
    let settled = db.doc("shop").await.unwrap();
    proxy.heal();
    eventually("a crawls again", Duration::from_secs(20), || async {
        metric(&a_addr, r#"seedlock_crawl_requests_total{bot="shop"}"#)
            .await
            .is_some_and(|n| n > 0.0)
    })
    .await;
    let after_heal = db.doc("shop").await.unwrap();
    for field in [
        "lockEpoch",
        "seeds",
        "isReady",
        "editingBy",
        "lastSeedUpdatedAt",
    ] {
        assert_eq!(
            after_heal.get(field),
            settled.get(field),
            "a's late writes changed {field}"
        );
    }

    // 3. Cut while a crawls: within ttl it starts no fetch, while b carries the pass.
    let requested = || async {
        metric(&a_addr, r#"seedlock_crawl_requests_total{bot="shop"}"#)
            .await
            .unwrap_or(0.0)
    };
    proxy.cut();
    let cut = Instant::now();
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    let stopped_at = requested().await;
    eventually("b crawls on", Duration::from_secs(20), || async {
        frontier(&db, doc! {"status": "done"}).await.len() > 20
    })
    .await;
    let b_moved_on = frontier(&db, doc! {"status": "done"}).await.len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        requested().await,
        stopped_at,
        "a fetched pages {:?} after its cut",
        cut.elapsed()
    );
    assert!(
        a.log()
            .contains("the database has not answered for longer than lock.ttl"),
        "{}",
        a.log()
    );
    assert!(frontier(&db, doc! {"status": "done"}).await.len() >= b_moved_on);

    // 4. Healed again: the pass completes with every record exactly as the shop has it.
    proxy.heal();
    eventually("the pass completed", Duration::from_secs(60), || async {
        db.doc("shop")
            .await
            .and_then(|d| d.get_document("crawlLastPass").ok().cloned())
            .is_some_and(|p| p.get_i64("pass") == Ok(1))
    })
    .await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    for p in [&mut a, &mut b] {
        p.signal(Signal::SIGTERM);
        p.expect_ok(Duration::from_secs(30)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_whose_database_stops_answering_fails_within_the_operation_timeout() {
    // `seedlock export` reads a cursor batch after batch; a server that swallows a further
    // batch's request must end the export with an error after `op_timeout`, not hang it.
    let db = test_db("export_partition").await;
    let records: Vec<bson::Document> = (0..2500)
        .map(|i| doc! { "_id": format!("r{i:05}"), "botId": "shop", "naturalKey": format!("K{i}"), "removedAt": bson::Bson::Null })
        .collect();
    db.db
        .collection::<bson::Document>("records")
        .insert_many(records)
        .await
        .unwrap();
    let proxy = Blackhole::start(&kit::blackhole::server_of(&db.uri)).await;
    let client = mongodb::Client::with_uri_str(proxy.uri(&db.uri))
        .await
        .unwrap();
    let op_timeout = Duration::from_secs(1);
    let store = seedlock::store::Store::new(client.database(&db.name)).with_op_timeout(op_timeout);
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    let mut export = store
        .records()
        .export_records(&bot, None, false)
        .await
        .unwrap();
    // The first batch (1,000 records) is in hand; the next needs the server.
    assert!(export.next().await.unwrap().is_some());
    proxy.cut();
    let cut = Instant::now();
    let mut read = 1;
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match export.next().await {
                Ok(Some(_)) => read += 1,
                other => return other,
            }
        }
    })
    .await
    .expect("the export ends instead of hanging");
    assert!(
        matches!(end, Err(seedlock::error::Error::Timeout { .. })),
        "{end:?}"
    );
    assert_eq!(
        read, 1000,
        "the first batch read, then the wait for the second"
    );
    assert!(
        cut.elapsed() < op_timeout + Duration::from_secs(2),
        "ended {:?} after the cut",
        cut.elapsed()
    );
}
