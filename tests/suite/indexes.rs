//! Upgrading in place: a database whose indexes an earlier version built — a definition that has
//! changed under the same name, retired ones — gets this version's indexes at start-up (MongoDB
//! refuses a changed definition under an existing name), and a second start changes nothing;
//! through a rolling upgrade, an index a live instance of the other version uses is kept until
//! that instance stops.

use crate::kit;

use bson::{doc, Document};
use futures_util::TryStreamExt;
use kit::test_db;
use mongodb::options::IndexOptions;
use mongodb::IndexModel;
use std::time::Duration;

async fn indexes(db: &kit::TestDb, collection: &str) -> Vec<IndexModel> {
    db.db
        .collection::<Document>(collection)
        .list_indexes()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

fn named<'a>(all: &'a [IndexModel], name: &str) -> Option<&'a IndexModel> {
    all.iter()
        .find(|i| i.options.as_ref().and_then(|o| o.name.as_deref()) == Some(name))
}

async fn build(db: &kit::TestDb, collection: &str, name: &str, keys: Document) {
    db.db
        .collection::<Document>(collection)
        .create_index(
            IndexModel::builder()
                .keys(keys)
                .options(IndexOptions::builder().name(name.to_owned()).build())
                .build(),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yesterdays_indexes_are_rebuilt_as_defined_now_and_retired_ones_dropped() {
    let db = test_db("indexes_upgrade").await;
    // Yesterday: the listing pages' index on other keys and without its partial filter, a retired
    // frontier index, a records index under today's name with other keys, the retired records
    // indexes, and the hosts TTL index without its expiry; plus an operator's own index, which
    // stays.
    build(
        &db,
        "frontier",
        "bot_pass_listings",
        doc! { "botId": 1, "pass": 1 },
    )
    .await;
    build(
        &db,
        "frontier",
        "bot_pass_status_slot",
        doc! { "botId": 1, "pass": 1, "status": 1, "slot": 1 },
    )
    .await;
    build(&db, "frontier", "operators_own", doc! { "url": 1 }).await;
    build(
        &db,
        "records",
        "bot_last_changed",
        doc! { "botId": 1, "lastSeen": 1 },
    )
    .await;
    build(
        &db,
        "records",
        "bot_last_seen_pass",
        doc! { "botId": 1, "lastSeenPass": 1 },
    )
    .await;
    build(
        &db,
        "records",
        "bot_list_key",
        doc! { "botId": 1, "listKey": 1 },
    )
    .await;
    build(&db, "hosts", "updated_at_ttl", doc! { "updatedAt": 1 }).await;
    let store = db.store();
    for _ in 0..2 {
        store.frontier().ensure_indexes().await.unwrap();
        store.records().ensure_indexes().await.unwrap();
        store.hosts().ensure_indexes().await.unwrap();
        store.bots().ensure_indexes().await.unwrap();
    }
    let frontier = indexes(&db, "frontier").await;
    let listings = named(&frontier, "bot_pass_listings").expect("the listing pages' index");
    assert_eq!(
        listings.keys,
        doc! { "kind": 1, "botId": 1, "pass": 1 },
        "rebuilt with its keys"
    );
    assert_eq!(
        listings
            .options
            .as_ref()
            .and_then(|o| o.partial_filter_expression.clone()),
        Some(doc! { "kind": { "$gt": "detail" } }),
        "rebuilt with its partial filter"
    );
    assert!(named(&frontier, "bot_pass_status_host_priority_slot").is_some());
    assert!(
        named(&frontier, "bot_pass_status_slot").is_none(),
        "retired: dropped"
    );
    assert!(
        named(&frontier, "operators_own").is_some(),
        "an operator's index stays"
    );
    let records = indexes(&db, "records").await;
    assert_eq!(
        named(&records, "bot_last_changed").map(|i| i.keys.clone()),
        Some(doc! { "botId": 1, "lastChanged": 1 })
    );
    for retired in seedlock::store::records::RETIRED_RECORD_INDEXES {
        assert!(named(&records, retired).is_none(), "{retired} dropped");
    }
    let hosts = indexes(&db, "hosts").await;
    assert_eq!(
        named(&hosts, "updated_at_ttl")
            .and_then(|i| i.options.as_ref())
            .and_then(|o| o.expire_after),
        Some(seedlock::store::hosts::HOSTS_EXPIRE_AFTER),
        "the TTL index expires rows"
    );
    // Over both rounds: the three changed definitions dropped (and built again) once, the three
    // retired indexes dropped once — the second round found every index as defined.
    let counts = store.command_counts();
    for op in ["drop a changed index", "drop a retired index"] {
        assert_eq!(counts.get(op).copied(), Some(3), "{op}: {counts:?}");
    }
    let builds_after_first = counts.get("create indexes").copied().unwrap_or(0);
    store.frontier().ensure_indexes().await.unwrap();
    store.records().ensure_indexes().await.unwrap();
    store.hosts().ensure_indexes().await.unwrap();
    store.bots().ensure_indexes().await.unwrap();
    assert_eq!(
        store
            .command_counts()
            .get("create indexes")
            .copied()
            .unwrap_or(0),
        builds_after_first,
        "nothing built again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_index_with_seedlocks_definition_under_another_name_is_adopted_and_kept() {
    let db = test_db("indexes_adopt").await;
    // An operator built the frontier's main index under a name of their own.
    build(
        &db,
        "frontier",
        "ops_frontier_main",
        doc! { "botId": 1, "pass": 1, "status": 1, "host": 1, "priority": 1, "slot": 1 },
    )
    .await;
    let store = db.store();
    for _ in 0..2 {
        store
            .frontier()
            .ensure_indexes()
            .await
            .expect("start-up goes on, on the operator's index");
    }
    let frontier = indexes(&db, "frontier").await;
    assert!(
        named(&frontier, "ops_frontier_main").is_some(),
        "the operator's index stays theirs"
    );
    assert!(
        named(&frontier, "bot_pass_status_host_priority_slot").is_none(),
        "no second index of the same definition"
    );
    assert!(
        named(&frontier, "bot_pass_listings").is_some(),
        "the other indexes are built"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_starting_at_once_on_an_empty_database_build_every_index_once() {
    let db = test_db("indexes_together").await;
    let stores = [db.store(), db.store(), db.store()];
    let starts = stores.iter().map(|store| async move {
        store.frontier().ensure_indexes().await?;
        store.records().ensure_indexes().await?;
        store.hosts().ensure_indexes().await?;
        store.bots().ensure_indexes().await
    });
    for result in futures_util::future::join_all(starts).await {
        result.expect("every instance starts");
    }
    let frontier = indexes(&db, "frontier").await;
    for name in ["bot_pass_status_host_priority_slot", "bot_pass_listings"] {
        assert_eq!(
            frontier
                .iter()
                .filter(|i| i.options.as_ref().and_then(|o| o.name.as_deref()) == Some(name))
                .count(),
            1,
            "{name}"
        );
    }
    assert!(named(&indexes(&db, "hosts").await, "updated_at_ttl").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_unique_index_on_the_same_keys_is_not_adopted() {
    // A unique index refuses what seedlock's accepts: seedlock builds its own beside it.
    let db = test_db("indexes_unique").await;
    db.db
        .collection::<Document>("hosts")
        .create_index(
            IndexModel::builder()
                .keys(doc! { "updatedAt": 1 })
                .options(
                    IndexOptions::builder()
                        .name("ops_unique".to_owned())
                        .unique(true)
                        .expire_after(seedlock::store::hosts::HOSTS_EXPIRE_AFTER)
                        .build(),
                )
                .build(),
        )
        .await
        .unwrap();
    db.store().hosts().ensure_indexes().await.unwrap();
    let hosts = indexes(&db, "hosts").await;
    assert!(named(&hosts, "ops_unique").is_some());
    assert!(
        named(&hosts, "updated_at_ttl").is_some(),
        "seedlock's own, beside it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_a_live_instance_of_another_version_uses_is_kept_until_that_instance_stops() {
    use kit::crawl::*;
    use seedlock::daemon::{run_with_store, Mode};
    use tokio_util::sync::CancellationToken;

    let db = test_db("indexes_rolling").await;
    let base = shop(1, 3).await;
    // Yesterday's version built a records index under today's name with other keys, and one
    // this version retires; an instance of it still runs and recorded both. A stopped instance
    // (its registration expired) recorded another retired index, which keeps nothing.
    build(
        &db,
        "records",
        "bot_last_changed",
        doc! { "botId": 1, "lastSeen": 1 },
    )
    .await;
    build(
        &db,
        "records",
        "bot_list_key",
        doc! { "botId": 1, "listKey": 1 },
    )
    .await;
    build(
        &db,
        "records",
        "bot_last_seen_pass",
        doc! { "botId": 1, "lastSeenPass": 1 },
    )
    .await;
    let instances = db.db.collection::<Document>("instances");
    let now = bson::DateTime::now();
    let hour = bson::DateTime::from_millis(now.timestamp_millis() + 3_600_000);
    let hour_ago = bson::DateTime::from_millis(now.timestamp_millis() - 3_600_000);
    let older = |id: &str, expires: bson::DateTime, indexes: Vec<Document>| {
        doc! {
            "_id": id, "host": "elsewhere", "pid": 1_i64, "token": "t", "version": "0.0.1",
            "heartbeatAt": now, "expiresAt": expires, "indexes": indexes,
        }
    };
    instances
        .insert_many([
            older(
                "older",
                hour,
                vec![
                    doc! { "collection": "records", "name": "bot_last_changed", "key": { "botId": 1, "lastSeen": 1 } },
                    doc! { "collection": "records", "name": "bot_list_key", "key": { "botId": 1, "listKey": 1 } },
                ],
            ),
            older(
                "stopped",
                hour_ago,
                vec![
                    doc! { "collection": "records", "name": "bot_last_seen_pass", "key": { "botId": 1, "lastSeenPass": 1 } },
                ],
            ),
        ])
        .await
        .unwrap();

    let mut settings = settings(&db, &base, &Setup::default(), "newer");
    settings.lock.heartbeat = Duration::from_millis(200);
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(run_with_store(
        settings,
        db.store(),
        Mode::Daemon,
        stop.clone(),
    ));
    // Registered: its start-up has looked at every index, and its registration records its own.
    let recorded = |d: &Document| {
        d.get_array("indexes")
            .map(|a| {
                a.iter()
                    .filter_map(|i| i.as_document())
                    .map(|i| {
                        format!(
                            "{}.{}",
                            i.get_str("collection").unwrap_or("?"),
                            i.get_str("name").unwrap_or("?")
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    kit::eventually(
        "the newer instance registers",
        Duration::from_secs(30),
        || async {
            instances
                .count_documents(doc! { "_id": "newer" })
                .await
                .unwrap()
                == 1
        },
    )
    .await;
    let mine = instances
        .find_one(doc! { "_id": "newer" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(mine.get_str("version"), Ok(env!("CARGO_PKG_VERSION")));
    let names = recorded(&mine);
    for index in [
        "records.bot_last_changed",
        "frontier.bot_pass_status_host_priority_slot",
        "bots.editing_ready",
        "hosts.updated_at_ttl",
    ] {
        assert!(names.iter().any(|n| n == index), "{index} in {names:?}");
    }
    let records = indexes(&db, "records").await;
    assert_eq!(
        named(&records, "bot_last_changed").map(|i| i.keys.clone()),
        Some(doc! { "botId": 1, "lastSeen": 1 }),
        "the older instance's definition is kept while it runs"
    );
    assert!(
        named(&records, "bot_list_key").is_some(),
        "kept while it runs"
    );
    assert!(
        named(&records, "bot_last_seen_pass").is_none(),
        "a stopped instance keeps nothing"
    );

    // The older instance stops: its registration expires.
    instances
        .update_one(
            doc! { "_id": "older" },
            doc! { "$set": { "expiresAt": hour_ago } },
        )
        .await
        .unwrap();
    kit::eventually(
        "the newer instance's heartbeat makes the indexes its own",
        Duration::from_secs(30),
        || async {
            let records = indexes(&db, "records").await;
            named(&records, "bot_list_key").is_none()
                && named(&records, "bot_last_changed").map(|i| i.keys.clone())
                    == Some(doc! { "botId": 1, "lastChanged": 1 })
        },
    )
    .await;
    stop.cancel();
    daemon.await.unwrap().expect("the daemon stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_databases_indexes_are_built_with_one_create_indexes_per_collection() {
    // Each index alone would be a round trip apiece (two on a standalone, which refuses the
    // commit quorum): start-up across a network pays them one after another.
    let db = test_db("indexes_batched").await;
    let (store, sent) = kit::crawl::monitored_store(&db.uri, &db.name).await;
    store.frontier().ensure_indexes().await.unwrap();
    store.records().ensure_indexes().await.unwrap();
    let builds = |collection: &str| {
        sent.lock()
            .unwrap()
            .iter()
            .filter(|(name, body)| {
                name == "createIndexes" && body.get_str("createIndexes") == Ok(collection)
            })
            .count()
    };
    let frontier = indexes(&db, "frontier").await;
    assert!(
        frontier.len() >= 3,
        "the frontier has several indexes of its own ({})",
        frontier.len()
    );
    assert!(
        builds("frontier") <= 2,
        "one build, and one more if the server refused the commit quorum: {}",
        builds("frontier")
    );
    assert_eq!(
        builds("records"),
        1,
        "the commit quorum a standalone refused is not asked again"
    );
    for name in ["bot_pass_status_host_priority_slot", "bot_pass_listings"] {
        assert!(named(&frontier, name).is_some(), "{name}");
    }
}
