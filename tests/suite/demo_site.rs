//! The demo shop over real HTTP: pages, pagination, conditional GETs, mutations, faults, stats,
//! truth, and determinism by seed.

use crate::kit;

use std::time::{Duration, Instant};

use kit::crawl::post;
use seedlock::demo_site::MutationReport;
use serde_json::Value;

async fn shop(lists: u32, per_list: u32, seed: u64) -> String {
    kit::shop::Shop::start_with(lists, per_list, "SKU", seed)
        .await
        .leak()
}

async fn get(url: &str) -> reqwest::Response {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(url)
        .send()
        .await
        .unwrap()
}

async fn json(url: &str) -> Value {
    get(url).await.json().await.unwrap()
}

fn select<'a>(html: &'a scraper::Html, css: &str) -> Vec<scraper::ElementRef<'a>> {
    html.select(&scraper::Selector::parse(css).unwrap())
        .collect()
}

#[tokio::test]
async fn listing_pages_link_items_and_paginate() {
    let base = shop(3, 4, 7).await;
    let page =
        scraper::Html::parse_document(&get(&format!("{base}/list/1")).await.text().await.unwrap());
    let items = select(&page, ".item[data-id]");
    assert_eq!(items.len(), 4);
    let first = items[0];
    let sku = first.value().attr("data-id").unwrap();
    let link = first
        .select(&scraper::Selector::parse("a").unwrap())
        .next()
        .unwrap();
    assert_eq!(
        link.value().attr("href").unwrap(),
        format!("/product/{sku}")
    );
    for part in [".title", ".price", ".status"] {
        assert_eq!(
            first
                .select(&scraper::Selector::parse(part).unwrap())
                .count(),
            1,
            "{part}"
        );
    }
    assert_eq!(
        select(&page, "a.next")[0].value().attr("href"),
        Some("/list/2")
    );
    assert!(select(&page, "a.prev").is_empty());
    let last =
        scraper::Html::parse_document(&get(&format!("{base}/list/3")).await.text().await.unwrap());
    assert!(
        select(&last, "a.next").is_empty(),
        "the last page has no next link"
    );
    assert_eq!(get(&format!("{base}/list/4")).await.status(), 404);
    assert_eq!(get(&format!("{base}/list/zero")).await.status(), 404);
}

#[tokio::test]
async fn product_pages_match_the_truth_and_answer_conditional_gets() {
    let base = shop(2, 5, 7).await;
    let truth = json(&format!("{base}/__truth")).await;
    assert_eq!(truth["count"], 10);
    let p = &truth["products"][3];
    let sku = p["sku"].as_str().unwrap();
    let response = get(&format!("{base}/product/{sku}")).await;
    assert_eq!(response.status(), 200);
    let etag = response.headers()["etag"].to_str().unwrap().to_owned();
    let last_modified = response.headers()["last-modified"]
        .to_str()
        .unwrap()
        .to_owned();
    let page = scraper::Html::parse_document(&response.text().await.unwrap());
    let text = |css: &str| select(&page, css)[0].text().collect::<String>();
    assert_eq!(text(".sku"), sku);
    assert_eq!(text("h1"), p["title"].as_str().unwrap());
    assert_eq!(text(".price"), p["price"].as_str().unwrap());
    assert_eq!(text(".status"), p["status"].as_str().unwrap());

    let client = reqwest::Client::new();
    let url = format!("{base}/product/{sku}");
    let again = client
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
    let since = client
        .get(&url)
        .header("if-modified-since", &last_modified)
        .send()
        .await
        .unwrap();
    assert_eq!(since.status(), 304);
    // After a price change the old ETag no longer matches.
    let mut changed = false;
    while !changed {
        let report: MutationReport = serde_json::from_value(
            post(
                &format!("{base}/__mutate"),
                serde_json::json!({"change": 5}),
            )
            .await,
        )
        .unwrap();
        changed = report.changed.iter().any(|s| s == sku);
    }
    let after = client
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 200);
    assert_eq!(
        get(&format!("{base}/product/SKU-9999999")).await.status(),
        404
    );
}

