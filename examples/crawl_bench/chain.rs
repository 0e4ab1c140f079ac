//! `chain [RUNS]`: the pagination chain — how long a hop from one listing page to the next takes
//! while the pages it reveals are fetched, with the database local and 10 ms away, against the
//! page rate's bound (the same pages from one listing page: no chain) — and the 525-page shop
//! from process start to exit next to seed 000's single-threaded reference crawler (requests +
//! SQLite) and Scrapy.
//!
//! `BENCH_BASELINE_BIN=PATH` runs another seedlock build beside `SEEDLOCK_BIN` (an A/B in one
//! run, interleaved); `BENCH_PYTHON=PATH` is a Python with `requests` and `scrapy` (set by
//! `scripts/bench/chain`), without it the other crawlers are left out.

use super::*;

/// One shape of the chain: `lists` listing pages of `per_list` products, the database `rtt`
/// away.
struct Case {
    lists: u32,
    per_list: u32,
    rtt: u64,
}

/// The cases, by their place here (`BENCH_CHAIN_CASES`). The last is the page rate's bound: the
/// 525 pages of the 25 × 20 chain with no chain to walk (one listing page of 524 products).
const CASES: [Case; 6] = [
    Case {
        lists: 25,
        per_list: 1,
        rtt: 0,
    },
    Case {
        lists: 25,
        per_list: 20,
        rtt: 0,
    },
    Case {
        lists: 25,
        per_list: 1,
        rtt: 10,
    },
    Case {
        lists: 200,
        per_list: 5,
        rtt: 0,
    },
    Case {
        lists: 200,
        per_list: 5,
        rtt: 10,
    },
    Case {
        lists: 1,
        per_list: 524,
        rtt: 0,
    },
];
/// Where the page rate's bound is in `CASES`.
const PAGE_RATE: usize = 5;

/// The seedlock builds compared: this one, and `BENCH_BASELINE_BIN` when set.
fn builds() -> Vec<(&'static str, String)> {
    let mut builds = vec![(
        "this build",
        std::env::var("SEEDLOCK_BIN").expect("SEEDLOCK_BIN"),
    )];
    if let Ok(bin) = std::env::var("BENCH_BASELINE_BIN") {
        builds.push(("baseline", bin));
    }
    builds
}

