//! A bot's requests as sites expect them: its own user agent (robots.txt judged for it), a
//! cookie jar (a cookie-gated page crawled; configured cookies from the environment sent and
//! never shown), a proxy every request goes through, and `rel=canonical` (the record stored
//! under the canonical URL, one record for two URLs).

use crate::kit;

use std::time::Duration;

use bson::doc;
use kit::crawl::*;
use kit::test_db;

/// The shop's HTML rules for `scope`, with `extra` lines in `[bots.crawl]`.
fn rules_with(scope: &str, extra: &str) -> String {
    seedlock::demo_site::crawl_rules_toml(&[scope], ".sku").replacen(
        "[bots.crawl]\n",
        &format!("[bots.crawl]\n{extra}\n"),
        1,
    )
}

/// Every value the shop received for request header `name`.
async fn received(base: &str, name: &str) -> Vec<String> {
    let seen = get_json(&format!("{base}/__headers")).await;
    seen[name]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_a_page_sets_is_sent_back_and_configured_cookies_are_sent_but_never_shown() {
    let db = test_db("bot_cookies").await;
    let base = shop(3, 4).await;
    let host = base.trim_start_matches("http://");
    let var = format!("SEEDLOCK_TEST_COOKIE_{}", std::process::id());
    std::env::set_var(&var, "s3cr3t-value");
    let setup = Setup {
        rules: Some(rules_with(
            host,
            &format!("cookies = {{ session = {{ env = \"{var}\" }} }}"),
        )),
        ..Setup::default()
    };
    let mut s = settings(&db, &base, &setup, "a");
    s.bots[0].seeds = static_seeds(&[format!("{base}/members")]);
    assert!(
        !format!("{s:?}").contains("s3cr3t-value"),
        "the settings never show the cookie's value"
    );
    once(s).await;
    // `/members/list/1` answers only a client that sends back the cookie `/members` set; the
    // rest of the catalogue is reached through it.
    assert_eq!(live_records(&db).await, truth(&base).await);
    let cookies = received(&base, "cookie").await;
    assert!(
        cookies.iter().any(|c| c.contains("member=yes")),
        "{cookies:?}"
    );
    assert!(
        cookies.iter().all(|c| c.contains("session=s3cr3t-value")),
        "the configured cookie goes with every page request: {cookies:?}"
    );
    let failed = frontier(&db, doc! { "status": "failed" }).await;
    assert!(failed.is_empty(), "{failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bot_with_its_own_user_agent_sends_it_and_robots_txt_is_judged_for_it() {
    let db = test_db("bot_agent").await;
    let base = shop(1, 3).await;
    let host = base.trim_start_matches("http://");
    reqwest::Client::new()
        .post(format!("{base}/__robots"))
        .body("User-agent: otherbot\nDisallow: /product/\n\nUser-agent: *\nAllow: /\n")
        .send()
        .await
        .unwrap();
    let setup = Setup {
        rules: Some(rules_with(
            host,
            "user_agent = \"otherbot/2.0 (+https://example.test)\"",
        )),
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    let agents = received(&base, "user-agent").await;
    assert!(
        agents
            .iter()
            .any(|a| a == "otherbot/2.0 (+https://example.test)"),
        "{agents:?}"
    );
    assert!(
        records(&db).await.is_empty(),
        "its detail pages are disallowed"
    );
    let disallowed = frontier(&db, doc! { "status": "failed" }).await;
    assert_eq!(disallowed.len(), 3);
    for f in &disallowed {
        assert_eq!(f.get_str("lastError").unwrap(), "disallowed by robots.txt");
    }
    // The same shop, the same robots.txt, the instance's own user agent: everything.
    let db = test_db("bot_agent_default").await;
    let setup = Setup {
        rules: Some(rules_with(host, "")),
        ..Setup::default()
    };
    once(settings(&db, &base, &setup, "a")).await;
    assert_eq!(live_records(&db).await, truth(&base).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_of_a_bot_with_a_proxy_goes_through_it() {
    let db = test_db("bot_proxy").await;
    let base = shop(2, 3).await;
    let relay = kit::delay::Delay::start(base.trim_start_matches("http://"), Duration::ZERO);
    let var = format!("SEEDLOCK_TEST_PROXY_{}", std::process::id());
    std::env::set_var(&var, format!("http://{}", relay.addr));
    // A host name that does not resolve: only the proxy can reach the shop.
    let unreachable = "shop.invalid:8080";
    let setup = Setup {
        rules: Some(rules_with(
            unreachable,
            &format!("proxy = {{ env = \"{var}\" }}"),
        )),
        ..Setup::default()
    };
    let mut s = settings(&db, &base, &setup, "a");
    s.bots[0].seeds = static_seeds(&[format!("http://{unreachable}/list/1")]);
    once(s).await;
    let truth = truth(&base).await;
    assert_eq!(live_records(&db).await, truth);
    let urls: Vec<String> = records(&db)
        .await
        .iter()
        .map(|r| r.get_str("url").unwrap().to_owned())
        .collect();
    assert!(urls
        .iter()
        .all(|u| u.starts_with("http://shop.invalid:8080/product/")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_whose_canonical_url_is_another_stores_its_record_under_that_url() {
    let db = test_db("bot_canonical").await;
    let base = shop(1, 3).await;
    let sku = truth(&base).await.into_keys().min().unwrap();
    // The product under two URLs, neither its canonical one; no listing page is read.
    let setup = Setup {
        rules: Some(rules_with(
            base.trim_start_matches("http://"),
            "deny = [\"/list/\"]",
        )),
        ..Setup::default()
    };
    let mut s = settings(&db, &base, &setup, "a");
    s.bots[0].seeds = static_seeds(&[
        format!("{base}/product/{sku}/red"),
        format!("{base}/product/{sku}/blue"),
    ]);
    once(s).await;
    let requests = Requests::take(&base).await;
    assert_eq!(
        requests.under("/product/"),
        2,
        "only the two variants fetched"
    );
    let stored = records(&db).await;
    assert_eq!(stored.len(), 1, "two URLs of one product: one record");
    assert_eq!(
        stored[0].get_str("url").unwrap(),
        format!("{base}/product/{sku}")
    );
}
