//! Real `seedlock` processes: their config file, start, signals, output and logs.

use super::*;

/// A config file for processes; `bots` is raw TOML for the `[[bots]]` entries.
pub struct ProcConfig<'a> {
    pub uri: &'a str,
    pub database: &'a str,
    pub ttl: &'a str,
    pub max_refresh: &'a str,
    pub poll: &'a str,
    /// `refresh.backoff_base` and `refresh.backoff_max` (failed refreshes back off between them).
    pub backoff: (&'a str, &'a str),
    pub bots: String,
    pub extra: &'a str,
}

impl<'a> ProcConfig<'a> {
    /// The defaults most tests use: ttl 5 s, max_refresh 60 s, poll 200 ms.
    pub fn new(db: &'a TestDb, bots: String) -> Self {
        ProcConfig {
            uri: &db.uri,
            database: &db.name,
            ttl: "5s",
            max_refresh: "60s",
            poll: "200ms",
            backoff: ("200ms", "1s"),
            bots,
            extra: "",
        }
    }

    pub fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join(format!("seedlock-{}.toml", rand::random::<u32>()));
        let text = format!(
            "[mongo]\nuri = \"{}\"\ndatabase = \"{}\"\nconnect_timeout = \"2s\"\n[lock]\nttl = \"{}\"\nmax_refresh = \"{}\"\npoll = \"{}\"\n[refresh]\nattempts = 1\nbackoff_base = \"{}\"\nbackoff_max = \"{}\"\n[http]\nlisten = \"off\"\n{}\n{}\n",
            self.uri,
            self.database,
            self.ttl,
            self.max_refresh,
            self.poll,
            self.backoff.0,
            self.backoff.1,
            self.extra,
            self.bots
        );
        std::fs::write(&path, text).unwrap();
        path
    }
}

pub fn url_bot(id: &str, url: &str) -> String {
    format!("[[bots]]\nid = \"{id}\"\nseeds = {{ url = \"{url}\", format = \"lines\" }}\n")
}

/// Runs `seedlock ARGS…` to its end against `db` (a config with no bots: the database's),
/// off the async workers.
pub async fn run_cli(db: &TestDb, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let config = ProcConfig::new(db, String::new()).write(dir.path());
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(seedlock_bin())
            .arg("-c")
            .arg(&config)
            .args(&args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .env_remove("SEEDLOCK_HTTP_LISTEN")
            .output()
            .expect("run seedlock");
        drop(dir);
        out
    })
    .await
    .unwrap()
}

/// The `seedlock` binary: cargo's for the tests, `SEEDLOCK_BIN` for the examples.
pub fn seedlock_bin() -> PathBuf {
    option_env!("CARGO_BIN_EXE_seedlock")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("SEEDLOCK_BIN").map(PathBuf::from))
        .expect("the seedlock binary (SEEDLOCK_BIN)")
}

pub struct Proc {
    pub name: String,
    child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Proc {
    /// Starts `seedlock -c CONFIG ARGS…` as instance `name`. The test's own `MONGODB_URI` is not
    /// passed down: the config file says which server to use.
    pub fn spawn(
        dir: &Path,
        config: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let stdout = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.err"));
        let mut cmd = Command::new(seedlock_bin());
        cmd.arg("-c")
            .arg(config)
            .args(args)
            .env_remove("MONGODB_URI")
            .env_remove("SEEDLOCK_DATABASE")
            .env_remove("SEEDLOCK_HTTP_LISTEN")
            .env("SEEDLOCK_INSTANCE_ID", name)
            .env("SEEDLOCK_LOG", "info,seedlock=debug")
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn seedlock");
        Proc {
            name: name.to_owned(),
            child,
            stdout,
            stderr,
        }
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id().expect("process is running") as i32)
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), sig).expect("send signal");
    }

    pub async fn kill9(&mut self) {
        self.child.kill().await.expect("SIGKILL");
    }

    pub async fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.expect("wait for seedlock"),
            Err(_) => panic!(
                "{} did not exit within {timeout:?}; stderr:\n{}",
                self.name,
                self.log()
            ),
        }
    }

    /// The HTTP address (status page, `/healthz`, `/metrics`) of a process started with
    /// `SEEDLOCK_HTTP_LISTEN=127.0.0.1:0`, once its log says it serves them.
    pub async fn http_addr(&self) -> String {
        eventually("the endpoint is up", Duration::from_secs(20), || async {
            self.log().contains("serving the status page")
        })
        .await;
        let log = self.log();
        log.split("addr=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .expect("the log names the address")
            .to_owned()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn out(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Waits for the process to exit and asserts it succeeded and logged no panic; the failure
    /// message carries its log.
    pub async fn expect_ok(&mut self, timeout: Duration) {
        let status = self.wait(timeout).await;
        assert!(
            status.success(),
            "{} exited {status}:\n{}",
            self.name,
            self.log()
        );
        self.assert_clean();
    }

    /// Asserts what every process must satisfy: no panic, no unhandled error.
    pub fn assert_clean(&self) {
        let log = self.log();
        assert!(!log.contains("panicked"), "{} panicked:\n{log}", self.name);
    }
}