pub(crate) async fn chain(uri: &str, runs: usize) {
    let builds = builds();
    let dir = tempfile::tempdir().unwrap();
    let upstream = kit::blackhole::server_of(uri);
    println!("## The pagination chain: listing pages one after another, the products they reveal fetched meanwhile");
    println!();
    println!("One instance, fingerprint mode; the pass is `crawlPassStartedAt` to `crawlPassEndedAt`, a hop is the pass over the listing pages; the steady hop is the median gap between the writes that enqueued the listing pages one after another (their `enqueuedAt`, the server's clock: the chain's pace without the pass's first and last milliseconds). `10 ms`: the database behind the delay proxy. Runs interleaved; medians of {runs}.");
    println!();
    println!("| build | listing pages × products | RTT (ms) | run | pass (ms) | ms a hop | steady hop (ms) | records correct |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut passes: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
    let mut steady: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
    // BENCH_CHAIN_CASES=0,1 runs only those cases (by their place in `CASES`), and `shop` the
    // 525-page shop.
    let picked: Option<Vec<String>> = std::env::var("BENCH_CHAIN_CASES")
        .ok()
        .map(|v| v.split(',').map(|x| x.trim().to_owned()).collect());
    let chosen = |c: usize| picked.as_ref().is_none_or(|o| o.contains(&c.to_string()));
    let shop_too = picked
        .as_ref()
        .is_none_or(|o| o.iter().any(|x| x == "shop"));
    for run in 1..=runs {
        for (c, case) in CASES.iter().enumerate().filter(|(c, _)| chosen(*c)) {
            for (b, (name, bin)) in builds.iter().enumerate() {
                let proxy = (case.rtt > 0)
                    .then(|| kit::delay::Delay::start(&upstream, Duration::from_millis(case.rtt)));
                let through = proxy.as_ref().map_or(uri.to_owned(), |p| p.uri(uri));
                let shop = Shop::start(case.lists, case.per_list).await;
                let db = fresh_db(uri, "chain").await;
                let run_of = Run {
                    crawl: &std::env::var("BENCH_CRAWL").unwrap_or_default(),
                    mode: "fingerprint",
                };
                let config = config(dir.path(), &through, db.name(), &shop.base, &run_of);
                let crawl = crawl_measured_by(bin, &config, &db, 1).await;
                let truth = shop.truth().await;
                let (_, _, correct) = judge_records(&db, &truth).await;
                let ms = crawl.pass.as_secs_f64() * 1e3;
                passes.entry((c, b)).or_default().push(ms);
                let hop = steady_hop(&db).await;
                steady.entry((c, b)).or_default().push(hop);
                println!(
                    "| {name} | {} × {} | {} | {run} | {ms:.0} | {:.1} | {} | {correct}/{} |",
                    case.lists,
                    case.per_list,
                    case.rtt,
                    ms / f64::from(case.lists),
                    gap(hop),
                    truth.len()
                );
                let _ = db.drop().await;
            }
        }
    }
    let floor = fetch_floor(25).await;
    println!();
    println!("The chain's floor, no database: the 25 listing pages fetched one after another, the next link found by a string search: **{floor:.2} ms a hop** (median of 5).");
    println!();
    println!("| build | listing pages × products | RTT (ms) | median pass (ms) | ms a hop | steady hop (ms) |");
    println!("|---|---|---|---|---|---|");
    let mut medians: HashMap<(usize, usize), f64> = HashMap::new();
    for (c, case) in CASES.iter().enumerate().filter(|(c, _)| chosen(*c)) {
        for (b, (name, _)) in builds.iter().enumerate() {
            let m = median(passes.get_mut(&(c, b)).unwrap());
            medians.insert((c, b), m);
            let hop = median(steady.get_mut(&(c, b)).unwrap());
            println!(
                "| {name} | {} × {} | {} | {m:.0} | {:.1} | {} |",
                case.lists,
                case.per_list,
                case.rtt,
                m / f64::from(case.lists),
                gap(hop)
            );
        }
    }
    println!();
    for (b, (name, _)) in builds.iter().enumerate().filter(|_| picked.is_none()) {
        println!(
            "- {name}: 25 pages with 20 products against 1 product, local: **{:.2}×** (the page rate's bound, the same 525 pages from one listing page against 1 product: {:.2}×; the chain of 20 against that bound: {:.2}×); a hop of the one-product chain 10 ms away: **{:.1} ms** (the floor + {:.1} ms).",
            medians[&(1, b)] / medians[&(0, b)],
            medians[&(PAGE_RATE, b)] / medians[&(0, b)],
            medians[&(1, b)] / medians[&(PAGE_RATE, b)],
            medians[&(2, b)] / 25.0,
            medians[&(2, b)] / 25.0 - floor
        );
    }
    if shop_too {
        println!();
        whole_shop(uri, &upstream, dir.path(), &builds, runs).await;
    }
}

/// The median gap, in ms on the server's clock, between the writes that enqueued a pass's listing
/// pages one after another (`enqueuedAt`): the chain's pace, without the pass's start and end.
async fn steady_hop(db: &mongodb::Database) -> f64 {
    let mut cursor = db
        .collection::<Document>("frontier")
        .find(doc! { "kind": "list" })
        .projection(doc! { "enqueuedAt": 1 })
        .await
        .unwrap();
    let mut at = Vec::new();
    while let Some(d) = cursor.try_next().await.unwrap() {
        if let Ok(t) = d.get_datetime("enqueuedAt") {
            at.push(t.timestamp_millis());
        }
    }
    at.sort_unstable();
    let mut gaps: Vec<f64> = at.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
    if gaps.is_empty() {
        return f64::NAN;
    }
    median(&mut gaps)
}

/// A steady hop for the table: "–" where the shop has one listing page (no hop).
fn gap(hop: f64) -> String {
    if hop.is_nan() {
        "–".to_owned()
    } else {
        format!("{hop:.1}")
    }
}

/// The 25 listing pages of a shop fetched one after another, each next link found by a string
/// search: ms a hop (median of 5 walks).
async fn fetch_floor(lists: u32) -> f64 {
    let shop = Shop::start(lists, 20).await;
    let http = reqwest::Client::new();
    let mut walks = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let mut next = Some("/list/1".to_owned());
        let mut hops = 0;
        while let Some(path) = next.take() {
            let page = http
                .get(format!("{}{path}", shop.base))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            hops += 1;
            next = next_listing_path(&page).map(str::to_owned);
        }
        assert_eq!(hops, lists, "the walk reached every listing page");
        walks.push(started.elapsed().as_secs_f64() * 1e3 / f64::from(lists));
    }
    median(&mut walks)
}

