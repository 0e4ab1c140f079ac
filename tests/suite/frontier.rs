//! The frontier against the real server: idempotent enqueue, exclusive leases, expiry, fenced
//! completion, and passes that wait for every lease.

use crate::kit;
use crate::kit::frontier::OneUrl;

use seedlock::ids::PassNumber;
use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use chrono::Utc;
use kit::*;
use seedlock::error::Error;
use seedlock::ids::{BotId, InstanceId};
use seedlock::store::frontier::{
    candidate_filter, status_filter, unreached_listings_filters, url_id, CandidateQuery, PageKind,
    PassProgress, Priority, UrlStatus, FRONTIER_INDEX, LISTINGS_INDEX,
};
use seedlock::urls::NormalizedUrl;

fn bot() -> BotId {
    BotId::parse("shop").unwrap()
}

fn me(s: &str) -> InstanceId {
    InstanceId::parse(s).unwrap()
}

fn urls(n: usize) -> Vec<NormalizedUrl> {
    (0..n)
        .map(|i| NormalizedUrl::parse(&format!("http://shop.test/product/{i}")).unwrap())
        .collect()
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_within_a_pass_and_resets_in_the_next() {
    let db = test_db("fr_enqueue").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    let list = urls(5);
    assert_eq!(
        store
            .frontier()
            .enqueue(
                &bot(),
                PassNumber::new(1),
                PageKind::Detail,
                &list,
                Utc::now()
            )
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        store
            .frontier()
            .enqueue(
                &bot(),
                PassNumber::new(1),
                PageKind::Detail,
                &list,
                Utc::now()
            )
            .await
            .unwrap(),
        0,
        "rediscovery is a no-op"
    );
    let spelled_differently = [NormalizedUrl::parse("HTTP://SHOP.test:80/product/0#x").unwrap()];
    assert_eq!(
        store
            .frontier()
            .enqueue(
                &bot(),
                PassNumber::new(1),
                PageKind::Detail,
                &spelled_differently,
                Utc::now()
            )
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        db.db
            .collection::<bson::Document>("frontier")
            .count_documents(doc! {})
            .await
            .unwrap(),
        5
    );

    // Crawl one URL to done, rediscover it in the same pass: it stays done.
    let lease = store
        .frontier()
        .lease_url(&bot(), PassNumber::new(1), &me("w"), Utc::now(), LEASE)
        .await
        .unwrap()
        .unwrap();
    store
        .frontier()
        .complete_url(&lease, Utc::now())
        .await
        .unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            std::slice::from_ref(&lease.url),
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .frontier()
            .pass_progress(&bot(), PassNumber::new(1))
            .await
            .unwrap(),
        PassProgress {
            pending: 4,
            waiting: 0,
            leased: 0,
            done: 1,
            failed: 0
        }
    );

    // The next pass makes every URL pending again.
    assert_eq!(
        store
            .frontier()
            .enqueue(
                &bot(),
                PassNumber::new(2),
                PageKind::Detail,
                &list,
                Utc::now()
            )
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        store
            .frontier()
            .pass_progress(&bot(), PassNumber::new(2))
            .await
            .unwrap()
            .pending,
        5
    );
    let id = url_id(&bot(), &list[0]);
    assert_eq!(
        id,
        url_id(&bot(), &spelled_differently[0]),
        "the id derives from the normalized URL"
    );
    assert_ne!(
        id,
        url_id(&BotId::parse("other").unwrap(), &list[0]),
        "and from the bot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_workers_lease_each_url_exactly_once() {
    let db = test_db("fr_lease").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &urls(60),
            Utc::now(),
        )
        .await
        .unwrap();
    let mut workers = Vec::new();
    for w in 0..8 {
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while let Some(lease) = store
                .frontier()
                .lease_url(
                    &bot(),
                    PassNumber::new(1),
                    &me(&format!("w{w}")),
                    Utc::now(),
                    LEASE,
                )
                .await
                .unwrap()
            {
                store
                    .frontier()
                    .complete_url(&lease, Utc::now())
                    .await
                    .unwrap();
                mine.push(lease.url.to_string());
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let distinct: HashSet<_> = all.iter().collect();
    assert_eq!(
        (all.len(), distinct.len()),
        (60, 60),
        "every URL leased once, none twice"
    );
    let progress = store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(1))
        .await
        .unwrap();
    assert_eq!(
        progress,
        PassProgress {
            pending: 0,
            waiting: 0,
            leased: 0,
            done: 60,
            failed: 0
        }
    );
    assert!(progress.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_retried_and_the_stale_worker_is_fenced_out() {
    let db = test_db("fr_expiry").await;
    let store = db.store();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::List,
            &urls(1),
            Utc::now(),
        )
        .await
        .unwrap();
    let t0 = Utc::now();
    let crashed = store
        .frontier()
        .lease_url(
            &bot(),
            PassNumber::new(1),
            &me("crashed"),
            t0,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(crashed.kind, PageKind::List);
    assert!(
        store
            .frontier()
            .lease_url(&bot(), PassNumber::new(1), &me("other"), t0, LEASE)
            .await
            .unwrap()
            .is_none(),
        "a live lease is exclusive"
    );
    let progress = store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(1))
        .await
        .unwrap();
    assert!(
        !progress.is_finished(),
        "the pass waits for a URL leased by someone else: {progress:?}"
    );

    let later = t0 + chrono::Duration::seconds(6);
    let retry = store
        .frontier()
        .lease_url(&bot(), PassNumber::new(1), &me("other"), later, LEASE)
        .await
        .unwrap()
        .expect("the expired lease is retried");
    assert_eq!((retry.attempt, retry.url.clone()), (2, crashed.url.clone()));
    assert_ne!(retry.token, crashed.token);

    let stale = store.frontier().complete_url(&crashed, later).await;
    assert!(
        matches!(stale, Err(Error::UrlLeaseLost { .. })),
        "{stale:?}"
    );
    let stale = store.frontier().fail_url(&crashed, later, "x").await;
    assert!(
        matches!(stale, Err(Error::UrlLeaseLost { .. })),
        "{stale:?}"
    );
    store.frontier().complete_url(&retry, later).await.unwrap();
    assert!(
        matches!(
            store.frontier().complete_url(&retry, later).await,
            Err(Error::UrlLeaseLost { .. })
        ),
        "done once"
    );
    assert!(store
        .frontier()
        .pass_progress(&bot(), PassNumber::new(1))
        .await
        .unwrap()
        .is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_urls_record_their_reason_and_end_the_pass() {
    let db = test_db("fr_fail").await;
    let store = db.store();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(3),
            PageKind::Detail,
            &urls(1),
            Utc::now(),
        )
        .await
        .unwrap();
    let lease = store
        .frontier()
        .lease_url(&bot(), PassNumber::new(3), &me("w"), Utc::now(), LEASE)
        .await
        .unwrap()
        .unwrap();
    store
        .frontier()
        .fail_url(&lease, Utc::now(), "no natural key (.sku) on the page")
        .await
        .unwrap();
    let doc = db
        .db
        .collection::<bson::Document>("frontier")
        .find_one(doc! {"_id": &lease.id})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_str("status").unwrap(), "failed");
    assert_eq!(
        doc.get_str("lastError").unwrap(),
        "no natural key (.sku) on the page"
    );
    assert_eq!(
        store
            .frontier()
            .pass_progress(&bot(), PassNumber::new(3))
            .await
            .unwrap(),
        PassProgress {
            pending: 0,
            waiting: 0,
            leased: 0,
            done: 0,
            failed: 1
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_query_uses_its_index() {
    let db = test_db("fr_explain").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &urls(50),
            Utc::now(),
        )
        .await
        .unwrap();
    // The lease queries exactly as the leaser sends them: a host's priorities above the lowest
    // (a range), a level in some slots, a sparse level whole; and the reads of a pass's leased
    // and waiting entries.
    let host = "shop.test:80".to_owned();
    let query = |priority, slots| CandidateQuery {
        host: host.clone(),
        priority,
        slots,
        limit: 50,
    };
    let filters = vec![
        candidate_filter(&bot(), PassNumber::new(1), &query(Priority::Above(0), None)),
        candidate_filter(
            &bot(),
            PassNumber::new(1),
            &query(Priority::Exactly(0), Some(vec![7, 8, 9])),
        ),
        candidate_filter(
            &bot(),
            PassNumber::new(1),
            &query(Priority::Exactly(0), None),
        ),
        candidate_filter(
            &bot(),
            PassNumber::new(1),
            &query(Priority::Exactly(2), Some(vec![1023, 0])),
        ),
        status_filter(&bot(), PassNumber::new(1), UrlStatus::Leased),
        status_filter(&bot(), PassNumber::new(1), UrlStatus::Waiting),
    ];
    assert_eq!(filters.len(), 6);
    for filter in filters {
        let explain = db
            .db
            .run_command(doc! {
                "explain": { "find": "frontier", "filter": filter.clone() },
                "verbosity": "queryPlanner",
            })
            .await
            .expect("explain");
        let plan = explain
            .get_document("queryPlanner")
            .and_then(|q| q.get_document("winningPlan"))
            .expect("a winning plan");
        let text = plan.to_string();
        eprintln!("winning plan for {filter}: {text}");
        assert!(
            text.contains(FRONTIER_INDEX) && !text.contains("COLLSCAN"),
            "the lease query {filter} should use an index: {text}"
        );
        if filter.contains_key("priority") {
            assert!(text.contains(FRONTIER_INDEX), "{filter}: {text}");
        }
        // The status is an index bound, not a residual filter: a lease never scans the pass's
        // done entries.
        let status = filter.get_str("status").unwrap();
        let bounds = plan
            .get_document("inputStage")
            .and_then(|s| s.get_document("indexBounds"))
            .expect("index bounds");
        assert_eq!(
            bounds.get_array("status").unwrap()[0].as_str().unwrap(),
            format!("[\"{status}\", \"{status}\"]"),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listing_pages_an_earlier_pass_read_come_from_their_own_index() {
    let db = test_db("fr_listings").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    let at = |path: &str| NormalizedUrl::parse(&format!("http://shop.test{path}")).unwrap();
    let (seed, lists) = (at("/"), [at("/list/0"), at("/list/1"), at("/list/2")]);
    let now = Utc::now();
    let other = BotId::parse("other").unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &urls(200),
            now,
        )
        .await
        .unwrap();
    store
        .frontier()
        .enqueue(&bot(), PassNumber::new(1), PageKind::List, &lists, now)
        .await
        .unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Seed,
            std::slice::from_ref(&seed),
            now,
        )
        .await
        .unwrap();
    store
        .frontier()
        .enqueue(&other, PassNumber::new(1), PageKind::List, &lists, now)
        .await
        .unwrap();
    db.db
        .collection::<bson::Document>("frontier")
        .update_many(
            doc! {},
            doc! { "$set": { "status": "done", "doneAt": bson::DateTime::from_chrono(now) } },
        )
        .await
        .unwrap();
    // Pass 2 has already reached list/2; another bot's pages and the detail pages are not
    // listing pages of this bot.
    store
        .frontier()
        .enqueue(&bot(), PassNumber::new(2), PageKind::List, &lists[2..], now)
        .await
        .unwrap();
    let since = now - chrono::Duration::minutes(5);
    let mut unreached: Vec<String> = store
        .passes()
        .unreached_list_urls(&bot(), PassNumber::new(2), since)
        .await
        .unwrap()
        .iter()
        .map(|u| u.as_str().to_owned())
        .collect();
    unreached.sort();
    let mut expected = vec![
        seed.as_str().to_owned(),
        lists[0].as_str().to_owned(),
        lists[1].as_str().to_owned(),
    ];
    expected.sort();
    assert_eq!(unreached, expected);
    assert_eq!(
        store
            .passes()
            .unreached_lists(&bot(), PassNumber::new(2), since)
            .await
            .unwrap(),
        3
    );
    // Read before `since`: not the last complete pass's.
    let later = now + chrono::Duration::minutes(5);
    assert!(store
        .passes()
        .unreached_list_urls(&bot(), PassNumber::new(2), later)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store
            .passes()
            .unreached_lists(&bot(), PassNumber::new(2), later)
            .await
            .unwrap(),
        0
    );

    // The queries as the store sends them (one per listing kind, with no hint) read the listing
    // index's entries of the bot's earlier passes (the seed and two listing pages), not the 200
    // detail pages beside them (the main index would examine 203 keys).
    let (mut returned, mut keys) = (0, 0);
    for filter in unreached_listings_filters(&bot(), PassNumber::new(2)) {
        let explain = db
            .db
            .run_command(doc! {
                "explain": { "find": "frontier", "filter": filter },
                "verbosity": "executionStats",
            })
            .await
            .expect("explain");
        let text = explain.to_string();
        eprintln!("explain: {text}");
        let plan = explain
            .get_document("queryPlanner")
            .and_then(|q| q.get_document("winningPlan"))
            .expect("a winning plan")
            .to_string();
        assert!(
            plan.contains(LISTINGS_INDEX) && !plan.contains("COLLSCAN"),
            "{plan}"
        );
        let stats = explain
            .get_document("executionStats")
            .expect("execution stats");
        let number = |key: &str| match stats.get(key) {
            Some(bson::Bson::Int32(n)) => i64::from(*n),
            Some(bson::Bson::Int64(n)) => *n,
            other => panic!("{key}: {other:?} in {stats}"),
        };
        returned += number("nReturned");
        keys += number("totalKeysExamined");
    }
    assert_eq!(returned, 3);
    // MongoDB may also count the one key past each range that ends its scan.
    assert!((3..=5).contains(&keys), "{keys} keys examined");
}

/// A store on a client of its own (as another instance has).
async fn other_store(db: &TestDb) -> seedlock::store::Store {
    let client = mongodb::Client::with_uri_str(&db.uri).await.unwrap();
    seedlock::store::Store::new(client.database(&db.name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leasers_racing_for_one_batch_never_get_the_same_url() {
    use seedlock::store::frontier::Takes;
    let db = test_db("fr_batch_race").await;
    let (a, b) = (db.store(), other_store(&db).await);
    a.frontier().ensure_indexes().await.unwrap();
    a.frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &urls(300),
            Utc::now(),
        )
        .await
        .unwrap();
    let query = CandidateQuery {
        host: "shop.test:80".into(),
        priority: Priority::Exactly(0),
        slots: None,
        limit: 1000,
    };
    let mut leased: Vec<(String, String)> = Vec::new();
    // Both find the same pending URLs, and both try to take the same batch of them at once.
    for round in 0..10 {
        let found = a
            .frontier()
            .lease_candidates(&bot(), PassNumber::new(1), std::slice::from_ref(&query))
            .await
            .unwrap()
            .remove(0);
        let batch: Vec<_> = found.into_iter().take(30).collect();
        assert_eq!(batch.len(), 30, "round {round}: candidates left");
        let takes = Takes {
            pending: &batch,
            ..Takes::default()
        };
        let now = Utc::now();
        let (bot, ma, mb) = (bot(), me("a"), me("b"));
        let (got_a, got_b) = tokio::join!(
            a.frontier()
                .take_leases(&bot, PassNumber::new(1), &ma, now, LEASE, takes.clone()),
            b.frontier()
                .take_leases(&bot, PassNumber::new(1), &mb, now, LEASE, takes.clone()),
        );
        let (got_a, got_b) = (got_a.unwrap().leases, got_b.unwrap().leases);
        assert_eq!(
            got_a.len() + got_b.len(),
            30,
            "round {round}: every URL of the batch went to exactly one of them"
        );
        for lease in got_a.iter().chain(&got_b) {
            leased.push((lease.id.clone(), lease.token.clone()));
            assert_eq!(lease.attempt, 1);
        }
    }
    let distinct: HashSet<&String> = leased.iter().map(|(id, _)| id).collect();
    assert_eq!(
        (leased.len(), distinct.len()),
        (300, 300),
        "no URL leased twice"
    );
    // Each lease carries the token the frontier holds for it: the fences match.
    for (id, token) in &leased {
        let doc = db
            .db
            .collection::<bson::Document>("frontier")
            .find_one(doc! { "_id": id })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(doc.get_str("leaseToken").unwrap(), token);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_enqueued_leased_go_to_the_enqueuer_alone() {
    use seedlock::store::frontier::{LeaseTo, NewUrl};
    let db = test_db("fr_lease_on_enqueue").await;
    let (a, b) = (db.store(), other_store(&db).await);
    a.frontier().ensure_indexes().await.unwrap();
    let links: Vec<NewUrl> = urls(10)
        .into_iter()
        .map(|url| NewUrl {
            url,
            kind: PageKind::Detail,
            fingerprint: None,
            priority: 0,
            depth: 1,
        })
        .collect();
    let no_known = std::collections::HashMap::new();
    let lease_to = |who: &'static str, first| {
        Some(LeaseTo {
            me: Box::leak(Box::new(me(who))),
            lease_for: LEASE,
            first,
        })
    };
    let from_a = a
        .frontier()
        .enqueue_links(
            &bot(),
            PassNumber::new(1),
            &links,
            &no_known,
            lease_to("a", 3),
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!(from_a.added, 10);
    assert_eq!(from_a.leased.len(), 3, "the first three, leased to a");
    // b finds the same page a moment later: every link is in the pass already, none is its.
    let from_b = b
        .frontier()
        .enqueue_links(
            &bot(),
            PassNumber::new(1),
            &links,
            &no_known,
            lease_to("b", 10),
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!((from_b.added, from_b.leased.len()), (0, 0));
    assert_eq!(
        a.frontier()
            .pass_progress(&bot(), PassNumber::new(1))
            .await
            .unwrap(),
        PassProgress {
            pending: 7,
            waiting: 0,
            leased: 3,
            done: 0,
            failed: 0
        }
    );
    // a's leases are fenced like any other: its marks land.
    for lease in &from_a.leased {
        assert_eq!(lease.attempt, 1);
        a.frontier().complete_url(lease, Utc::now()).await.unwrap();
    }
    // In the next pass the same links come back from the earlier one, leased to whoever
    // enqueues them first (an update, not an insert).
    let known = a
        .frontier()
        .known_pages(&bot(), &links.iter().map(|l| &l.url).collect::<Vec<_>>())
        .await
        .unwrap();
    let shop = bot();
    let (again_a, again_b) = tokio::join!(
        a.frontier().enqueue_links(
            &shop,
            PassNumber::new(2),
            &links,
            &known,
            lease_to("a", 5),
            Utc::now()
        ),
        b.frontier().enqueue_links(
            &shop,
            PassNumber::new(2),
            &links,
            &known,
            lease_to("b", 5),
            Utc::now()
        ),
    );
    let (again_a, again_b) = (again_a.unwrap(), again_b.unwrap());
    let mut ids: Vec<&str> = again_a
        .leased
        .iter()
        .chain(&again_b.leased)
        .map(|l| l.id.as_str())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        again_a.leased.len() + again_b.leased.len(),
        "no link leased to both"
    );
    assert_eq!(again_a.added + again_b.added, 10);
    let progress = a
        .frontier()
        .pass_progress(&bot(), PassNumber::new(2))
        .await
        .unwrap();
    assert_eq!(progress.leased as usize, ids.len());
    assert_eq!(progress.pending as usize, 10 - ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_marks_lands_for_every_lease_still_held_and_not_for_a_lost_one() {
    use seedlock::store::frontier::{Mark, Takes};
    let db = test_db("fr_settle_batch").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &urls(5),
            Utc::now(),
        )
        .await
        .unwrap();
    let found = store
        .frontier()
        .lease_candidates(
            &bot(),
            PassNumber::new(1),
            &[CandidateQuery {
                host: "shop.test:80".into(),
                priority: Priority::Exactly(0),
                slots: None,
                limit: 10,
            }],
        )
        .await
        .unwrap()
        .remove(0);
    let t0 = Utc::now();
    let leases = store
        .frontier()
        .take_leases(
            &bot(),
            PassNumber::new(1),
            &me("w"),
            t0,
            Duration::from_secs(5),
            Takes {
                pending: &found,
                ..Takes::default()
            },
        )
        .await
        .unwrap()
        .leases;
    assert_eq!(leases.len(), 5);
    // One lease runs out and another worker takes the URL.
    let later = t0 + chrono::Duration::seconds(6);
    let lost = &leases[2];
    let other = store
        .frontier()
        .take_leases(
            &bot(),
            PassNumber::new(1),
            &me("other"),
            later,
            LEASE,
            Takes {
                expired: std::slice::from_ref(&lost.id),
                ..Takes::default()
            },
        )
        .await
        .unwrap()
        .leases
        .pop()
        .expect("the expired lease is leased again");
    assert_eq!(other.id, lost.id);
    let marks: Vec<_> = leases
        .iter()
        .map(|l| {
            (
                l,
                Mark::Done {
                    validators: Default::default(),
                    record_id: Some(format!("record-{}", l.id)),
                    manifest: None,
                },
            )
        })
        .collect();
    let applied = store.frontier().settle_urls(&marks, later).await.unwrap();
    assert_eq!(applied, vec![true, true, false, true, true]);
    let frontier = db.db.collection::<bson::Document>("frontier");
    for lease in &leases {
        let doc = frontier
            .find_one(doc! { "_id": &lease.id })
            .await
            .unwrap()
            .unwrap();
        if lease.id == lost.id {
            assert_eq!(doc.get_str("status").unwrap(), "leased");
            assert_eq!(doc.get_str("leaseToken").unwrap(), other.token);
            assert!(
                doc.get_str("recordId").is_err(),
                "nothing of the stale mark"
            );
        } else {
            assert_eq!(doc.get_str("status").unwrap(), "done");
            assert_eq!(
                doc.get_str("recordId").unwrap(),
                format!("record-{}", lease.id),
                "each URL got its own value out of the batch"
            );
        }
    }
    // Marking again changes nothing and says so.
    assert_eq!(
        store.frontier().settle_urls(&marks, later).await.unwrap(),
        vec![false; 5]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_reads_come_back_in_one_round_trip() {
    // The driver's first batch is 101 documents and each further one a `getMore`: a lease round
    // asking for 200 URLs, or a listing page's 300 known links, must cost one round trip each.
    let db = test_db("fr_batches").await;
    // Connected as the daemon connects: counting every round trip of its client.
    let store = seedlock::store::Store::connect(&seedlock::config::MongoSettings {
        uri: db.uri.clone(),
        database: db.name.clone(),
        connect_timeout: Duration::from_secs(10),
        server_selection_timeout: Duration::from_secs(30),
        op_timeout: Duration::from_secs(10),
        max_pool_size: seedlock::config::DEFAULT_MAX_POOL_SIZE,
    })
    .await
    .unwrap();
    store.frontier().ensure_indexes().await.unwrap();
    let all = urls(300);
    store
        .frontier()
        .enqueue(
            &bot(),
            PassNumber::new(1),
            PageKind::Detail,
            &all,
            Utc::now(),
        )
        .await
        .unwrap();
    let before = store
        .round_trips()
        .expect("a connected store counts its round trips");
    let query = CandidateQuery {
        host: "shop.test:80".to_owned(),
        priority: Priority::Exactly(PageKind::Detail.default_priority()),
        slots: None,
        limit: 200,
    };
    let found = store
        .frontier()
        .lease_candidates(&bot(), PassNumber::new(1), std::slice::from_ref(&query))
        .await
        .unwrap();
    assert_eq!(found[0].len(), 200);
    let ids: Vec<String> = all.iter().map(|u| url_id(&bot(), u)).collect();
    assert_eq!(
        store
            .frontier()
            .known_by_id(&bot(), &ids)
            .await
            .unwrap()
            .len(),
        300
    );
    let sent = store.round_trips().unwrap() - before;
    assert_eq!(
        sent,
        2,
        "one find each, no getMore: {:?}",
        store.command_counts()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_pass_numbers_above_every_pass_of_the_bot_in_the_frontier() {
    let db = test_db("fr_pass_numbers").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    let now = Utc::now();
    // URLs in pass 5, which the bot document (restored from a backup, say) no longer shows; and
    // another bot's in pass 50, which numbers nothing here.
    store
        .frontier()
        .enqueue(&bot(), PassNumber::new(5), PageKind::Detail, &urls(3), now)
        .await
        .unwrap();
    let other = BotId::parse("other").unwrap();
    store
        .frontier()
        .enqueue(&other, PassNumber::new(50), PageKind::Detail, &urls(3), now)
        .await
        .unwrap();
    let seeds = [NormalizedUrl::parse("http://shop.test/").unwrap()];
    assert_eq!(
        store
            .passes()
            .prepare(&bot(), PassNumber::new(2), &seeds, now)
            .await
            .unwrap(),
        PassNumber::new(6),
        "above the frontier's pass 5, not the document's 2"
    );
    assert_eq!(
        store
            .passes()
            .prepare(&bot(), PassNumber::new(0), &seeds, now)
            .await
            .unwrap(),
        PassNumber::new(7),
        "a document without a pass: above the seed just prepared in 6"
    );
    assert_eq!(
        store
            .passes()
            .prepare(&bot(), PassNumber::new(9), &seeds, now)
            .await
            .unwrap(),
        PassNumber::new(10),
        "nothing above the document's pass: the next one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_pass_reports_the_counts_its_end_recorded_without_counting_the_frontier() {
    let db = test_db("fr_recorded").await;
    let store = db.store();
    let pass = PassNumber::new(3);
    // Three entries of pass 3 on the frontier, none done: what a count of the frontier says.
    store
        .frontier()
        .enqueue(&bot(), pass, PageKind::Detail, &urls(3), Utc::now())
        .await
        .unwrap();
    db.bots()
        .insert_one(doc! {
            "_id": "shop",
            "crawlLastPass": { "pass": 3_i64, "pages": 12_i64, "done": 10_i64, "failed": 2_i64 },
        })
        .await
        .unwrap();
    let recorded = seedlock::ops::progress::failures(&store, &bot(), pass)
        .await
        .unwrap();
    assert_eq!((recorded.pages, recorded.failed), (12, 2));
    // Another pass than the one recorded: counted on the frontier.
    let counted = seedlock::ops::progress::failures(&store, &bot(), PassNumber::new(2))
        .await
        .unwrap();
    assert_eq!((counted.pages, counted.failed), (0, 0));
    db.bots()
        .update_one(
            doc! { "_id": "shop" },
            doc! { "$set": { "crawlLastPass.pass": 4_i64 } },
        )
        .await
        .unwrap();
    let counted = seedlock::ops::progress::failures(&store, &bot(), pass)
        .await
        .unwrap();
    assert_eq!((counted.pages, counted.failed), (3, 0));
}

/// The end of a pass reads its listing entries one kind at a time (one reply held at a time),
/// but weighs the kinds side by side first, and a kind with no entry is not read again: with
/// listing pages and no seed entry in the pass, two weighings and one read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_kind_without_entries_is_weighed_and_not_read() {
    let db = test_db("fr_listing_kinds").await;
    let store = db.store();
    store.frontier().ensure_indexes().await.unwrap();
    let pass = PassNumber::new(1);
    store
        .frontier()
        .enqueue(&bot(), pass, PageKind::List, &urls(3), Utc::now())
        .await
        .unwrap();
    let counted = |store: &seedlock::store::Store| {
        store
            .command_counts()
            .get("read this pass's listings")
            .copied()
            .unwrap_or(0)
    };
    let before = counted(&store);
    store
        .deletions()
        .evaluate(&bot(), pass, false, false, None, Utc::now())
        .await
        .unwrap();
    assert_eq!(
        counted(&store) - before,
        3,
        "both kinds weighed, the listing pages read: {:?}",
        store.command_counts()
    );
}
