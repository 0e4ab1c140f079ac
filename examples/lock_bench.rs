//! The lock benchmark (run it with `scripts/bench/lock`):
//! 1. N = 10, 50, 100 contenders, each with its own client (like separate instances), claim one
//!    bot at the same instant, round after round: exactly one winner per round; claim latency.
//! 2. Takeover after SIGKILL: a real `seedlock` holder is killed mid-refresh; time until a real
//!    waiter's takeover lands, against the lock's ttl.
//!
//! Needs `MONGODB_URI` and `SEEDLOCK_BIN` (the release binary). Prints Markdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::doc;
use chrono::Utc;
use mongodb::Client;
use seedlock::ids::{BotId, InstanceId};
use seedlock::lock::state::Claim;
use seedlock::store::Store;
use tokio::sync::Barrier;

const ROUNDS: usize = 30;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

async fn contention(uri: &str, n: usize) -> (usize, usize, Vec<Duration>, Vec<Duration>) {
    let db_name = format!("bench_lock_{n}_{:08x}", rand::random::<u32>());
    let bot = BotId::parse("bench").unwrap();
    let mut stores = Vec::with_capacity(n);
    for _ in 0..n {
        let client = Client::with_uri_str(uri).await.expect("client");
        let store = Store::new(client.database(&db_name));
        store.bots().load(&bot).await.expect("warm the connection");
        stores.push(store);
    }
    stores[0]
        .bots()
        .initialize(&bot, &InstanceId::parse("bench").unwrap(), Utc::now())
        .await
        .unwrap();
    let mut latencies = Vec::new();
    let mut winner_latencies = Vec::new();
    let mut rounds_with_one_winner = 0;
    for round in 0..ROUNDS {
        let epoch = match stores[0].bots().load(&bot).await.unwrap() {
            seedlock::lock::bot::Observed::Valid(d) => d.lock_epoch,
            other => panic!("unexpected {other:?}"),
        };
        let barrier = Arc::new(Barrier::new(n));
        let winners = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for (i, store) in stores.iter().enumerate() {
            let (store, barrier, winners, bot) =
                (store.clone(), barrier.clone(), winners.clone(), bot.clone());
            tasks.push(tokio::spawn(async move {
                let me = InstanceId::parse(&format!("c{i}")).unwrap();
                barrier.wait().await;
                let t = Instant::now();
                let lease = store
                    .bots()
                    .claim(
                        &bot,
                        &me,
                        epoch,
                        Claim::Free,
                        Utc::now(),
                        Duration::from_secs(30),
                        "bench",
                    )
                    .await
                    .expect("claim");
                let took = t.elapsed();
                if lease.is_some() {
                    winners.fetch_add(1, Ordering::SeqCst);
                }
                (took, lease)
            }));
        }
        let mut lease = None;
        for t in tasks {
            let (took, l) = t.await.unwrap();
            latencies.push(took);
            if l.is_some() {
                winner_latencies.push(took);
                lease = l;
            }
        }
        if winners.load(Ordering::SeqCst) == 1 {
            rounds_with_one_winner += 1;
        } else {
            eprintln!("round {round}: {} winners", winners.load(Ordering::SeqCst));
        }
        if let Some(lease) = lease {
            stores[0]
                .bots()
                .release(&lease, Utc::now(), "bench")
                .await
                .unwrap();
        }
    }
    latencies.sort();
    winner_latencies.sort();
    let _ = Client::with_uri_str(uri)
        .await
        .unwrap()
        .database(&db_name)
        .drop()
        .await;
    (rounds_with_one_winner, ROUNDS, latencies, winner_latencies)
}

