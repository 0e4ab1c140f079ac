//! The database: a fresh one per test on the server `MONGODB_URI` names, and a server of the
//! test's own that it can stop and restart.

use super::*;

pub fn mongodb_uri() -> String {
    std::env::var("MONGODB_URI").expect("MONGODB_URI is not set: run the suite with scripts/test")
}

pub struct TestDb {
    pub uri: String,
    pub name: String,
    pub db: Database,
}

/// A database of its own for one test, on the server named by `MONGODB_URI` (or `uri`).
pub async fn test_db(hint: &str) -> TestDb {
    test_db_at(&mongodb_uri(), hint).await
}

pub async fn test_db_at(uri: &str, hint: &str) -> TestDb {
    let suffix: u32 = rand::random();
    let mut name = format!("sl_{hint}_{suffix:08x}");
    name.truncate(60);
    let client = Client::with_uri_str(uri)
        .await
        .expect("a client for the test server");
    let db = client.database(&name);
    TestDb {
        uri: uri.to_owned(),
        name,
        db,
    }
}

impl TestDb {
    pub fn bots(&self) -> Collection<Document> {
        self.db.collection("bots")
    }

    pub async fn doc(&self, bot: &str) -> Option<Document> {
        self.bots()
            .find_one(doc! {"_id": bot})
            .await
            .expect("read the bot document")
    }

    pub async fn epoch(&self, bot: &str) -> i64 {
        let doc = self.doc(bot).await.expect("bot document exists");
        seedlock::store::document::integer(doc.get("lockEpoch").expect("lockEpoch"))
            .expect("integer epoch")
    }

    /// Writes the bot document `d` (its `_id` names the bot) as it is, replacing any.
    pub async fn put_bot(&self, d: Document) {
        let id = d.get("_id").cloned().expect("a bot document has an _id");
        self.bots()
            .replace_one(doc! {"_id": id}, d)
            .upsert(true)
            .await
            .unwrap();
    }

    pub async fn history(&self, bot: &str) -> Vec<Document> {
        let doc = self.doc(bot).await.expect("bot document exists");
        doc.get_array("history")
            .map(|a| a.iter().filter_map(|h| h.as_document().cloned()).collect())
            .unwrap_or_default()
    }

    pub fn store(&self) -> Store {
        Store::new(self.db.clone())
    }
}

/// Starts a SecantusDB server of this test's own on `storage` (for restarts). None when the
/// suite runs against an outside `MONGODB_URI` without the binary.
pub struct OwnServer {
    pub uri: String,
    port: u16,
    storage: PathBuf,
    child: Option<std::process::Child>,
    bin: PathBuf,
}

impl OwnServer {
    pub fn available() -> Option<PathBuf> {
        std::env::var_os("SEEDLOCK_TEST_SERVER_BIN")
            .map(PathBuf::from)
            .filter(|p| p.exists())
    }

    pub async fn start(bin: PathBuf, storage: &Path) -> OwnServer {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut server = OwnServer {
            uri: format!("mongodb://127.0.0.1:{port}/?directConnection=true"),
            port,
            storage: storage.to_owned(),
            child: None,
            bin,
        };
        server.restart().await;
        server
    }

    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the server first");
        let child = std::process::Command::new(&self.bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--log-level",
                "WARNING",
            ])
            .args([
                "--log-file-max",
                "16MB",
                "--cache-size",
                "256M",
                "--storage-path",
            ])
            .arg(&self.storage)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start secantusd-rs");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        eventually(
            "the restarted server accepts connections",
            Duration::from_secs(30),
            || {
                let addr = addr.clone();
                async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
            },
        )
        .await;
    }

    /// Stops the server as an operator would: SIGTERM, SIGKILL after 10 s.
    pub async fn stop_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
    }
}
