//! The chaos run's processes: seedlock instances, the shops, and the database it may restart.

use super::*;

pub(super) struct Instance {
    pub(super) name: String,
    pub(super) child: Child,
    /// Its own way to the database, cut during a partition (with the run's own server).
    pub(super) proxy: Option<crate::kit::blackhole::Blackhole>,
    pub(super) stopped: bool,
    /// Cut off from the database by the harness.
    pub(super) cut: bool,
    /// SIGKILLed by the harness.
    pub(super) killed: bool,
}

impl Instance {
    pub(super) fn pid(&self) -> Option<Pid> {
        self.child.id().map(|id| Pid::from_raw(id as i32))
    }
    pub(super) fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(pid, sig);
        }
    }
}

pub(super) struct Shop {
    pub(super) base: String,
    pub(super) lists: u32,
    pub(super) child: Child,
}

pub(super) async fn start_shop(cfg: &ChaosConfig, prefix: &str, seed: u64) -> Shop {
    let lists = cfg.products_per_shop.div_ceil(cfg.per_list);
    let out = cfg.dir.join(format!("shop-{prefix}.out"));
    let child = Command::new(&cfg.seedlock_bin)
        .args(["demo-site", "--addr", "127.0.0.1:0"])
        .args(["--lists", &lists.to_string()])
        .args(["--per-list", &cfg.per_list.to_string()])
        .args(["--seed", &seed.to_string(), "--sku-prefix", prefix])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(cfg.dir.join(format!("shop-{prefix}.log"))).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start the demo shop");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(at) = text.find("http://") {
            let base = text[at..].split_whitespace().next().unwrap().to_owned();
            return Shop { base, lists, child };
        }
        assert!(Instant::now() < deadline, "the demo shop did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The run's database: a server of its own (restartable), or an outside one.
pub(super) struct Database {
    pub(super) uri: String,
    pub(super) own: Option<crate::kit::OwnServer>,
}

impl Database {
    pub(super) async fn start(cfg: &ChaosConfig) -> Database {
        match (&cfg.server_bin, &cfg.uri) {
            (Some(bin), _) => {
                let own = crate::kit::OwnServer::start(bin.clone(), &cfg.dir.join("db")).await;
                Database {
                    uri: own.uri.clone(),
                    own: Some(own),
                }
            }
            (None, Some(uri)) => Database {
                uri: uri.clone(),
                own: None,
            },
            (None, None) => panic!("chaos: give a server binary or a MONGODB_URI"),
        }
    }

    pub(super) fn restartable(&self) -> bool {
        self.own.is_some()
    }

    /// Stops the server (SIGTERM; SIGKILL after 10 s), then starts it again on the same
    /// storage and port after `down_for`.
    pub(super) async fn restart(&mut self, down_for: Duration) {
        if let Some(own) = self.own.as_mut() {
            own.stop_gracefully().await;
            tokio::time::sleep(down_for).await;
            own.restart().await;
        }
    }
}
