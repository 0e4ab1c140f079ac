//! A TCP proxy in front of the database for one instance, that can be cut: a network partition
//! as the instance sees it. Cut, it stops forwarding in both directions without closing anything
//! (as toxiproxy's `timeout` toxic with no timeout): requests go out and no answer comes, new
//! connections open and stay silent. Healed, it delivers what it held, so an operation the
//! instance sent during the cut reaches the server late — the late write a fence must reject.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Blackhole {
    pub addr: SocketAddr,
    cut: watch::Sender<bool>,
}

/// The `host:port` of a `mongodb://` URI (its first host).
pub fn server_of(uri: &str) -> String {
    uri.trim_start_matches("mongodb://")
        .split(['/', '?', ','])
        .next()
        .unwrap_or_default()
        .to_owned()
}

impl Blackhole {
    /// A proxy to `upstream` (`host:port`), forwarding until cut.
    pub async fn start(upstream: &str) -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cut_rx) = watch::channel(false);
        let upstream = upstream.to_owned();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let cut = cut_rx.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    // Cut: even the upstream connection waits (a SYN lost on the way).
                    wait_open(&cut).await;
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(pump(client_read, server_write, cut.clone()));
                    tokio::spawn(pump(server_read, client_write, cut));
                });
            }
        });
        Blackhole { addr, cut }
    }

    /// `uri` (a `mongodb://host:port/...` URI) pointed at this proxy instead (see
    /// [`direct_uri`]).
    pub fn uri(&self, uri: &str) -> String {
        direct_uri(uri, self.addr)
    }

    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

/// `uri` with its hosts replaced by the proxy at `addr`, connecting to it directly: without
/// `directConnection=true` a driver given `replicaSet=…` would discover the set's real members
/// from the proxied server and talk to them, around the proxy.
pub fn direct_uri(uri: &str, addr: SocketAddr) -> String {
    let rest = uri.strip_prefix("mongodb://").expect("a mongodb:// URI");
    let rest = rest.split_once('@').map_or(rest, |(_, hosts)| hosts);
    let credentials = uri
        .strip_prefix("mongodb://")
        .and_then(|r| r.split_once('@'))
        .map(|(c, _)| format!("{c}@"))
        .unwrap_or_default();
    let (_, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    let mut options: Vec<&str> = query
        .split('&')
        .filter(|o| {
            !o.is_empty()
                && !o.to_ascii_lowercase().starts_with("replicaset=")
                && !o.to_ascii_lowercase().starts_with("directconnection=")
        })
        .collect();
    options.push("directConnection=true");
    let path = if path.is_empty() { "/" } else { path };
    format!("mongodb://{credentials}{addr}{path}?{}", options.join("&"))
}

async fn wait_open(cut: &watch::Receiver<bool>) {
    let mut cut = cut.clone();
    let _ = cut.wait_for(|c| !*c).await;
}

/// Copies `from` to `to`, holding every chunk (and the end of the stream) while cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await.unwrap_or(0);
        wait_open(&cut).await;
        if n == 0 {
            let _ = to.shutdown().await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
