//! What pages come to: throttled and failing fetches retried from the frontier, permanent errors
//! and hostile pages recorded failed with their reason, pages without a natural key, non-HTML,
//! compressed pages decoded.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::collections::HashMap;
use std::time::Duration;

use bson::doc;
use kit::crawl::*;
use kit::test_db;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_and_failing_fetches_are_retried_from_the_frontier_and_nothing_is_lost() {
    let db = test_db("crawl_retry").await;
    let base = shop(3, 10).await;
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": "/product/", "status": 503, "every": 3},
            {"path": "/list/", "status": 429, "retry_after": "1", "every": 2},
        ]),
    )
    .await;
    // A third of the product fetches fail: this test is about retrying, not the retry budget.
    let setup = Setup {
        crawl: "attempts = 5\nretry_budget = 1.0",
        ..Setup::default()
    };
    let started = std::time::Instant::now();
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
    let requests = Requests::take(&base).await;
    assert!(
        requests.under("/product/") > 30,
        "some fetches were retried"
    );
    // list/1 ok, list/2 429, list/2 ok, list/3 429, list/3 ok: each retry waited Retry-After.
    assert_eq!(requests.under("/list/"), 5, "{:?}", requests.0);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "Retry-After: 1 was honoured twice"
    );
    assert!(frontier(&db, doc! { "status": "failed" }).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_pages_fail_with_their_reason_and_the_rest_is_stored() {
    let db = test_db("crawl_hostile").await;
    let base = shop(2, 10).await;
    let products: Vec<String> = truth(&base).await.into_keys().collect();
    let (huge, looping) = (&products[0], &products[1]);
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{huge}"), "huge_body_bytes": 200_000},
            {"path": format!("/product/{looping}"), "redirect_loop": true},
        ]),
    )
    .await;
    let setup = Setup {
        crawl: "max_page_bytes = 100000",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    let reasons: HashMap<String, String> = failed
        .iter()
        .map(|f| {
            (
                f.get_str("url")
                    .unwrap()
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .to_owned(),
                f.get_str("lastError").unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[huge].contains("larger than 100000 bytes"),
        "{reasons:?}"
    );
    assert!(reasons[looping].contains("redirects"), "{reasons:?}");
    let stored = live_records(&db).await;
    assert_eq!(stored.len(), 18);
    let truth = truth(&base).await;
    for (key, value) in &stored {
        assert_eq!(Some(value), truth.get(key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detail_page_without_its_natural_key_is_failed_and_writes_no_record() {
    let db = test_db("crawl_no_key").await;
    let base = shop(1, 5).await;
    let setup = Setup {
        natural_key: ".no-such-key",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    assert!(records(&db).await.is_empty());
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(failed.len(), 5);
    for f in failed {
        assert_eq!(
            f.get_str("lastError").unwrap(),
            "no natural key (.no-such-key) on the page"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_html_seeds_are_skipped() {
    let db = test_db("crawl_non_html").await;
    let base = shop(1, 3).await;
    let mut s = settings(&db, &base, &Setup::default(), "a");
    s.bots[0].seeds = static_seeds(&[format!("{base}/sitemap.xml"), format!("{base}/list/1")]);
    once(s).await;
    let sitemap = frontier(
        &db,
        doc! { "kind": "seed", "url": format!("{base}/sitemap.xml") },
    )
    .await;
    assert_eq!(sitemap[0].get_str("status").unwrap(), "done");
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_is_not_retried_and_a_503_is_retried_then_recorded_failed() {
    let db = test_db("flow_permanent").await;
    let base = shop(2, 10).await;
    let products: Vec<String> = {
        let mut p: Vec<String> = truth(&base).await.into_keys().collect();
        p.sort();
        p
    };
    let (forbidden, unavailable) = (&products[2], &products[4]);
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{forbidden}"), "status": 403},
            {"path": format!("/product/{unavailable}"), "status": 503},
        ]),
    )
    .await;
    let setup = Setup {
        crawl: "attempts = 3",
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let requests = Requests::take(&base).await;
    assert_eq!(
        requests.under(&format!("/product/{forbidden}")),
        1,
        "403 is not retried"
    );
    assert_eq!(
        requests.under(&format!("/product/{unavailable}")),
        3,
        "503 is retried up to the attempt limit"
    );
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    let reason = |sku: &str| {
        failed
            .iter()
            .find(|f| f.get_str("url").unwrap().ends_with(sku))
            .map(|f| f.get_str("lastError").unwrap().to_owned())
    };
    assert_eq!(reason(forbidden).as_deref(), Some("HTTP 403"));
    assert_eq!(
        reason(unavailable).as_deref(),
        Some("HTTP 503 (after 3 attempts)")
    );
    assert_eq!(live_records(&db).await.len(), products.len() - 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_judged_hop_by_hop_out_of_scope_is_refused_in_scope_goes_through_its_host() {
    let db = test_db("crawl_redirects").await;
    let base = shop(2, 5).await;
    // Another shop on another port, in the bot's scope, seeded nowhere: it hears from the crawl
    // only through a redirect.
    let other = kit::shop::Shop::start_with(1, 5, "ALT", 12).await.leak();
    // A server out of scope (say a cloud metadata address): it must hear nothing at all.
    let canary = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let canary_addr = canary.local_addr().unwrap();
    let knocked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let knocked = knocked.clone();
        tokio::spawn(async move {
            while let Ok((_socket, _)) = canary.accept().await {
                knocked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
    }
    let products: Vec<String> = truth(&base).await.into_keys().collect();
    let (away, moved) = (&products[0], &products[1]);
    let elsewhere = truth(&other).await.into_keys().next().unwrap();
    post(
        &format!("{base}/__faults"),
        json!([
            {"path": format!("/product/{away}"), "redirect_to": format!("http://{canary_addr}/latest/meta-data/")},
            {"path": format!("/product/{moved}"), "redirect_to": format!("{other}/product/{elsewhere}")},
        ]),
    )
    .await;
    Requests::take(&other).await;
    let other_host = other.trim_start_matches("http://").to_owned();
    let scope = [other_host.as_str()];
    let setup = Setup {
        scope: &scope,
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0]
        .get_str("url")
        .unwrap()
        .ends_with(&format!("/product/{away}")));
    assert_eq!(
        failed[0].get_str("lastError").unwrap(),
        format!("redirect out of scope: {canary_addr}")
    );
    assert_eq!(
        knocked.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the out-of-scope server received a connection"
    );
    // The in-scope hop went through that host's robots.txt (once, before any page of it), then
    // the page — and the links on it, in scope too, led the crawl over that shop as well.
    let heard = Requests::take(&other).await;
    assert_eq!(heard.0.get("/robots.txt"), Some(&1), "{:?}", heard.0);
    assert!(
        heard.0.contains_key(&format!("/product/{elsewhere}")),
        "{:?}",
        heard.0
    );
    // Every product of both shops is stored but the two whose pages now lead elsewhere: the one
    // out of scope (failed) and the one whose page is the other shop's product (stored as that).
    let stored = live_records(&db).await;
    assert!(!stored.contains_key(away.as_str()), "{stored:?}");
    assert!(!stored.contains_key(moved.as_str()), "{stored:?}");
    assert_eq!(stored.len(), products.len() - 2 + 5, "{stored:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_compressed_with_each_encoding_a_shop_may_use_are_decoded_and_stored() {
    // No `Accept-Encoding` of the bot's own: seedlock asks for every encoding it reads.
    for encoding in [
        None,
        Some("gzip"),
        Some("deflate"),
        Some("br"),
        Some("zstd"),
    ] {
        let db = test_db(&format!("crawl_enc_{}", encoding.unwrap_or("any"))).await;
        let base = shop(1, 5).await;
        let headers = encoding.map_or_else(String::new, |e| {
            format!("[bots.crawl.headers]\nAccept-Encoding = \"{e}\"\n")
        });
        let setup = Setup {
            incremental: &headers,
            ..Setup::default()
        };
        once(settings(&db, &base, &setup, "a")).await;
        assert_eq!(live_records(&db).await, truth(&base).await, "{encoding:?}");
        let stats = get_json(&format!("{base}/__stats")).await;
        let sent = |e: &str| stats["encodings"][e].as_u64().unwrap_or(0);
        let compressed: u64 = ["gzip", "deflate", "br", "zstd"]
            .iter()
            .map(|e| sent(e))
            .sum();
        // The listing page and its five products, at least, came compressed.
        match encoding {
            Some(e) => assert!(sent(e) >= 6, "{e}: {stats}"),
            None => assert!(compressed >= 6, "{stats}"),
        }
    }
}
