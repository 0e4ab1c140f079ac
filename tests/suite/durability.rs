//! Write and read concerns, checked on the wire: the driver's command monitoring sees every
//! command a crawling instance sends, and each write must survive a primary's failover.

use crate::kit;

use std::time::Duration;

use bson::{doc, Bson, Document};
use kit::crawl::*;
use kit::test_db;
use mongodb::Client;
use seedlock::daemon::{run_with_store, Mode};
use seedlock::store::Store;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WRITES: [&str; 4] = ["insert", "update", "delete", "findAndModify"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_is_majority_journaled_with_a_bounded_wait_and_lock_decisions_read_majority() {
    for transactions in ["off", "on"] {
        let db = test_db("durability").await;
        let base = shop(2, 10).await;
        // A seed source slower than a heartbeat (ttl 5 s / 3): the refresh heartbeats.
        post(
            &format!("{base}/__faults"),
            json!([{"path": "/seeds.txt", "latency_ms": 2000}]),
        )
        .await;
        let setup = Setup {
            transactions,
            ..Setup::default()
        };
        let (store, sent) = monitored_store(&db.uri, &db.name).await;
        run_with_store(
            settings(&db, &base, &setup, "a"),
            store,
            Mode::Once {
                timeout: Duration::from_secs(60),
            },
            CancellationToken::new(),
        )
        .await
        .expect("run --once finishes the pass");
        assert_eq!(live_records(&db).await, truth(&base).await);

        let sent = sent.lock().unwrap().clone();
        let on = |name: &str, coll: &str| {
            sent.iter()
                .filter(|(n, c)| n == name && c.get_str(name) == Ok(coll))
                .count()
        };
        // What this run must have sent, or the checks below prove nothing.
        let heartbeats = sent
            .iter()
            .filter(|(n, c)| n == "update" && c.get_str("update") == Ok("bots"))
            .flat_map(|(_, c)| c.get_array("updates").cloned().unwrap_or_default())
            .filter(|u| {
                let set = u.as_document().and_then(|u| u.get_document("u").ok());
                let set = set.and_then(|u| u.get_document("$set").ok());
                set.is_some_and(|s| s.keys().eq(["lockExpiresAt"]))
            })
            .count();
        assert!(on("findAndModify", "bots") >= 1, "a claim");
        assert!(heartbeats >= 1, "a heartbeat");
        assert!(on("update", "frontier") >= 1 && on("find", "bots") >= 1);
        // Majority, journaled, and a bound on the wait for the majority.
        let durable = |concern: Result<&bson::Document, _>| {
            concern.is_ok_and(|c| {
                c.get_str("w") == Ok("majority")
                    && c.get_bool("j") == Ok(true)
                    && c.get("wtimeout")
                        .and_then(seedlock::store::document::integer)
                        .is_some_and(|ms| ms > 0)
            })
        };
        let mut in_transaction = 0;
        for (name, command) in &sent {
            let what = format!("{transactions}: {name} {command}");
            if WRITES.contains(&name.as_str()) {
                if command.get_bool("autocommit") == Ok(false) {
                    // A statement of a transaction: its commit carries the concern.
                    in_transaction += 1;
                    assert!(command.get("writeConcern").is_none(), "{what}");
                } else {
                    assert!(durable(command.get_document("writeConcern")), "{what}");
                }
            }
            if name == "commitTransaction" {
                assert!(durable(command.get_document("writeConcern")), "{what}");
            }
            // The change stream only wakes the loop, which then reads the document: the
            // document reads are the decisions' reads.
            let change_stream = command
                .get_array("pipeline")
                .ok()
                .and_then(|p| p.first())
                .and_then(|stage| stage.as_document())
                .is_some_and(|stage| stage.contains_key("$changeStream"));
            let reads_bots = ["find", "aggregate"]
                .iter()
                .any(|read| name == read && command.get_str(*read) == Ok("bots"))
                && !change_stream;
            if reads_bots {
                assert_eq!(
                    command
                        .get_document("readConcern")
                        .ok()
                        .and_then(|c| c.get("level")),
                    Some(&Bson::String("majority".into())),
                    "{what}"
                );
            }
        }
        if transactions == "on" {
            assert!(in_transaction > 0 && sent.iter().any(|(n, _)| n == "commitTransaction"));
        }
    }
}

/// Whether a plain write (setting `field`) to `{_id: 1}` of `things` goes through within
/// `within`.
async fn writes_within(db: &mongodb::Database, field: &str, within: Duration) -> bool {
    let things = db.collection::<Document>("things");
    matches!(
        tokio::time::timeout(
            within,
            things.update_one(doc! { "_id": 1 }, doc! { "$set": { field: true } })
        )
        .await,
        Ok(Ok(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_a_dead_process_left_open_is_ended_when_its_id_is_taken_over() {
    use seedlock::clock::{LocalClock, ServerClock};
    use seedlock::ids::InstanceId;

    let db = test_db("dead_txn").await;
    let me = InstanceId::parse("mortal").unwrap();
    let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 60_000);
    db.db
        .collection::<Document>("instances")
        .insert_one(doc! {
            "_id": me.as_str(), "host": "elsewhere", "pid": 1_i64, "token": "old",
            "heartbeatAt": past, "expiresAt": past,
        })
        .await
        .unwrap();
    db.db
        .collection::<Document>("things")
        .insert_one(doc! { "_id": 1, "v": 0 })
        .await
        .unwrap();

    // A process (its own client) names its session, writes inside a transaction, and dies there:
    // nothing ends the transaction (the session is never dropped, committed or aborted).
    let mortal = Client::with_uri_str(&db.uri).await.unwrap();
    let doomed = Store::new(mortal.database(&db.name));
    doomed.instances().name_transaction_sessions(&me);
    let mut session = mortal.start_session().await.unwrap();
    doomed.instances().name_session(&session).await.unwrap();
    session.start_transaction().await.unwrap();
    mortal
        .database(&db.name)
        .collection::<Document>("things")
        .update_one(doc! { "_id": 1 }, doc! { "$set": { "v": 1 } })
        .session(&mut session)
        .await
        .unwrap();
    std::mem::forget(session);
    let named = db
        .db
        .collection::<Document>("instances")
        .find_one(doc! { "_id": me.as_str() })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(named.get_array("txnSessions").unwrap().len(), 1, "{named}");
    assert!(
        !writes_within(&db.db, "before", Duration::from_secs(2)).await,
        "the open transaction holds the document"
    );

    // The successor takes the id over and ends the dead process's transaction: the document is
    // free at once, not when the server's transaction lifetime (60 s) runs out.
    let successor = db.store();
    let clock = ServerClock::new(LocalClock::default());
    seedlock::runner::presence::register(&successor, &me, &clock, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        writes_within(&db.db, "after", Duration::from_secs(10)).await,
        "the document is free after the takeover"
    );
    let thing = db
        .db
        .collection::<Document>("things")
        .find_one(doc! { "_id": 1 })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(thing.get_bool("after"), Ok(true), "{thing}");
    assert_eq!(
        thing.get_i32("v"),
        Ok(0),
        "the dead transaction's write was not kept: {thing}"
    );
}

/// `uri` (of a server that is one member of a replica set, or a standalone) rewritten to reach
/// the set by its name and ask for secondary reads, as a shared connection string might; `None`
/// for a server that is no replica set member.
async fn secondary_reads_uri(uri: &str) -> Option<String> {
    let client = Client::with_uri_str(uri).await.unwrap();
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .unwrap();
    let set = hello.get_str("setName").ok()?.to_owned();
    let (base, query) = uri.split_once('?').unwrap_or((uri, ""));
    let mut params: Vec<String> = query
        .split('&')
        .filter(|p| {
            !p.is_empty()
                && !p.starts_with("directConnection")
                && !p.starts_with("readPreference")
                && !p.starts_with("replicaSet")
        })
        .map(str::to_owned)
        .collect();
    params.push(format!("replicaSet={set}"));
    params.push("readPreference=secondary".into());
    let base = if base.ends_with('/') {
        base.to_owned()
    } else {
        format!("{base}/")
    };
    Some(format!("{base}?{}", params.join("&")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uri_asking_for_secondary_reads_still_crawls_exactly_on_the_primary() {
    // On a set of one member no secondary exists, so a read that followed the URI's preference
    // could not be served at all: the pass ends, exactly, only if every read that decides
    // (leases, the pass's end, coverage, deletions, lock state) goes to the primary.
    for transactions in ["off", "on"] {
        let db = test_db("secondary_reads").await;
        let Some(uri) = secondary_reads_uri(&db.uri).await else {
            eprintln!("skipped: the server is no replica set member");
            return;
        };
        let base = shop(2, 10).await;
        let setup = Setup {
            transactions,
            ..Setup::default()
        };
        let mut settings = settings(&db, &base, &setup, "a");
        settings.mongo.uri = uri;
        let store = Store::connect(&settings.mongo)
            .await
            .expect("connected by the set's name");
        once_on(settings, store).await;
        assert_eq!(
            live_records(&db).await,
            truth(&base).await,
            "transactions {transactions}"
        );
    }
}
