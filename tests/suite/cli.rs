//! The command line's contract: exit codes, one clear line on bad input, no password printed,
//! and the admin views against a real server.

// Document fields read best as `field == value`.
#![allow(clippy::bool_assert_comparison)]

use crate::kit;

use std::process::Output;
use std::time::Duration;

use kit::*;

fn seedlock(config: &std::path::Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_seedlock"))
        .arg("-c")
        .arg(config)
        .args(args)
        .env_remove("MONGODB_URI")
        .env_remove("SEEDLOCK_DATABASE")
        .output()
        .expect("run seedlock")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn write(dir: &tempfile::TempDir, text: &str) -> std::path::PathBuf {
    let path = dir.path().join("seedlock.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn bad_config_exits_2_with_one_line_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[lock]\nttl = \"forever\"\n", "lock.ttl"),
        (
            "[[bots]]\nid = \"shop\"\nseeds = { url = \"http://x/s.txt\", format = \"xml\" }\n",
            "seeds",
        ),
        ("[mongo\nuri = 1", "TOML"),
        (
            "[[bots]]\nid = \"shop\"\nseeds = [\"http://x/\"]\nrefresh = \"weekly\"\n",
            "bots[0].refresh",
        ),
    ];
    for (text, key) in cases {
        let config = write(&dir, text);
        let out = seedlock(&config, &["run", "--once"]);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "one line for {text:?}: {err}");
        assert!(err.starts_with("seedlock: config "), "{err}");
        assert!(
            err.to_lowercase().contains(&key.to_lowercase()),
            "{text:?} should name {key}: {err}"
        );
        assert!(!err.contains("panicked"));
    }
    let out = seedlock(&dir.path().join("absent.toml"), &["status"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("cannot read the file"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn unreachable_database_exits_2_without_printing_the_password() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        &dir,
        "[mongo]\nuri = \"mongodb://admin:hunter2@127.0.0.1:1/?directConnection=true\"\nconnect_timeout = \"1s\"\n[[bots]]\nid = \"shop\"\nseeds = [\"http://x/\"]\n",
    );
    for args in [&["run", "--once"][..], &["status"], &["unlock", "shop"]] {
        let out = seedlock(&config, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("cannot reach MongoDB at mongodb://admin:***@127.0.0.1:1"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
}

#[test]
fn a_bad_bot_argument_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(&dir, "");
    let out = seedlock(&config, &["inspect", "no such bot"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("bot id"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_inspect_refresh_and_unlock_against_the_server() {
    let db = test_db("cli").await;
    let source = SeedSourceServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = ProcConfig::new(
        &db,
        url_bot("shop", &source.url()) + &url_bot("later", &source.url()),
    )
    .write(dir.path());
    // Only "shop" runs; "later" is configured but has no document yet.
    let only_shop = ProcConfig::new(&db, url_bot("shop", &source.url())).write(dir.path());
    let mut run = Proc::spawn(dir.path(), &only_shop, "i1", &["run", "--once"], &[]);
    run.expect_ok(Duration::from_secs(30)).await;

    let out = seedlock(&config, &["status"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let shop = table
        .lines()
        .find(|l| l.starts_with("shop "))
        .expect("a shop row");
    assert!(shop.contains("ready") && shop.contains(" 2 "), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("later ") && l.contains("missing")),
        "{table}"
    );

    let out = seedlock(&config, &["status", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["bot"], "shop");
    assert_eq!(rows[0]["state"], "ready");
    assert_eq!(rows[0]["epoch"], 1);
    assert_eq!(rows[0]["seeds"], 2);

    let out = seedlock(&config, &["inspect", "shop"]);
    let text = stdout(&out);
    assert!(
        text.contains("\"isReady\": true") && text.contains("refreshed"),
        "{text}"
    );

    let out = seedlock(&config, &["unlock", "shop"]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("not locked"), "{}", stdout(&out));

    let out = seedlock(&config, &["refresh", "shop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut run = Proc::spawn(dir.path(), &only_shop, "i2", &["run", "--once"], &[]);
    run.expect_ok(Duration::from_secs(30)).await;
    assert_eq!(
        source.hits(),
        2,
        "the requested refresh happened on the next run"
    );
    assert!(run.out().contains("shop ready epoch=2"), "{}", run.out());

    let out = seedlock(&config, &["refresh", "later"]);
    assert_eq!(out.status.code(), Some(1), "no document: {}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_gives_up_with_exit_1_after_its_timeout() {
    let db = test_db("timeout").await;
    let source = SeedSourceServer::start().await;
    source.stall_first(1);
    let dir = tempfile::tempdir().unwrap();
    let config = ProcConfig::new(&db, url_bot("shop", &source.url())).write(dir.path());
    let mut run = Proc::spawn(
        dir.path(),
        &config,
        "i1",
        &["run", "--once", "--timeout", "1s"],
        &[],
    );
    let status = run.wait(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(1), "{}", run.log());
    assert!(
        run.log().contains("timed out after 1s: not ready: shop"),
        "{}",
        run.log()
    );
    // It stopped its work and released the lock on the way out.
    let doc = db.doc("shop").await.unwrap();
    assert_eq!(doc.get_bool("isEditing").unwrap(), false);
    source.release();
}
