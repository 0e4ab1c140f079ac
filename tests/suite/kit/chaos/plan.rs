//! The chaos run's state and its fault plan: which instance is killed, stopped or cut off when.

use super::*;

pub(super) type Bots = BTreeMap<String, Document>;

pub(super) struct Run {
    pub(super) cfg: ChaosConfig,
    pub(super) config_path: PathBuf,
    pub(super) db: mongodb::Database,
    pub(super) instances: Vec<Instance>,
    pub(super) started: u32,
    pub(super) history: HashMap<String, Vec<Document>>,
    pub(super) history_gaps: Vec<String>,
    pub(super) seen_seeds: HashMap<String, Vec<Vec<String>>>,
    /// Per crawling bot, every pass number seen current (passes that ran).
    pub(super) passes: HashMap<String, std::collections::BTreeSet<i64>>,
    /// Per crawling bot, the pass a refresh was asked for and when.
    pub(super) asked: HashMap<String, (i64, Instant)>,
    pub(super) admin_failures: Vec<String>,
    /// The run's own server (`host:port`), which each instance reaches through a proxy of its
    /// own; `None` with an outside server (partitions are skipped then).
    pub(super) upstream: Option<String>,
    pub(super) db_uri: String,
}

impl Run {
    pub(super) async fn spawn_instance(&mut self) {
        self.started += 1;
        let name = format!("i{}", self.started);
        let proxy = match &self.upstream {
            Some(upstream) => Some(crate::kit::blackhole::Blackhole::start(upstream).await),
            None => None,
        };
        let mut command = Command::new(&self.cfg.seedlock_bin);
        match &proxy {
            Some(proxy) => command.env("MONGODB_URI", proxy.uri(&self.db_uri)),
            None => command.env_remove("MONGODB_URI"),
        };
        let child = command
            .arg("-c")
            .arg(&self.config_path)
            .arg("run")
            .env_remove("SEEDLOCK_DATABASE")
            .env("SEEDLOCK_INSTANCE_ID", &name)
            .env("SEEDLOCK_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.cfg.dir.join(format!("{name}.log"))).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("start seedlock");
        self.instances.push(Instance {
            name,
            child,
            proxy,
            stopped: false,
            cut: false,
            killed: false,
        });
    }

    /// `seedlock -c CONFIG ARGS…` (an admin command); its output, or why it failed. A panic
    /// is recorded as a violation.
    pub(super) async fn admin(&mut self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.cfg.seedlock_bin)
            .arg("-c")
            .arg(&self.config_path)
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .output()
            .await
            .map_err(|e| e.to_string())?;
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if stderr.contains("panicked") {
            self.admin_failures
                .push(format!("`seedlock {}` panicked: {stderr}", args.join(" ")));
        }
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(stderr)
        }
    }

    pub(super) async fn bots(&self) -> Option<Bots> {
        let docs: Vec<Document> = tokio::time::timeout(Duration::from_secs(2), async {
            self.db
                .collection::<Document>("bots")
                .find(doc! {})
                .await?
                .try_collect()
                .await
        })
        .await
        .ok()?
        .ok()?;
        Some(
            docs.into_iter()
                .filter_map(|d| Some((d.get_str("_id").ok()?.to_owned(), d)))
                .collect(),
        )
    }

    /// Folds the documents' (capped) histories into the full record, samples the seeds of
    /// ready bots and notes the passes that ran.
    pub(super) fn observe(&mut self, bots: &Bots) {
        for (bot, d) in bots {
            let snapshot: Vec<Document> = d
                .get_array("history")
                .map(|a| a.iter().filter_map(|e| e.as_document().cloned()).collect())
                .unwrap_or_default();
            let known = self.history.entry(bot.clone()).or_default();
            match known.last() {
                None => known.extend(snapshot),
                Some(last) => match snapshot.iter().rposition(|e| e == last) {
                    Some(i) => known.extend(snapshot.into_iter().skip(i + 1)),
                    None => {
                        // The last entry seen is gone: more entries than the document keeps went
                        // by (or the database lost writes). Keep what is new; report the gap.
                        self.history_gaps.push(format!(
                            "{bot}: the history entry {last} vanished between two polls (more than the document keeps went by, or the database lost it)"
                        ));
                        let fresh: Vec<Document> = snapshot
                            .into_iter()
                            .filter(|e| !known.contains(e))
                            .collect();
                        known.extend(fresh);
                    }
                },
            }
            if d.get_bool("isReady").unwrap_or(false) {
                let seeds = seeds_of(d);
                let seen = self.seen_seeds.entry(bot.clone()).or_default();
                if seen.last() != Some(&seeds) {
                    seen.push(seeds);
                }
            }
            if let Ok(pass) = d.get_i64("crawlPass") {
                if pass > 0 {
                    self.passes.entry(bot.clone()).or_default().insert(pass);
                }
            }
        }
    }

    /// Running (not stopped) instances, by name order.
    pub(super) fn live(&mut self) -> Vec<usize> {
        (0..self.instances.len())
            .filter(|&i| {
                matches!(self.instances[i].child.try_wait(), Ok(None)) && !self.instances[i].stopped
            })
            .collect()
    }

    /// Asks for a refresh of a crawling bot whose pass ended and which nobody is refreshing;
    /// again if one asked for earlier did not start a pass within 5 s (it failed, or was lost).
    pub(super) async fn refresh_if_ended(&mut self, bot: &str, d: &Document) -> bool {
        let pass = d.get_i64("crawlPass").unwrap_or(0);
        let ended = matches!(d.get("crawlPassEndedAt"), Some(Bson::DateTime(_)));
        let quiet =
            d.get_bool("isReady").unwrap_or(false) && !d.get_bool("isEditing").unwrap_or(true);
        if pass == 0 || !ended || !quiet {
            return false;
        }
        if let Some((asked, at)) = self.asked.get(bot) {
            if *asked == pass && at.elapsed() < Duration::from_secs(5) {
                return false;
            }
        }
        if self.admin(&["refresh", bot]).await.is_ok() {
            self.asked.insert(bot.to_owned(), (pass, Instant::now()));
            return true;
        }
        false
    }
}

