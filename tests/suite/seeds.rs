//! Fetching seed sources over real HTTP: formats, the body cap, retries, sitemap indexes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use seedlock::config::{RefreshLimits, SeedFormat, SeedSource};
use seedlock::seeds::{SeedError, SeedReader};
use seedlock::urls::NormalizedUrl;
use tokio_util::sync::CancellationToken;

struct Site {
    base: String,
    flaky_hits: Arc<AtomicUsize>,
    missing_hits: Arc<AtomicUsize>,
}

async fn site() -> Site {
    let flaky_hits = Arc::new(AtomicUsize::new(0));
    let missing_hits = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (f, m) = (flaky_hits.clone(), missing_hits.clone());
    let app = axum::Router::new()
        .route("/lines.txt", get(|| async { "# comment\nhttp://a.test/1\nhttp://a.test/1#dup\nnot-a-url\nhttps://b.test/2\n" }))
        .route("/list.json", get(|| async { r#"["http://a.test/1", "http://a.test/2", 3]"# }))
        .route("/huge.txt", get(|| async { "http://a.test/x\n".repeat(10_000) }))
        .route("/empty.txt", get(|| async { "# nothing here\n\n" }))
        .route(
            "/flaky.txt",
            get(move || {
                let f = f.clone();
                async move {
                    if f.fetch_add(1, Ordering::SeqCst) < 2 {
                        (StatusCode::SERVICE_UNAVAILABLE, String::new())
                    } else {
                        (StatusCode::OK, "http://a.test/ok\n".to_owned())
                    }
                }
            }),
        )
        .route(
            "/missing.txt",
            get(move || {
                let m = m.clone();
                async move {
                    m.fetch_add(1, Ordering::SeqCst);
                    StatusCode::NOT_FOUND
                }
            }),
        )
        .route(
            "/index.xml",
            get(|| async {
                r#"<sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
                   <sitemap><loc>/maps/a.xml</loc></sitemap><sitemap><loc>/maps/b.xml</loc></sitemap></sitemapindex>"#
            }),
        )
        .route("/maps/a.xml", get(|| async { r#"<urlset><url><loc>http://a.test/1</loc></url><url><loc>http://a.test/2</loc></url></urlset>"# }))
        .route("/maps/b.xml", get(|| async { r#"<urlset><url><loc>http://a.test/2</loc></url><url><loc>http://a.test/3</loc></url></urlset>"# }))
        .route("/deep.xml", get(|| async { r#"<sitemapindex><sitemap><loc>/index.xml</loc></sitemap></sitemapindex>"# }))
        .route("/loop.xml", get(|| async { r#"<sitemapindex><sitemap><loc>/loop.xml</loc></sitemap></sitemapindex>"# }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Site {
        base,
        flaky_hits,
        missing_hits,
    }
}

fn limits(max_bytes: usize, attempts: u32, sitemap_depth: u32) -> RefreshLimits {
    RefreshLimits {
        timeout: Duration::from_secs(5),
        max_bytes,
        max_seeds: 1000,
        attempts,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(50),
        sitemap_depth,
        user_agent: "seedlock-test".into(),
        concurrency: 16,
    }
}

async fn fetch(
    site: &Site,
    path: &str,
    format: SeedFormat,
    limits: RefreshLimits,
) -> Result<Vec<String>, SeedError> {
    let source = SeedSource::Url {
        url: NormalizedUrl::parse(&format!("{}{path}", site.base)).unwrap(),
        format,
    };
    let fetcher = SeedReader::new(limits).unwrap();
    fetcher
        .fetch(&source, &CancellationToken::new())
        .await
        .map(|s| s.urls.into_iter().map(|u| u.as_str().to_owned()).collect())
}

#[tokio::test]
async fn lines_are_normalized_deduplicated_and_filtered() {
    let s = site().await;
    let urls = fetch(&s, "/lines.txt", SeedFormat::Lines, limits(1 << 20, 1, 2))
        .await
        .unwrap();
    assert_eq!(urls, ["http://a.test/1", "https://b.test/2"]);
}

#[tokio::test]
async fn json_arrays_keep_their_strings() {
    let s = site().await;
    let urls = fetch(&s, "/list.json", SeedFormat::Json, limits(1 << 20, 1, 2))
        .await
        .unwrap();
    assert_eq!(urls, ["http://a.test/1", "http://a.test/2"]);
}

#[tokio::test]
async fn sitemap_indexes_are_followed_and_merged() {
    let s = site().await;
    let urls = fetch(&s, "/index.xml", SeedFormat::Sitemap, limits(1 << 20, 1, 2))
        .await
        .unwrap();
    assert_eq!(
        urls,
        ["http://a.test/1", "http://a.test/2", "http://a.test/3"]
    );
}

#[tokio::test]
async fn sitemap_nesting_beyond_the_depth_fails() {
    let s = site().await;
    let err = fetch(&s, "/deep.xml", SeedFormat::Sitemap, limits(1 << 20, 1, 1))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("nest deeper than 1"), "{err}");
    // A self-referencing index is fetched once (visited set), so it ends with no URL at all.
    let err = fetch(&s, "/loop.xml", SeedFormat::Sitemap, limits(1 << 20, 1, 3))
        .await
        .unwrap_err();
    assert!(matches!(err, SeedError::Empty { .. }), "{err}");
}

#[tokio::test]
async fn bodies_over_the_cap_fail() {
    let s = site().await;
    let err = fetch(&s, "/huge.txt", SeedFormat::Lines, limits(4096, 1, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SeedError::TooLarge { max: 4096, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn transient_failures_are_retried_with_backoff() {
    let s = site().await;
    let urls = fetch(&s, "/flaky.txt", SeedFormat::Lines, limits(1 << 20, 3, 2))
        .await
        .unwrap();
    assert_eq!(urls, ["http://a.test/ok"]);
    assert_eq!(
        s.flaky_hits.load(Ordering::SeqCst),
        3,
        "two 503s, then success"
    );
}

#[tokio::test]
async fn retries_stop_at_the_attempt_limit() {
    let s = site().await;
    let err = fetch(&s, "/flaky.txt", SeedFormat::Lines, limits(1 << 20, 2, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SeedError::Status { status: 503, .. }),
        "{err}"
    );
    assert_eq!(s.flaky_hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn permanent_failures_are_not_retried() {
    let s = site().await;
    let err = fetch(&s, "/missing.txt", SeedFormat::Lines, limits(1 << 20, 5, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SeedError::Status { status: 404, .. }),
        "{err}"
    );
    assert_eq!(s.missing_hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_source_with_no_usable_url_is_a_failure() {
    let s = site().await;
    let err = fetch(&s, "/empty.txt", SeedFormat::Lines, limits(1 << 20, 1, 2))
        .await
        .unwrap_err();
    assert!(matches!(err, SeedError::Empty { .. }), "{err}");
}

#[tokio::test]
async fn an_unreachable_source_fails_promptly_and_cancellation_is_prompt() {
    let source = SeedSource::Url {
        url: NormalizedUrl::parse("http://127.0.0.1:1/seeds.txt").unwrap(),
        format: SeedFormat::Lines,
    };
    let fetcher = SeedReader::new(limits(1 << 20, 1, 2)).unwrap();
    let err = fetcher
        .fetch(&source, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, SeedError::Transport { .. }), "{err}");
    let cancel = CancellationToken::new();
    cancel.cancel();
    let fetcher = SeedReader::new(limits(1 << 20, 20, 2)).unwrap();
    assert!(matches!(
        fetcher.fetch(&source, &cancel).await,
        Err(SeedError::Cancelled)
    ));
}
