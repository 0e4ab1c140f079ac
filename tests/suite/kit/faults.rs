//! A MongoDB wire-protocol proxy in front of the database that answers chosen commands with the
//! replies a replica set gives while it fails over — the blackhole proxy's sibling, for a server
//! without `configureFailPoint` (the test server). It reads whole messages; an `OP_MSG` whose
//! command (its first key) and collection match a rule is, as the rule says:
//!
//! - [`Fault::Answer`]: not forwarded; the rule's reply goes back instead (`NotWritablePrimary`,
//!   say): the server never saw the write;
//! - [`Fault::AddToReply`]: forwarded, and the rule's fields are added to the server's reply (a
//!   `writeConcernError`): the write was applied, its acknowledgment failed;
//! - [`Fault::Drop`]: forwarded, then the connection is closed before the reply comes back (a
//!   network error after the server applied it).
//!
//! [`Faults::stall`] holds every message, in both directions and on every connection (the
//! driver's monitoring among them), for a while: the silence of a primary that stopped answering
//! before an election replaces it. Every other message passes unchanged.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bson::Document;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

const OP_MSG: i32 = 2013;

#[derive(Clone, Debug)]
pub enum Fault {
    Answer(Document),
    AddToReply(Document),
    Drop,
}

/// Answers the next `times` commands `command` on `collection` with `fault`.
#[derive(Clone, Debug)]
pub struct Rule {
    pub command: String,
    pub collection: String,
    pub times: usize,
    pub fault: Fault,
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    /// (command, collection) → requests seen, and faults applied.
    seen: HashMap<(String, String), usize>,
    applied: HashMap<(String, String), usize>,
    /// Nothing passes before this.
    stalled_until: Option<tokio::time::Instant>,
    /// Messages held by a stall.
    held: usize,
}

/// Waits out a stall in progress, counting the message held.
async fn hold(state: &Mutex<State>) {
    let until = {
        let mut state = state.lock().unwrap();
        match state.stalled_until {
            Some(until) if until > tokio::time::Instant::now() => {
                state.held += 1;
                until
            }
            _ => return,
        }
    };
    tokio::time::sleep_until(until).await;
}

pub struct Faults {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

/// The reply a primary that stepped down gives to a write: the driver's retryable-write error.
pub fn not_primary() -> Document {
    bson::doc! {
        "ok": 0.0, "code": 10107, "codeName": "NotWritablePrimary", "errmsg": "not primary",
        "errorLabels": ["RetryableWriteError"],
    }
}

/// The fields a reply gains when the write was applied on the primary but its write concern
/// failed with `code` (`labels`: the reply's error labels).
pub fn write_concern_error(code: i32, name: &str, labels: &[&str]) -> Document {
    let mut d = bson::doc! {
        "writeConcernError": { "code": code, "codeName": name, "errmsg": format!("{name} (injected by the test proxy)") },
    };
    if !labels.is_empty() {
        d.insert("errorLabels", labels.to_vec());
    }
    d
}

impl Faults {
    /// A proxy to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Faults {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state: Arc<Mutex<State>> = Default::default();
        let upstream = upstream.to_owned();
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (state, upstream) = (shared.clone(), upstream.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
                    let pending: Pending = Default::default();
                    let closed = tokio_util::sync::CancellationToken::new();
                    let state_for_replies = state.clone();
                    tokio::spawn(requests(
                        client_read,
                        server_write,
                        client_write.clone(),
                        state,
                        pending.clone(),
                        closed.clone(),
                    ));
                    tokio::spawn(replies(
                        server_read,
                        client_write,
                        pending,
                        closed,
                        state_for_replies,
                    ));
                });
            }
        });
        Faults { addr, state }
    }

    /// `uri` pointed at this proxy, connecting to it directly (not to the members it names).
    pub fn uri(&self, uri: &str) -> String {
        super::blackhole::direct_uri(uri, self.addr)
    }

    /// From now on and for `silence`, every message waits (see the module comment).
    pub fn stall(&self, silence: std::time::Duration) {
        self.state.lock().unwrap().stalled_until = Some(tokio::time::Instant::now() + silence);
    }

    /// Messages a stall held.
    pub fn held(&self) -> usize {
        self.state.lock().unwrap().held
    }

    pub fn add(&self, rule: Rule) {
        self.state.lock().unwrap().rules.push(rule);
    }

    /// Requests of `command` on `collection` seen so far (faulted or not).
    pub fn seen(&self, command: &str, collection: &str) -> usize {
        let key = (command.to_owned(), collection.to_owned());
        self.state
            .lock()
            .unwrap()
            .seen
            .get(&key)
            .copied()
            .unwrap_or(0)
    }

    /// Faults applied to `command` on `collection` so far.
    pub fn applied(&self, command: &str, collection: &str) -> usize {
        let key = (command.to_owned(), collection.to_owned());
        self.state
            .lock()
            .unwrap()
            .applied
            .get(&key)
            .copied()
            .unwrap_or(0)
    }
}