pub(super) fn seeds_of(d: &Document) -> Vec<String> {
    d.get_array("seeds")
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn config_toml(
    uri: &str,
    database: &str,
    transactions: &str,
    sources: &SeedSources,
    shops: &[&Shop; 2],
) -> String {
    let mut s = format!(
        r#"[mongo]
uri = "{uri}"
database = "{database}"
connect_timeout = "20s"
op_timeout = "3s"
[lock]
ttl = "{ttl}s"
max_refresh = "20s"
poll = "200ms"
[refresh]
timeout = "3s"
attempts = 2
backoff_base = "200ms"
backoff_max = "1s"
[crawl]
workers = {WORKERS}
parse_queue = {PARSE_QUEUE}
parsers = {PARSERS}
store_queue = {STORE_QUEUE}
writers = {WRITERS}
max_uncommitted = {IN_FLIGHT_CAP}
lease = "8s"
timeout = "4s"
attempts = 10
backoff_base = "100ms"
backoff_max = "1s"
transactions = "{transactions}"
[http]
listen = "127.0.0.1:0"
[log]
format = "json"
"#,
        ttl = TTL.as_secs()
    );
    for (bot, shop) in CRAWLING.iter().zip(shops) {
        let host = shop.base.trim_start_matches("http://");
        let _ = write!(
            s,
            // Several mutations between two passes may delete more than the drift gate's 10%:
            // the run checks that every deletion is applied, so no pass is gated for it.
            "\n[[bots]]\nid = \"{bot}\"\nseeds = {{ url = \"{url}\", format = \"lines\" }}\nrefresh = \"7d\"\n{rules}[bots.crawl.drift]\nmax_removed = 1.0\n",
            url = sources.url(bot),
            rules = seedlock::demo_site::crawl_rules_toml(&[host], ".sku"),
        );
    }
    let _ = write!(
        s,
        "\n[[bots]]\nid = \"{SEEDS_ONLY}\"\nseeds = {{ url = \"{}\", format = \"lines\" }}\nrefresh = \"3s\"\n",
        sources.url(SEEDS_ONLY)
    );
    s
}

/// Every fault of a run, drawn from the seed before it starts: the same seed, the same plan.
/// (What a fault hits — which instance holds a lock at that moment — depends on timing.)
#[derive(Debug)]
pub(super) struct Plan {
    /// SIGKILL times (s) and, for each, a number choosing the victim among the live instances.
    pub(super) kills: Vec<(f64, u64)>,
    /// SIGSTOP of a lock holder: when to start looking for one, and for how long past ttl.
    pub(super) stops: Vec<(f64, f64)>,
    /// Partitions of one instance from the database: when (a lock holder's if there is one,
    /// else a live instance chosen by the number), and for how long past ttl.
    pub(super) partitions: Vec<(f64, f64, u64)>,
    pub(super) unlocks: Vec<f64>,
    /// The database restart: when, and how long it stays down (ms).
    pub(super) restart: (f64, u64),
    /// The seeds-only bot's source fails over this window.
    pub(super) catalog_failing: (f64, f64),
    /// One crawling bot's source fails at its first refresh asked for after this time.
    pub(super) crawl_failing: (usize, f64, f64),
    /// Shop mutations: when, and which shop.
    pub(super) mutations: Vec<(f64, usize)>,
}

impl Plan {
    pub(super) fn draw(seed: u64, chaos: f64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut kills = Vec::new();
        let mut t = rng.random_range(0.5..2.0);
        while t < chaos {
            kills.push((t, rng.random::<u64>()));
            t += rng.random_range(0.5..2.0);
        }
        let stops = (0..(chaos / 8.0).ceil().max(1.0) as usize)
            .map(|_| {
                (
                    rng.random_range(0.1..0.7) * chaos,
                    rng.random_range(0.5..2.0),
                )
            })
            .collect();
        let unlocks = (0..2).map(|_| rng.random_range(0.1..0.7) * chaos).collect();
        let partitions = (0..(chaos / 10.0).ceil().max(1.0) as usize)
            .map(|_| {
                (
                    rng.random_range(0.1..0.7) * chaos,
                    rng.random_range(0.5..2.0),
                    rng.random::<u64>(),
                )
            })
            .collect();
        let restart = (
            rng.random_range(0.3..0.6) * chaos,
            rng.random_range(300..1500),
        );
        let catalog_failing = (
            rng.random_range(0.1..0.6) * chaos,
            rng.random_range(2.0..5.0),
        );
        let crawl_failing = (
            rng.random_range(0..CRAWLING.len()),
            rng.random_range(0.1..0.6) * chaos,
            rng.random_range(2.0..5.0),
        );
        let mutations = (0..4)
            .map(|i| (rng.random_range(0.1..0.8) * chaos, i % 2))
            .collect();
        Plan {
            kills,
            stops,
            partitions,
            unlocks,
            restart,
            catalog_failing,
            crawl_failing,
            mutations,
        }
    }
}

/// What the shops' mutations did, per crawling bot: sku → times changed, and the deleted.
#[derive(Default)]
pub(super) struct Mutated {
    pub(super) changed: HashMap<String, HashMap<String, u32>>,
    pub(super) deleted: HashMap<String, std::collections::HashSet<String>>,
}

pub(super) async fn mutate(shop: &Shop, per_kind: u32) -> Option<serde_json::Value> {
    reqwest::Client::new()
        .post(format!("{}/__mutate", shop.base))
        .json(&serde_json::json!({ "change": per_kind, "add": per_kind, "delete": per_kind }))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}
