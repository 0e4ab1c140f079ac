//! Ceilings for the crawl benchmark, measured on the same machine in the same run as seedlock:
//!
//! - `db [PAGES] [BATCH]`: the database's ceiling — the least database work a crawl of PAGES
//!   detail pages needs, with nothing else in the way: a minimal loop that leases BATCH pending
//!   URLs with one `find` + one `update` (many ids), reads their records with one `find`, writes
//!   them with one `update` command of many statements and marks the URLs done (each fenced on
//!   its lease token) with another. The frontier is filled before the clock starts; the
//!   frontier's indexes are seedlock's own (`Store::ensure_frontier_indexes`).
//! - `http BASE [PAGES] [CONCURRENCY]`: the HTTP ceiling — fetch-only: listing pages one after
//!   the other, each one's product pages CONCURRENCY at a time, bodies read, nothing parsed or
//!   stored.
//!
//! Prints one line: `ceiling=<db|http> pages=N seconds=S pages_per_s=R`.

use std::time::{Duration, Instant};

use bson::{doc, Bson, Document};
use futures_util::{StreamExt, TryStreamExt};
use mongodb::Client;

async fn db_ceiling(uri: &str, pages: usize, batch: usize) -> (usize, Duration) {
    let client = Client::with_uri_str(uri).await.expect("client");
    let db = client.database(&format!("ceiling_{:08x}", rand::random::<u32>()));
    let store = seedlock::store::Store::new(db.clone());
    store.ensure_frontier_indexes().await.expect("indexes");
    store.ensure_record_indexes().await.expect("indexes");
    let bot = seedlock::ids::BotId::parse("ceiling").unwrap();
    let urls: Vec<seedlock::urls::NormalizedUrl> = (0..pages)
        .map(|i| {
            seedlock::urls::NormalizedUrl::parse(&format!("http://shop.test/product/{i}")).unwrap()
        })
        .collect();
    let fill = Instant::now();
    store
        .enqueue(
            &bot,
            1,
            seedlock::store::frontier::PageKind::Detail,
            &urls,
            chrono::Utc::now(),
        )
        .await
        .expect("fill");
    eprintln!("fill (upserts): {:?}", fill.elapsed());
    if std::env::var("CEILING_FILL_INSERT").is_ok() {
        let fill = Instant::now();
        let now = bson::DateTime::now();
        let docs: Vec<Document> = (0..pages).map(|i| doc! { "_id": format!("x{i}"), "botId": "ceiling", "url": format!("http://shop.test/product/x{i}"), "kind": "detail", "pass": 1_i64, "status": "done", "attempts": 0_i64, "sheds": 0_i64, "leaseOwner": Bson::Null, "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "lastError": Bson::Null, "enqueuedAt": now, "notBefore": now, "slot": (i % 1024) as i64, "host": "shop.test:80", "priority": 0_i64, "listFingerprint": "f", "discoveredAt": now }).collect();
        for chunk in docs.chunks(100) {
            db.run_command(doc! { "insert": "frontier", "documents": chunk, "ordered": false })
                .await
                .unwrap();
        }
        eprintln!("fill (inserts, 100 a command): {:?}", fill.elapsed());
    }
    let frontier = db.collection::<Document>("frontier");
    if let Ok(drop) = std::env::var("CEILING_DROP") {
        for name in drop.split(',') {
            frontier.drop_index(name).await.expect("drop index");
        }
    }
    let multi_marks = std::env::var("CEILING_MULTI").is_ok();
    let started = Instant::now();
    let mut done = 0;
    let mut phases = [Duration::ZERO; 5];
    loop {
        let remaining = (pages - done).max(1);
        let k = (batch * seedlock::store::frontier::SLOTS as usize)
            .div_ceil(remaining)
            .clamp(1, 1024);
        let first = rand::random_range(0..seedlock::store::frontier::SLOTS) as i64;
        let slots: Vec<i64> = (0..k as i64).map(|i| (first + i) % 1024).collect();
        let t0 = Instant::now();
        let mut found: Vec<Document> = frontier
            .find(doc! { "botId": "ceiling", "pass": 1_i64, "status": "pending", "priority": 0_i64, "slot": { "$in": slots } })
            .limit(batch as i64)
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        if found.is_empty() {
            found = frontier
                .find(doc! { "botId": "ceiling", "pass": 1_i64, "status": "pending" })
                .limit(batch as i64)
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
        }
        if found.is_empty() {
            break;
        }
        phases[0] += t0.elapsed();
        let t0 = Instant::now();
        let ids: Vec<Bson> = found
            .iter()
            .map(|d| d.get("_id").unwrap().clone())
            .collect();
        let token = format!("{:032x}", rand::random::<u128>());
        let now = bson::DateTime::now();
        frontier
            .update_many(
                doc! { "_id": { "$in": &ids }, "status": "pending" },
                doc! { "$set": { "status": "leased", "leaseToken": &token, "leaseExpiresAt": now, "leasedAt": now }, "$inc": { "attempts": 1_i64 } },
            )
            .await
            .unwrap();
        phases[1] += t0.elapsed();
        let t0 = Instant::now();
        let record_ids: Vec<String> = ids
            .iter()
            .map(|id| format!("r{}", id.as_str().unwrap()))
            .collect();
        let _stored: Vec<Document> = db
            .collection::<Document>("records")
            .find(doc! { "_id": { "$in": &record_ids } })
            .projection(doc! { "contentHash": 1, "fetchedAt": 1 })
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        phases[2] += t0.elapsed();
        let t0 = Instant::now();
        let writes: Vec<Document> = record_ids
            .iter()
            .map(|id| {
                doc! {
                    "q": { "_id": id, "contentHash": { "$exists": false } },
                    "u": { "$set": { "botId": "ceiling", "naturalKey": id, "data": { "title": "t", "price": "$1.00", "status": "in stock" }, "contentHash": "h", "firstSeen": now, "lastChanged": now, "lastSeen": now, "fetchedAt": now, "removedAt": Bson::Null }, "$max": { "lastSeenPass": 1_i64 } },
                    "upsert": true,
                }
            })
            .collect();
        if std::env::var("CEILING_INSERT").is_ok() {
            let docs: Vec<Document> = record_ids.iter().map(|id| doc! { "_id": id, "botId": "ceiling", "naturalKey": id, "data": { "title": "t", "price": "$1.00", "status": "in stock" }, "contentHash": "h", "firstSeen": now, "lastChanged": now, "lastSeen": now, "fetchedAt": now, "removedAt": Bson::Null, "lastSeenPass": 1_i64 }).collect();
            db.run_command(doc! { "insert": "records", "documents": docs, "ordered": false })
                .await
                .unwrap();
        } else {
            db.run_command(doc! { "update": "records", "updates": writes, "ordered": false })
                .await
                .unwrap();
        }
        phases[3] += t0.elapsed();
        let t0 = Instant::now();
        let marks: Vec<Document> = ids
            .iter()
            .map(|id| {
                doc! {
                    "q": { "_id": id, "status": "leased", "leaseToken": &token },
                    "u": { "$set": { "status": "done", "doneAt": now, "leaseOwner": Bson::Null, "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "recordId": "r" } },
                }
            })
            .collect();
        if std::env::var("CEILING_PIPE").is_ok() {
            let etags: Vec<Bson> = ids
                .iter()
                .map(|id| Bson::String(format!("e{}", id.as_str().unwrap())))
                .collect();
            let recs: Vec<Bson> = record_ids
                .iter()
                .map(|id| Bson::String(id.clone()))
                .collect();
            let pick = |values: &Vec<Bson>| doc! { "$arrayElemAt": [ { "$literal": values }, { "$indexOfArray": [ { "$literal": &ids }, "$_id" ] } ] };
            let toks: Vec<Bson> = ids.iter().map(|_| Bson::String(token.clone())).collect();
            let r = frontier.update_many(doc! { "_id": { "$in": &ids }, "botId": "ceiling", "status": "leased", "$expr": { "$eq": [ "$leaseToken", pick(&toks) ] } },
                vec![doc! { "$set": { "status": "done", "doneAt": now, "leaseOwner": Bson::Null, "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "recordId": pick(&recs), "etag": pick(&etags), "fingerprint": "$listFingerprint", "lastLeaseToken": pick(&toks) } }]).await.unwrap();
            assert_eq!(r.matched_count as usize, ids.len());
        } else if multi_marks {
            frontier.update_many(doc! { "_id": { "$in": &ids }, "status": "leased", "leaseToken": &token },
                doc! { "$set": { "status": "done", "doneAt": now, "leaseOwner": Bson::Null, "leaseToken": Bson::Null, "leaseExpiresAt": Bson::Null, "recordId": "r" } }).await.unwrap();
        } else {
            db.run_command(doc! { "update": "frontier", "updates": marks, "ordered": false })
                .await
                .unwrap();
        }
        phases[4] += t0.elapsed();
        done += ids.len();
    }
    let took = started.elapsed();
    eprintln!("phases (find lease, update lease, read records, write records, marks): {phases:?}");
    let _ = db.drop().await;
    (done, took)
}

async fn http_ceiling(base: &str, pages: usize, concurrency: usize) -> (usize, Duration) {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut fetched = 0;
    let mut list = 1;
    while fetched < pages {
        let body = client
            .get(format!("{base}/list/{list}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        fetched += 1;
        let products: Vec<String> = body
            .split("href=\"/product/")
            .skip(1)
            .filter_map(|s| s.split('"').next())
            .map(|sku| format!("{base}/product/{sku}"))
            .collect();
        if products.is_empty() {
            break;
        }
        let got: Vec<usize> = futures_util::stream::iter(products)
            .map(|url| {
                let client = client.clone();
                async move {
                    let _ = client.get(url).send().await.unwrap().bytes().await.unwrap();
                    1
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        fetched += got.len();
        list += 1;
    }
    (fetched, started.elapsed())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (what, (pages, took)) = match args.first().map(String::as_str) {
        Some("db") => {
            let uri = std::env::var("MONGODB_URI").expect("MONGODB_URI");
            ("db", db_ceiling(&uri, arg(1, 10_000), arg(2, 50)).await)
        }
        Some("http") => {
            let base = args.get(1).expect("ceiling http BASE").clone();
            (
                "http",
                http_ceiling(&base, arg(2, 10_000), arg(3, 16)).await,
            )
        }
        _ => {
            eprintln!(
                "usage: ceiling db [PAGES] [BATCH] | ceiling http BASE [PAGES] [CONCURRENCY]"
            );
            std::process::exit(2);
        }
    };
    println!(
        "ceiling={what} pages={pages} seconds={:.3} pages_per_s={:.0}",
        took.as_secs_f64(),
        pages as f64 / took.as_secs_f64()
    );
}
