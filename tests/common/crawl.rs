//! The crawl tests' kit: the demo shop in-process, a crawling bot's settings, `run --once`
//! in-process, and `/metrics` samples.

use std::time::Duration;

use seedlock::config::Settings;
use seedlock::daemon::{run, BotSummary, Mode};
use seedlock::demo_site::{serve, SiteOptions};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::TestDb;

pub async fn shop(lists: u32, per_list: u32) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let options = SiteOptions {
        lists,
        per_list,
        seed: 11,
        ..SiteOptions::default()
    };
    tokio::spawn(async move {
        serve(listener, options, CancellationToken::new())
            .await
            .unwrap()
    });
    base
}

pub async fn post(url: &str, body: Value) -> Value {
    reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn get_json(url: &str) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

pub struct Setup<'a> {
    pub mode: &'a str,
    pub transactions: &'a str,
    pub workers: u32,
    /// Extra lines for `[crawl]`.
    pub crawl: &'a str,
    /// Extra lines for `[bots.crawl.incremental]`.
    pub incremental: &'a str,
    pub natural_key: &'a str,
    /// The seed source's URL (default: the shop's `/seeds.txt`).
    pub seeds: Option<&'a str>,
    /// More `host:port`s in scope besides the shop's.
    pub scope: &'a [&'a str],
    /// `[http] listen` (default "off").
    pub listen: &'a str,
    /// `crawl.lease` and `crawl.timeout`.
    pub lease: &'a str,
    pub timeout: &'a str,
}

impl Default for Setup<'_> {
    fn default() -> Self {
        Setup {
            mode: "fingerprint",
            transactions: "auto",
            workers: 4,
            crawl: "",
            incremental: "",
            natural_key: ".sku",
            seeds: None,
            scope: &[],
            listen: "off",
            lease: "5s",
            timeout: "2s",
        }
    }
}

pub fn settings(db: &TestDb, base: &str, setup: &Setup<'_>, instance: &str) -> Settings {
    let mut scope = vec![format!("{:?}", base.trim_start_matches("http://"))];
    scope.extend(setup.scope.iter().map(|h| format!("{h:?}")));
    let scope = scope.join(", ");
    let seeds = setup
        .seeds
        .map_or_else(|| format!("{base}/seeds.txt"), str::to_owned);
    let text = format!(
        r#"
[mongo]
uri = "{uri}"
database = "{database}"
[instance]
id = "{instance}"
[lock]
ttl = "5s"
poll = "100ms"
[refresh]
attempts = 1
[crawl]
workers = {workers}
lease = "{lease}"
timeout = "{timeout}"
transactions = "{transactions}"
backoff_base = "20ms"
backoff_max = "100ms"
{crawl}
[http]
listen = "{listen}"
[[bots]]
id = "shop"
seeds = {{ url = "{seeds}", format = "lines" }}
refresh = "1h"
[bots.crawl]
scope = [{scope}]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
updated_at = "@data-updated"
[bots.crawl.record]
match = "/product/"
natural_key = "{natural_key}"
fields = {{ title = "h1", price = ".price", status = ".status" }}
[bots.crawl.incremental]
mode = "{mode}"
{incremental}
"#,
        uri = db.uri,
        database = db.name,
        workers = setup.workers,
        transactions = setup.transactions,
        crawl = setup.crawl,
        mode = setup.mode,
        incremental = setup.incremental,
        natural_key = setup.natural_key,
        listen = setup.listen,
        lease = setup.lease,
        timeout = setup.timeout,
    );
    Settings::from_toml(&text, |_| None).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// `seedlock run --once`, in-process: Ready, then the current pass finished.
pub async fn once(settings: Settings) -> Vec<BotSummary> {
    run(
        settings,
        Mode::Once {
            timeout: Duration::from_secs(60),
        },
        CancellationToken::new(),
    )
    .await
    .expect("run --once finishes the pass")
}

pub async fn shop_named(lists: u32, per_list: u32, prefix: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let options = SiteOptions {
        lists,
        per_list,
        seed: 11,
        sku_prefix: prefix.to_owned(),
    };
    tokio::spawn(async move {
        serve(listener, options, CancellationToken::new())
            .await
            .unwrap()
    });
    base
}

pub fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// A sample of one series from `/metrics` (`None` until it exists).
pub async fn metric(addr: &str, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Samples `series` from the daemon at `addr` every 20 ms until `stop`; returns every value.
pub fn sampler(
    addr: String,
    series: String,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Vec<f64>> {
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while !stop.is_cancelled() {
            if let Some(v) = metric(&addr, &series).await {
                seen.push(v);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen
    })
}
