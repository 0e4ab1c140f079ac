//! The crawl tests' kit: the demo shop in-process, a crawling bot's settings, `run --once`
//! in-process, and `/metrics` samples.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bson::{doc, Bson, Document};
use futures_util::TryStreamExt;

use seedlock::config::Settings;
use seedlock::daemon::{run, BotSummary, Mode};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::TestDb;

/// A demo shop for the rest of the test; its base URL.
pub async fn shop(lists: u32, per_list: u32) -> String {
    super::shop::Shop::start_with(lists, per_list, "SKU", 11)
        .await
        .leak()
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

pub async fn delete(url: &str) {
    let status = reqwest::Client::new()
        .delete(url)
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_success(), "DELETE {url}: {status}");
}

/// Seeds given as a list of URLs (no seed source).
pub fn static_seeds(urls: &[String]) -> seedlock::config::SeedSource {
    seedlock::config::SeedSource::Static(
        urls.iter()
            .map(|u| seedlock::urls::NormalizedUrl::parse(u).unwrap())
            .collect(),
    )
}

/// The SKUs a `/__mutate` report lists under `name`, sorted.
pub fn skus(report: &Value, name: &str) -> Vec<String> {
    let mut out: Vec<String> = report[name]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    out.sort();
    out
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
    /// The `[bots.crawl]` rules (TOML) in place of the shop's HTML ones
    /// (`demo_site::crawl_rules_toml`), such as `demo_site::api_rules_toml`'s.
    pub rules: Option<String>,
    /// The database's URI in place of the test database's (a proxy in front of it).
    pub uri: Option<&'a str>,
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
            rules: None,
            uri: None,
        }
    }
}

pub fn settings(db: &TestDb, base: &str, setup: &Setup<'_>, instance: &str) -> Settings {
    let mut scope = vec![base.trim_start_matches("http://")];
    scope.extend(setup.scope.iter().copied());
    let rules = setup
        .rules
        .clone()
        .unwrap_or_else(|| seedlock::demo_site::crawl_rules_toml(&scope, setup.natural_key));
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
{rules}[bots.crawl.incremental]
mode = "{mode}"
{incremental}
"#,
        uri = setup.uri.unwrap_or(&db.uri),
        database = db.name,
        workers = setup.workers,
        transactions = setup.transactions,
        crawl = setup.crawl,
        mode = setup.mode,
        incremental = setup.incremental,
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

/// A demo shop whose SKUs start with `prefix`, for the rest of the test; its base URL.
pub async fn shop_named(lists: u32, per_list: u32, prefix: &str) -> String {
    super::shop::Shop::start_with(lists, per_list, prefix, 11)
        .await
        .leak()
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

// ---- what the crawl tests read of the shop and the database --------------------------------

/// Requests per path since the last call (the counters are reset).
pub struct Requests(pub BTreeMap<String, u64>);

impl Requests {
    pub async fn take(base: &str) -> Requests {
        Self::read(base, true).await
    }

    /// Without resetting the counters.
    pub async fn peek(base: &str) -> Requests {
        Self::read(base, false).await
    }

    pub async fn read(base: &str, reset: bool) -> Requests {
        let stats = get_json(&format!("{base}/__stats?reset={reset}")).await;
        let paths = stats["paths"].as_object().unwrap();
        Requests(
            paths
                .iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect(),
        )
    }

    pub fn under(&self, prefix: &str) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    }

    /// Pages requested more than once (robots.txt is read once per process by design).
    pub fn repeated(&self) -> u64 {
        self.0
            .iter()
            .filter(|(path, _)| *path != "/robots.txt")
            .map(|(_, v)| v.saturating_sub(1))
            .sum()
    }
}

/// The shop's products: sku → (title, price, status).
pub async fn truth(base: &str) -> HashMap<String, (String, String, String)> {
    let truth = get_json(&format!("{base}/__truth")).await;
    truth["products"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap().to_owned();
            (s("sku"), (s("title"), s("price"), s("status")))
        })
        .collect()
}