#[tokio::test]
async fn mutations_change_add_and_delete_and_say_which() {
    let base = shop(2, 10, 3).await;
    let before = json(&format!("{base}/__truth")).await;
    let report: MutationReport = serde_json::from_value(
        post(
            &format!("{base}/__mutate"),
            serde_json::json!({"change": 3, "add": 2, "delete": 4}),
        )
        .await,
    )
    .unwrap();
    assert_eq!(
        (
            report.changed.len(),
            report.added.len(),
            report.deleted.len()
        ),
        (3, 2, 4)
    );
    let after = json(&format!("{base}/__truth")).await;
    assert_eq!(after["count"], 20 - 4 + 2);
    let skus: Vec<&str> = after["products"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["sku"].as_str().unwrap())
        .collect();
    assert_eq!(
        &skus[..2],
        &[report.added[1].as_str(), report.added[0].as_str()],
        "new products come first"
    );
    for gone in &report.deleted {
        assert!(!skus.contains(&gone.as_str()));
        assert_eq!(get(&format!("{base}/product/{gone}")).await.status(), 404);
    }
    let price = |truth: &Value, sku: &str| {
        truth["products"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["sku"] == sku)
            .map(|p| p["price"].clone())
    };
    for sku in report
        .changed
        .iter()
        .filter(|s| !report.deleted.contains(s))
    {
        assert_ne!(
            price(&before, sku),
            price(&after, sku),
            "{sku} changed price"
        );
    }
}

#[tokio::test]
async fn the_same_seed_gives_the_same_site_and_mutations() {
    let (a, b, c) = (
        shop(3, 7, 42).await,
        shop(3, 7, 42).await,
        shop(3, 7, 43).await,
    );
    let ta = json(&format!("{a}/__truth")).await;
    assert_eq!(ta, json(&format!("{b}/__truth")).await);
    assert_ne!(ta, json(&format!("{c}/__truth")).await);
    let body = serde_json::json!({"change": 4, "add": 3, "delete": 2});
    assert_eq!(
        post(&format!("{a}/__mutate"), body.clone()).await,
        post(&format!("{b}/__mutate"), body).await
    );
    assert_eq!(
        json(&format!("{a}/__truth")).await,
        json(&format!("{b}/__truth")).await
    );
}

#[tokio::test]
async fn faults_are_injected_on_matching_paths_only() {
    let base = shop(2, 5, 1).await;
    post(
        &format!("{base}/__faults"),
        serde_json::json!([
            {"path": "/list/2", "status": 429, "retry_after": "2"},
            {"path": "/product/", "latency_ms": 300, "every": 2},
            {"path": "/loop", "redirect_loop": true},
            {"path": "/huge", "huge_body_bytes": 100000}
        ]),
    )
    .await;
    let throttled = get(&format!("{base}/list/2")).await;
    assert_eq!(throttled.status(), 429);
    assert_eq!(throttled.headers()["retry-after"], "2");
    assert_eq!(
        get(&format!("{base}/list/1")).await.status(),
        200,
        "other paths are untouched"
    );
    let sku = json(&format!("{base}/__truth")).await["products"][0]["sku"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut slow = 0;
    for _ in 0..4 {
        let t = Instant::now();
        assert_eq!(get(&format!("{base}/product/{sku}")).await.status(), 200);
        if t.elapsed() >= Duration::from_millis(300) {
            slow += 1;
        }
    }
    assert_eq!(slow, 2, "every second product request is delayed");
    let looped = get(&format!("{base}/loop")).await;
    assert_eq!(looped.status(), 302);
    assert_eq!(looped.headers()["location"], "/loop");
    assert_eq!(
        get(&format!("{base}/huge"))
            .await
            .bytes()
            .await
            .unwrap()
            .len(),
        100_000
    );
    reqwest::Client::new()
        .delete(format!("{base}/__faults"))
        .send()
        .await
        .unwrap();
    assert_eq!(get(&format!("{base}/list/2")).await.status(), 200);
}

#[tokio::test]
async fn stats_count_requests_per_path_and_seeds_name_the_first_page() {
    let base = shop(4, 5, 1).await;
    let seeds = get(&format!("{base}/seeds.txt"))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(seeds.trim(), format!("{base}/list/1"));
    let sitemap = get(&format!("{base}/sitemap.xml"))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(sitemap.matches("<loc>").count(), 4, "every listing page");
    get(&format!("{base}/list/1")).await;
    get(&format!("{base}/list/1")).await;
    let stats = json(&format!("{base}/__stats?reset=true")).await;
    assert_eq!(stats["paths"]["/list/1"], 2);
    assert_eq!(stats["paths"]["/seeds.txt"], 1);
    assert_eq!(stats["total"], 4);
    assert_eq!(json(&format!("{base}/__stats")).await["total"], 0, "reset");
}