/// A seed source whose first request never answers (the holder stalls mid-refresh).
async fn stalling_source() -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = axum::Router::new().route(
        "/seeds.txt",
        axum::routing::get(move || {
            let h = h.clone();
            async move {
                if h.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                "http://site.test/a\n"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/seeds.txt"), hits)
}

async fn takeover_once(uri: &str, bin: &str, ttl_ms: u64, poll_ms: u64) -> Duration {
    let db_name = format!("bench_takeover_{:08x}", rand::random::<u32>());
    let client = Client::with_uri_str(uri).await.unwrap();
    let bots = client
        .database(&db_name)
        .collection::<bson::Document>("bots");
    let (url, hits) = stalling_source().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("seedlock.toml");
    std::fs::write(
        &config,
        format!(
            "[mongo]\nuri = \"{uri}\"\ndatabase = \"{db_name}\"\n[lock]\nttl = \"{ttl_ms}ms\"\nmax_refresh = \"10m\"\npoll = \"{poll_ms}ms\"\n[http]\nlisten = \"off\"\n[[bots]]\nid = \"shop\"\nseeds = {{ url = \"{url}\" }}\n"
        ),
    )
    .unwrap();
    let spawn = |name: &str, args: &[&str]| {
        tokio::process::Command::new(bin)
            .arg("-c")
            .arg(&config)
            .args(args)
            .env_remove("MONGODB_URI")
            .env("SEEDLOCK_INSTANCE_ID", name)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let mut holder = spawn("holder", &["run"]);
    loop {
        let doc = bots
            .find_one(doc! {"_id": "shop", "editingBy": "holder"})
            .await
            .unwrap();
        if doc.is_some() && hits.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut waiter = spawn("waiter", &["run", "--once"]);
    // Let the waiter start and see the lock, then kill at a random phase of the heartbeat cycle.
    let delay = 500 + rand::random::<u64>() % ttl_ms;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    holder.kill().await.unwrap();
    let killed = Instant::now();
    loop {
        let took = bots
            .find_one(doc! {"_id": "shop", "history": {"$elemMatch": {"event": "took_over", "by": "waiter"}}})
            .await
            .unwrap();
        if took.is_some() {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "no takeover within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = killed.elapsed();
    let _ = waiter.wait().await;
    let _ = client.database(&db_name).drop().await;
    elapsed
}

#[tokio::main]
async fn main() {
    let uri = std::env::var("MONGODB_URI").expect("MONGODB_URI");
    let bin = std::env::var("SEEDLOCK_BIN").expect("SEEDLOCK_BIN (the release binary)");

    println!("### Contention: N instances claim one bot at once, {ROUNDS} rounds each\n");
    println!("| contenders | rounds with exactly one winner | claim p50 (ms) | claim p99 (ms) | winner p50 (ms) |");
    println!("|---:|---:|---:|---:|---:|");
    for n in [10, 50, 100] {
        let (ok, rounds, all, winners) = contention(&uri, n).await;
        println!(
            "| {n} | {ok}/{rounds} | {} | {} | {} |",
            ms(percentile(&all, 0.5)),
            ms(percentile(&all, 0.99)),
            ms(percentile(&winners, 0.5))
        );
        assert_eq!(ok, rounds, "every round must have exactly one winner");
    }

    let (ttl_ms, poll_ms) = (2_000, 200);
    let trials = 9;
    println!("\n### Takeover after SIGKILL of the holder (ttl {ttl_ms} ms, heartbeat ttl/3, poll {poll_ms} ms ±20%), {trials} trials\n");
    let mut takes = Vec::new();
    for _ in 0..trials {
        takes.push(takeover_once(&uri, &bin, ttl_ms, poll_ms).await);
    }
    takes.sort();
    let list: Vec<String> = takes.iter().map(|d| ms(*d)).collect();
    println!("Expected: between ttl − heartbeat and ttl + poll after the kill (the lock expires ttl after the last heartbeat).\n");
    println!("| kill → takeover, median (ms) | min (ms) | max (ms) | median / ttl | all (ms) |");
    println!("|---:|---:|---:|---:|---|");
    println!(
        "| {} | {} | {} | {:.2} | {} |",
        ms(percentile(&takes, 0.5)),
        ms(takes[0]),
        ms(*takes.last().unwrap()),
        percentile(&takes, 0.5).as_secs_f64() * 1000.0 / ttl_ms as f64,
        list.join(", ")
    );
}
