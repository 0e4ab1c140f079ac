//! No cursor left open on the server: two passes of a shop, with transactions off and on, leave
//! the server's open cursors where they were. (A raw `find` whose batch the answer fills exactly
//! leaves its cursor open until the server's idle timeout, ten minutes on MongoDB.)

use crate::kit;

use std::time::Duration;

use bson::{doc, Document};
use futures_util::TryStreamExt;
use kit::crawl::*;
use kit::{eventually, test_db_at, OwnServer};
use seedlock::daemon::{run_with_store, Mode};
use seedlock::store::Store;
use tokio_util::sync::CancellationToken;

/// Cursors open on the server now: all of them on a server of this test's own (`serverStatus`),
/// else those on `database` (`$currentOp` of idle cursors, on a server shared with other tests).
async fn open_cursors(client: &mongodb::Client, own: bool, database: &str) -> i64 {
    let admin = client.database("admin");
    if own {
        let status = admin.run_command(doc! { "serverStatus": 1 }).await.unwrap();
        return status
            .get_document("metrics")
            .and_then(|m| m.get_document("cursor"))
            .and_then(|c| c.get_document("open"))
            .ok()
            .and_then(|o| seedlock::store::document::integer(o.get("total")?))
            .expect("serverStatus reports metrics.cursor.open.total");
    }
    let ops: Vec<Document> = admin
        .aggregate([
            doc! { "$currentOp": { "idleCursors": true, "allUsers": true } },
            doc! { "$match": { "type": "idleCursor", "ns": { "$regex": format!("^{database}\\.") } } },
        ])
        .await
        .expect("$currentOp")
        .try_collect()
        .await
        .unwrap();
    ops.len() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_passes_with_transactions_off_and_on_leave_no_cursor_open() {
    let own_dir = tempfile::tempdir().unwrap();
    let server = match OwnServer::available() {
        Some(bin) => Some(OwnServer::start(bin, own_dir.path()).await),
        None => None,
    };
    let uri = server
        .as_ref()
        .map_or_else(kit::mongodb_uri, |s| s.uri.clone());
    let db = test_db_at(&uri, "cursors").await;
    let client = mongodb::Client::with_uri_str(&uri).await.unwrap();
    let before = open_cursors(&client, server.is_some(), &db.name).await;
    let base = shop(10, 20).await;
    for transactions in ["off", "on"] {
        for _pass in 0..2 {
            let setup = Setup {
                transactions,
                ..Setup::default()
            };
            let settings = settings(&db, &base, &setup, "a");
            let store = Store::connect(&settings.mongo).await.expect("connect");
            run_with_store(
                settings,
                store,
                Mode::Once {
                    timeout: Duration::from_secs(60),
                },
                CancellationToken::new(),
            )
            .await
            .expect("the pass finishes");
            request_refresh(&db).await;
        }
    }
    assert_eq!(live_records(&db).await, truth(&base).await);
    // Killing a dropped cursor is sent by the driver in the background: await it, boundedly.
    let open = || async { open_cursors(&client, server.is_some(), &db.name).await };
    eventually(
        "the server's open cursors back where they were",
        Duration::from_secs(10),
        || async { open().await <= before },
    )
    .await;
}