/// The 525-page shop (25 listing pages, 500 products) from process start to exit: seedlock
/// (each build, with the database local and 10 ms away — the pass's first and last
/// milliseconds are mostly round trips), the reference crawler and Scrapy, interleaved; medians
/// of `runs`.
async fn whole_shop(
    uri: &str,
    upstream: &str,
    dir: &Path,
    builds: &[(&'static str, String)],
    runs: usize,
) {
    let python = std::env::var("BENCH_PYTHON").ok();
    println!("## The 525-page shop from process start to exit (25 listing pages, 500 products)");
    println!();
    println!("seedlock: `run --once`, one instance, local database, from spawning the process to its exit. The reference crawler: seed 000's module (requests + SQLite, one page at a time, `scripts/bench/reference_crawler.py`). Scrapy: a spider with its default settings (`scripts/bench/scrapy_shop.py`), items to a JSON-lines feed. Runs interleaved; medians of {runs}.");
    println!();
    println!("| crawler | run | wall (ms) | records |");
    println!("|---|---|---|---|");
    let mut walls: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut phases: BTreeMap<String, [Vec<f64>; 4]> = BTreeMap::new();
    for run in 1..=runs {
        for ((name, bin), rtt) in builds.iter().flat_map(|b| [(b, 0), (b, 10)]) {
            let proxy =
                (rtt > 0).then(|| kit::delay::Delay::start(upstream, Duration::from_millis(rtt)));
            let through = proxy.as_ref().map_or(uri.to_owned(), |p| p.uri(uri));
            let shop = Shop::start(25, 20).await;
            let db = fresh_db(uri, "shop525").await;
            let run_of = Run {
                crawl: "",
                mode: "fingerprint",
            };
            let config = config(dir, &through, db.name(), &shop.base, &run_of);
            let crawl = crawl_measured_by(bin, &config, &db, 1).await;
            let truth = shop.truth().await;
            let (_, _, correct) = judge_records(&db, &truth).await;
            let ms = crawl.wall.as_secs_f64() * 1e3;
            let who = match rtt {
                0 => format!("seedlock, {name}"),
                _ => format!("seedlock, {name}, database {rtt} ms away"),
            };
            println!(
                "| {who} | {run} | {ms:.0} | {correct}/{} correct |",
                truth.len()
            );
            if let Some(split) = phases_of(&crawl, &shop, &db).await {
                let into = phases.entry(who.clone()).or_default();
                for (all, one) in into.iter_mut().zip(split) {
                    all.push(one);
                }
            }
            walls.entry(who).or_default().push(ms);
            let _ = db.drop().await;
        }
        let Some(python) = &python else { continue };
        for (name, script) in [
            ("reference crawler", "scripts/bench/reference_crawler.py"),
            ("Scrapy", "scripts/bench/scrapy_shop.py"),
        ] {
            let shop = Shop::start(25, 20).await;
            let work = tempfile::tempdir().unwrap();
            let started = Instant::now();
            let out = Command::new(python)
                .arg(script)
                .arg(&shop.base)
                .arg(work.path())
                .stderr(std::process::Stdio::inherit())
                .output()
                .await
                .expect("run the Python crawler");
            let ms = started.elapsed().as_secs_f64() * 1e3;
            assert!(out.status.success(), "{name} failed");
            let records = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            println!("| {name} | {run} | {ms:.0} | {records} |");
            walls.entry(name.to_owned()).or_default().push(ms);
        }
    }
    println!();
    println!("| crawler | median wall (ms) | against seedlock, this build |");
    println!("|---|---|---|");
    let ours = median(walls.get_mut("seedlock, this build").unwrap());
    for (name, values) in &mut walls {
        let m = median(values);
        println!("| {name} | {m:.0} | {:.2}× |", m / ours);
    }
    println!();
    println!("Where seedlock's wall goes (medians, ms): from spawning the process to the shop's first page request; from there to the last page's commit (its `doneAt`); from that commit to the pass recorded finished (the evaluation's `evaluatedAt`, the server's clock); from there to the process's exit.");
    println!();
    println!("| crawler | start → first fetch | crawl → last commit | last commit → pass finished | finished → exit |");
    println!("|---|---|---|---|---|");
    for (name, mut split) in phases {
        let m: Vec<String> = split
            .iter_mut()
            .map(|v| format!("{:.0}", median(v)))
            .collect();
        println!("| {name} | {} |", m.join(" | "));
    }
    if python.is_none() {
        println!();
        println!("(BENCH_PYTHON unset: the reference crawler and Scrapy were not run.)");
    }
}

/// A run's wall in four phases, in ms: spawn → the shop's first page request → the last commit
/// (the frontier's latest `doneAt`) → the pass recorded finished (`crawlLastPass.evaluatedAt`)
/// → exit. `None` when a mark is missing (then the run is left out of the split).
async fn phases_of(crawl: &Crawl, shop: &Shop, db: &Database) -> Option<[f64; 4]> {
    let spawned = crawl.spawned_at.timestamp_micros() as f64 / 1e3;
    let exited = spawned + crawl.wall.as_secs_f64() * 1e3;
    let first = *shop.page_times().await.iter().min()? as f64;
    let last_commit = db
        .collection::<Document>("frontier")
        .find_one(doc! { "doneAt": { "$exists": true } })
        .sort(doc! { "doneAt": -1 })
        .await
        .ok()??
        .get_datetime("doneAt")
        .ok()?
        .timestamp_millis() as f64;
    let finished = db
        .collection::<Document>("bots")
        .find_one(doc! { "_id": "shop" })
        .await
        .ok()??
        .get_document("crawlLastPass")
        .ok()?
        .get_datetime("evaluatedAt")
        .ok()?
        .timestamp_millis() as f64;
    Some([
        first - spawned,
        last_commit - first,
        finished - last_commit,
        exited - finished,
    ])
}
