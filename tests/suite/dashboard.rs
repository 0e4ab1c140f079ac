//! The Grafana dashboard (deploy/grafana/dashboards/seedlock.json): every metric a panel or
//! variable queries is one seedlock exports, with the type the query's suffix implies
//! (`_total`: a counter; `_bucket`/`_sum`/`_count`: a histogram) — read from a running
//! instance's `/metrics`, so a renamed metric or a typo in a panel fails here, not on a blank
//! graph at 3 a.m. And the dashboard covers what the operator's window promises.

use crate::kit;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kit::*;
use nix::sys::signal::Signal;
use serde_json::Value;

fn queries(node: &Value, out: &mut Vec<String>) {
    match node {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "definition", Value::String(q)) => out.push(q.clone()),
                    ("query", Value::String(q)) => out.push(q.clone()),
                    _ => queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

/// `# TYPE family type` lines of an OpenMetrics exposition.
fn families(exposition: &str) -> BTreeMap<String, String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

/// The family and type a queried series name needs.
fn wanted(series: &str) -> (String, &'static str) {
    for (suffix, kind) in [
        ("_total", "counter"),
        ("_bucket", "histogram"),
        ("_sum", "histogram"),
        ("_count", "histogram"),
    ] {
        if let Some(family) = series.strip_suffix(suffix) {
            return (family.to_owned(), kind);
        }
    }
    (series.to_owned(), "gauge")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported_by_seedlock() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/dashboards/seedlock.json"
    ))
    .unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    let names = regex::Regex::new(r"\b[a-z_]+\b").unwrap();
    let queried: BTreeSet<String> = all
        .iter()
        .flat_map(|q| names.find_iter(q).map(|m| m.as_str().to_owned()))
        .filter(|n| n.starts_with("seedlock_"))
        .collect();
    assert!(queried.len() >= 25, "{queried:?}");

    // A real instance's exposition.
    let db = test_db("dashboard").await;
    let dir = tempfile::tempdir().unwrap();
    let config =
        ProcConfig::new(&db, url_bot("b", "http://127.0.0.1:9/seeds.txt")).write(dir.path());
    let mut a = Proc::spawn(
        dir.path(),
        &config,
        "dash-1",
        &["run"],
        &[("SEEDLOCK_HTTP_LISTEN", "127.0.0.1:0")],
    );
    let addr = a.http_addr().await;
    let exposition = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    a.signal(Signal::SIGTERM);
    let _ = a.wait(Duration::from_secs(30)).await;
    let exported = families(&exposition);

    let mut missing = Vec::new();
    for series in &queried {
        let (family, kind) = wanted(series);
        match exported.get(&family) {
            Some(k) if k == kind || (kind == "gauge" && k != "histogram" && k != "counter") => {}
            other => missing.push(format!(
                "{series}: wants a {kind} {family}, /metrics has {other:?}"
            )),
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");

    // What the operator's window promises: bot states, lock acquisitions and takeovers, refresh
    // durations, pages/s by result, stage depths and oldest ages, per-host limits, throttles and
    // retry ratios, and how fresh each bot's catalogue is.
    for needed in [
        "seedlock_bot_state",
        "seedlock_lock_acquisitions_total",
        "seedlock_lock_takeovers_total",
        "seedlock_refresh_duration_seconds_bucket",
        "seedlock_crawl_pages_total",
        "seedlock_crawl_stage_depth",
        "seedlock_crawl_stage_oldest_seconds",
        "seedlock_host_limit",
        "seedlock_host_throttles_total",
        "seedlock_host_retry_ratio",
        "seedlock_last_complete_pass_timestamp_seconds",
        "seedlock_pass_coverage_ratio",
        "seedlock_records_removed_total",
        "seedlock_live_records",
    ] {
        assert!(queried.contains(needed), "no panel queries {needed}");
    }
}