/// Requests forwarded whose reply gets fields added: request id → fields.
type Pending = Arc<Mutex<HashMap<i32, Document>>>;

async fn read_message(from: &mut OwnedReadHalf) -> Option<Vec<u8>> {
    let mut header = [0u8; 16];
    from.read_exact(&mut header).await.ok()?;
    let len = i32::from_le_bytes(header[0..4].try_into().unwrap()) as usize;
    let mut message = header.to_vec();
    message.resize(len.max(16), 0);
    from.read_exact(&mut message[16..]).await.ok()?;
    Some(message)
}

fn int(message: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(message[at..at + 4].try_into().unwrap())
}

/// The body (section kind 0) of an `OP_MSG`.
fn body(message: &[u8]) -> Option<Document> {
    if message.len() < 21 || int(message, 12) != OP_MSG || message[20] != 0 {
        return None;
    }
    Document::from_reader(&mut &message[21..]).ok()
}

/// An `OP_MSG` reply to `request_id` carrying `doc`.
fn reply(request_id: i32, doc: &Document) -> Vec<u8> {
    let mut body = Vec::new();
    doc.to_writer(&mut body).unwrap();
    let len = 16 + 4 + 1 + body.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as i32).to_le_bytes());
    out.extend_from_slice(&rand::random::<i32>().to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&OP_MSG.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.push(0);
    out.extend_from_slice(&body);
    out
}

async fn requests(
    mut from: OwnedReadHalf,
    mut server: OwnedWriteHalf,
    client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    state: Arc<Mutex<State>>,
    pending: Pending,
    closed: tokio_util::sync::CancellationToken,
) {
    while let Some(message) = read_message(&mut from).await {
        hold(&state).await;
        let command = body(&message).and_then(|b| {
            let (name, value) = b.iter().next()?;
            Some((name.clone(), value.as_str().unwrap_or("").to_owned()))
        });
        let fault = command.as_ref().and_then(|key| {
            let mut state = state.lock().unwrap();
            *state.seen.entry(key.clone()).or_default() += 1;
            let rule = state
                .rules
                .iter_mut()
                .find(|r| r.times > 0 && r.command == key.0 && r.collection == key.1)?;
            rule.times -= 1;
            let fault = rule.fault.clone();
            *state.applied.entry(key.clone()).or_default() += 1;
            Some(fault)
        });
        let request_id = int(&message, 4);
        match fault {
            Some(Fault::Answer(doc)) => {
                let mut client = client.lock().await;
                if client.write_all(&reply(request_id, &doc)).await.is_err() {
                    break;
                }
                continue;
            }
            Some(Fault::AddToReply(doc)) => {
                pending.lock().unwrap().insert(request_id, doc);
            }
            Some(Fault::Drop) => {
                let _ = server.write_all(&message).await;
                // The server applies it; the client never hears back.
                closed.cancel();
                let _ = client.lock().await.shutdown().await;
                return;
            }
            None => {}
        }
        if server.write_all(&message).await.is_err() {
            break;
        }
    }
    closed.cancel();
    let _ = server.shutdown().await;
}

async fn replies(
    mut from: OwnedReadHalf,
    client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    closed: tokio_util::sync::CancellationToken,
    state: Arc<Mutex<State>>,
) {
    loop {
        let message = tokio::select! {
            _ = closed.cancelled() => return,
            m = read_message(&mut from) => m,
        };
        let Some(mut message) = message else { break };
        hold(&state).await;
        let responds_to = int(&message, 8);
        let extra = pending.lock().unwrap().remove(&responds_to);
        if let (Some(extra), Some(mut doc)) = (extra, body(&message)) {
            doc.extend(extra);
            message = reply(responds_to, &doc);
        }
        if closed.is_cancelled() {
            return;
        }
        if client.lock().await.write_all(&message).await.is_err() {
            break;
        }
    }
    let _ = client.lock().await.shutdown().await;
}
