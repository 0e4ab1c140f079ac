//! Fetching crawl pages over real HTTP from the demo shop and its fault injection: each failure
//! becomes the outcome its name says.

use std::time::Duration;

use seedlock::demo_site::{serve, SiteOptions};
use seedlock::http_client::{
    BodyFormat, FetchOutcome, HttpClient, Validators, DEFAULT_MAX_PAGE_BYTES,
};
use seedlock::urls::NormalizedUrl;
use serde_json::json;
use tokio_util::sync::CancellationToken;

async fn shop() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        serve(
            listener,
            SiteOptions {
                lists: 2,
                per_list: 3,
                seed: 5,
                ..SiteOptions::default()
            },
            CancellationToken::new(),
        )
        .await
        .unwrap()
    });
    base
}

async fn faults(base: &str, rules: serde_json::Value) {
    reqwest::Client::new()
        .post(format!("{base}/__faults"))
        .json(&rules)
        .send()
        .await
        .unwrap();
}

fn url(s: &str) -> NormalizedUrl {
    NormalizedUrl::parse(s).unwrap()
}

fn fetcher(timeout: Duration) -> HttpClient {
    HttpClient::new("seedlock-test", timeout, DEFAULT_MAX_PAGE_BYTES).unwrap()
}

#[tokio::test]
async fn pages_come_with_validators_and_conditional_gets_answer_not_modified() {
    let base = shop().await;
    let truth: serde_json::Value = reqwest::get(format!("{base}/__truth"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sku = truth["products"][0]["sku"].as_str().unwrap();
    let f = fetcher(Duration::from_secs(5));
    let page = match f
        .fetch(
            &url(&format!("{base}/product/{sku}")),
            &Validators::default(),
        )
        .await
    {
        FetchOutcome::Ok(page) => page,
        other => panic!("expected a page, got {other:?}"),
    };
    assert!(page.body.contains(sku));
    let validators = Validators {
        etag: page.etag.clone(),
        last_modified: None,
    };
    assert!(validators.etag.is_some());
    assert_eq!(
        f.fetch(&page.url, &validators).await,
        FetchOutcome::NotModified
    );
    let by_date = Validators {
        etag: None,
        last_modified: page.last_modified.clone(),
    };
    assert_eq!(
        f.fetch(&page.url, &by_date).await,
        FetchOutcome::NotModified
    );
}

#[tokio::test]
async fn every_failure_has_its_outcome() {
    let base = shop().await;
    faults(
        &base,
        json!([
            {"path": "/list/2", "status": 429, "retry_after": "2"},
            {"path": "/busy", "status": 503},
            {"path": "/broken", "status": 500},
            {"path": "/huge", "huge_body_bytes": DEFAULT_MAX_PAGE_BYTES + 1},
            {"path": "/loop", "redirect_loop": true},
            {"path": "/slow", "latency_ms": 2000},
            {"path": "/forbidden", "status": 403}
        ]),
    )
    .await;
    let f = fetcher(Duration::from_millis(500));
    let get = |p: &str| url(&format!("{base}{p}"));
    assert_eq!(
        f.fetch(&get("/list/2"), &Validators::default()).await,
        FetchOutcome::Throttled {
            status: 429,
            retry_after: Some(Duration::from_secs(2))
        }
    );
    assert_eq!(
        f.fetch(&get("/busy"), &Validators::default()).await,
        FetchOutcome::Throttled {
            status: 503,
            retry_after: None
        }
    );
    assert!(matches!(
        f.fetch(&get("/broken"), &Validators::default()).await,
        FetchOutcome::Transient { .. }
    ));
    match f.fetch(&get("/huge"), &Validators::default()).await {
        FetchOutcome::Permanent { reason } => {
            assert!(reason.contains("body larger than"), "{reason}")
        }
        other => panic!("a body over the cap fails: {other:?}"),
    }
    match f.fetch(&get("/loop"), &Validators::default()).await {
        FetchOutcome::Permanent { reason } => assert!(reason.contains("redirects"), "{reason}"),
        other => panic!("a redirect loop fails: {other:?}"),
    }
    assert_eq!(
        f.fetch(&get("/slow"), &Validators::default()).await,
        FetchOutcome::Timeout
    );
    assert_eq!(
        f.fetch(&get("/product/SKU-0000000"), &Validators::default())
            .await,
        FetchOutcome::Gone { status: 404 }
    );
    assert_eq!(
        f.fetch(&get("/forbidden"), &Validators::default()).await,
        FetchOutcome::Permanent {
            reason: "HTTP 403".into()
        }
    );
    assert!(
        matches!(
            f.fetch(&get("/seeds.json"), &Validators::default()).await,
            FetchOutcome::Ok(page) if page.format == BodyFormat::Json
        ),
        "JSON is a page to read"
    );
    assert!(
        matches!(
            f.fetch(&get("/sitemap.xml"), &Validators::default()).await,
            FetchOutcome::Ok(page) if page.format == BodyFormat::Sitemap
                && page.sitemap.as_ref().is_some_and(|(s, _)| s.len() == 2)
        ),
        "a sitemap is read as it arrives"
    );
    assert_eq!(
        f.fetch(&get("/seeds.txt"), &Validators::default()).await,
        FetchOutcome::Skipped {
            reason: "neither HTML, JSON nor a sitemap (text/plain)".into()
        }
    );
    assert!(matches!(
        f.fetch(&url("http://127.0.0.1:1/x"), &Validators::default())
            .await,
        FetchOutcome::Transient { .. }
    ));
}

#[tokio::test]
async fn invalid_utf8_is_read_lossily() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/latin1",
        axum::routing::get(|| async {
            (
                [("content-type", "text/html")],
                b"<div class=sku>caf\xe9</div>".to_vec(),
            )
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    match fetcher(Duration::from_secs(5))
        .fetch(
            &url(&format!("http://{addr}/latin1")),
            &Validators::default(),
        )
        .await
    {
        FetchOutcome::Ok(page) => assert_eq!(page.body, "<div class=sku>caf\u{fffd}</div>"),
        other => panic!("expected a page, got {other:?}"),
    }
}

/// The process's peak resident set so far (`VmHWM`), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib * 1024
}

#[tokio::test]
async fn a_decompression_bomb_fails_its_page_as_too_large_with_memory_bounded() {
    let base = shop().await;
    let inflated: u64 = 1 << 30;
    faults(
        &base,
        json!([{"path": "/bomb", "gzip_bomb_bytes": inflated}]),
    )
    .await;
    // The bomb as sent: about a thousandth of what it inflates to.
    let raw = reqwest::Client::builder()
        .no_gzip()
        .build()
        .unwrap()
        .get(format!("{base}/bomb"))
        .header("Accept-Encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.headers()["content-encoding"], "gzip");
    let sent = raw.bytes().await.unwrap().len() as u64;
    assert!(sent < inflated / 500, "{sent} bytes on the wire");
    let before = peak_rss();
    let outcome = fetcher(Duration::from_secs(60))
        .fetch(&url(&format!("{base}/bomb")), &Validators::default())
        .await;
    assert_eq!(
        outcome,
        FetchOutcome::Permanent {
            reason: format!("body larger than {DEFAULT_MAX_PAGE_BYTES} bytes (cut off)")
        }
    );
    let grew = peak_rss().saturating_sub(before);
    assert!(
        grew < 64 << 20,
        "reading the bomb raised the peak RSS by {} MiB",
        grew >> 20
    );
}