pub async fn records(db: &TestDb) -> Vec<Document> {
    db.db
        .collection::<Document>("records")
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// Records not marked removed, by natural key → (title, price, status).
pub async fn live_records(db: &TestDb) -> HashMap<String, (String, String, String)> {
    let mut out = HashMap::new();
    for r in records(db).await {
        if !matches!(r.get("removedAt"), None | Some(Bson::Null)) {
            continue;
        }
        let data = r.get_document("data").unwrap();
        let s = |k: &str| data.get_str(k).unwrap_or_default().to_owned();
        let key = r.get_str("naturalKey").unwrap().to_owned();
        assert!(
            out.insert(key.clone(), (s("title"), s("price"), s("status")))
                .is_none(),
            "two records for {key}"
        );
    }
    out
}

pub async fn removed_keys(db: &TestDb) -> Vec<String> {
    let mut keys: Vec<String> = records(db)
        .await
        .into_iter()
        .filter(|r| matches!(r.get("removedAt"), Some(Bson::DateTime(_))))
        .map(|r| r.get_str("naturalKey").unwrap().to_owned())
        .collect();
    keys.sort();
    keys
}

pub async fn frontier(db: &TestDb, filter: Document) -> Vec<Document> {
    db.db
        .collection::<Document>("frontier")
        .find(filter)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

pub async fn request_refresh(db: &TestDb) {
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    assert!(db
        .store()
        .bots()
        .request_refresh(&bot, "test", chrono::Utc::now())
        .await
        .unwrap());
}

pub async fn bot_doc(db: &TestDb) -> Document {
    db.doc("shop").await.expect("the bot document")
}

/// The `[[bots]]` entry of the processes' config (the shop's own rules, as [`settings`]).
pub fn crawl_bot_toml(base: &str) -> String {
    crawl_bot_toml_every(base, "1h")
}

/// As [`crawl_bot_toml`], refreshed every `refresh`.
pub fn crawl_bot_toml_every(base: &str, refresh: &str) -> String {
    format!(
        "[[bots]]\nid = \"shop\"\nseeds = {{ url = \"{base}/seeds.txt\", format = \"lines\" }}\nrefresh = \"{refresh}\"\n{}",
        seedlock::demo_site::crawl_rules_toml(&[base.trim_start_matches("http://")], ".sku")
    )
}

/// A seed source listing the first listing page of each shop.
pub async fn seeds_of(bases: &[&str]) -> String {
    let body: String = bases.iter().map(|b| format!("{b}/list/1\n")).collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/seeds.txt", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/seeds.txt",
        axum::routing::get(move || {
            let body = body.clone();
            async move { body }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// The shop's request log: (path, Unix milliseconds), oldest first.
pub async fn request_log(base: &str) -> Vec<(String, i64)> {
    let stats = get_json(&format!("{base}/__stats?log=true")).await;
    stats["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap().to_owned(), e[1].as_i64().unwrap()))
        .collect()
}

/// The commands a monitored client sent, in order: (name, body).
pub type Sent = std::sync::Arc<std::sync::Mutex<Vec<(String, Document)>>>;

/// A store whose client records every command it sends (the driver's command monitoring).
pub async fn monitored_store(uri: &str, database: &str) -> (seedlock::store::Store, Sent) {
    use mongodb::event::command::CommandEvent;
    let sent: Sent = Default::default();
    let mut options = mongodb::options::ClientOptions::parse(uri).await.unwrap();
    let log = sent.clone();
    options.command_event_handler = Some(mongodb::event::EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            log.lock()
                .unwrap()
                .push((started.command_name.clone(), started.command.clone()));
        }
    }));
    let client = mongodb::Client::with_options(options).unwrap();
    (seedlock::store::Store::new(client.database(database)), sent)
}

/// Counts the documents written to `collection` (its change stream's events: inserts,
/// updates, replacements, deletes) from now until the returned counter is stopped.
pub struct WriteCount {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::collections::BTreeMap<String, u64>>,
}

impl WriteCount {
    pub async fn start(db: &TestDb, collection: &str) -> WriteCount {
        use futures_util::StreamExt;
        let mut stream = db
            .db
            .collection::<Document>(collection)
            .watch()
            .await
            .expect("a change stream");
        let stop = CancellationToken::new();
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let mut by_id: std::collections::BTreeMap<String, u64> = Default::default();
            let mut count = |e: mongodb::change_stream::event::ChangeStreamEvent<Document>| {
                let id = e
                    .document_key
                    .and_then(|k| k.get("_id").map(ToString::to_string))
                    .unwrap_or_default();
                *by_id.entry(id).or_default() += 1;
            };
            loop {
                tokio::select! {
                    _ = until.cancelled() => break,
                    event = stream.next() => match event {
                        Some(Ok(e)) => count(e),
                        _ => break,
                    },
                }
            }
            // What was written before the stop and is still on its way.
            while let Ok(Some(Ok(e))) =
                tokio::time::timeout(Duration::from_millis(500), stream.next()).await
            {
                count(e);
            }
            by_id
        });
        WriteCount { stop, task }
    }

    /// Writes per document (by `_id`), since the start.
    pub async fn stop(self) -> std::collections::BTreeMap<String, u64> {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// `run --once` of `settings` on `store`, in-process.
pub async fn once_on(settings: Settings, store: seedlock::store::Store) -> Vec<BotSummary> {
    seedlock::daemon::run_with_store(
        settings,
        store,
        Mode::Once {
            timeout: Duration::from_secs(60),
        },
        CancellationToken::new(),
    )
    .await
    .expect("run --once finishes the pass")
}

/// The `_id`s the frontier reads of `sent` asked for to decide listing items (the known-pages
/// read: its projection holds `fingerprint`), leaving out the listing pages `listings`.
pub fn item_reads(sent: &Sent, listings: &[String]) -> usize {
    sent.lock()
        .unwrap()
        .iter()
        .filter(|(name, body)| name == "find" && body.get_str("find") == Ok("frontier"))
        .filter(|(_, body)| {
            body.get_document("projection")
                .is_ok_and(|p| p.contains_key("fingerprint"))
        })
        .map(|(_, body)| {
            body.get_document("filter")
                .ok()
                .and_then(|f| f.get_document("_id").ok())
                .and_then(|id| id.get_array("$in").ok())
                .map_or(0, |ids| {
                    ids.iter()
                        .filter(|id| {
                            !id.as_str()
                                .is_some_and(|id| listings.iter().any(|l| l == id))
                        })
                        .count()
                })
        })
        .sum()
}

/// The frontier ids of the shop's listing pages 1 to `n` (bot `shop`).
pub fn listing_ids(base: &str, n: u32) -> Vec<String> {
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    (1..=n)
        .map(|i| {
            let url = seedlock::urls::NormalizedUrl::parse(&format!("{base}/list/{i}")).unwrap();
            seedlock::store::frontier::url_id(&bot, &url)
        })
        .collect()
}

/// How many detail pages a listing page's manifest (`listed`) names: packed 16 bytes an id, or
/// an array of ids; `None` when it has none.
pub fn manifest_len(page: &Document) -> Option<usize> {
    match page.get("listed")? {
        bson::Bson::Binary(b) => Some(b.bytes.len() / 16),
        bson::Bson::Array(a) => Some(a.len()),
        _ => None,
    }
}

/// Bot `shop`'s released change events, oldest first (what `seedlock changes` shows).
pub async fn events(db: &TestDb) -> Vec<Document> {
    let bot = seedlock::ids::BotId::parse("shop").unwrap();
    let store = db.store();
    let (upto, _) = store
        .changes()
        .watermark(&bot)
        .await
        .unwrap()
        .unwrap_or((0, 0));
    store
        .changes()
        .read(&bot, 0, upto, 1_000_000)
        .await
        .unwrap()
}

/// Every event in `changes`, released or not.
pub async fn staged_events(db: &TestDb) -> Vec<Document> {
    db.db
        .collection::<Document>("changes")
        .find(doc! {})
        .sort(doc! { "seq": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// The natural keys of `events` of `kind` in pass `pass`, sorted.
pub fn keys_of(events: &[Document], pass: i64, kind: &str) -> Vec<String> {
    let mut keys: Vec<String> = events
        .iter()
        .filter(|e| e.get_i64("pass").ok() == Some(pass) && e.get_str("kind").ok() == Some(kind))
        .map(|e| e.get_str("naturalKey").unwrap().to_owned())
        .collect();
    keys.sort();
    keys
}

/// Settles bot `shop`'s gated pass `pass` as `seedlock pass release | discard` does: what it did,
/// `None` when that pass is not gated.
pub async fn settle(
    db: &TestDb,
    pass: i64,
    how: seedlock::store::release::Settle,
) -> Option<seedlock::store::release::Settled> {
    db.store()
        .passes()
        .settle(
            &seedlock::ids::BotId::parse("shop").unwrap(),
            seedlock::ids::PassNumber::new(pass),
            how,
            chrono::Utc::now(),
        )
        .await
        .unwrap()
}
