//! A TCP proxy in front of the database that delays every byte by half a round trip in each
//! direction — a network between the instance and the database, where `tc netem` is not
//! available. Bandwidth is not limited and order is kept: what arrives at `t` leaves at
//! `t + rtt / 2`, however much else is in flight. Plain threads with blocking sockets, so a
//! delay is kept to a few tens of microseconds (the async runtime's timer rounds to a whole
//! millisecond, which would make a 2 ms round trip 3–4 ms).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct Delay {
    pub addr: SocketAddr,
}

impl Delay {
    /// A proxy to `upstream` (`host:port`) adding `rtt` to every round trip.
    pub fn start(upstream: &str, rtt: Duration) -> Delay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = upstream.to_owned();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (Ok(client_out), Ok(server_out)) = (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                carry(client, server_out, rtt / 2);
                carry(server, client_out, rtt / 2);
            }
        });
        Delay { addr }
    }

    /// `uri` pointed at this proxy, connecting to it directly (not to the members it names).
    pub fn uri(&self, uri: &str) -> String {
        super::blackhole::direct_uri(uri, self.addr)
    }

    /// The URI of the suite's server (`MONGODB_URI`) through a proxy adding `rtt` to every round
    /// trip (the proxy serves for the rest of the process).
    pub fn test_server(rtt: Duration) -> String {
        let uri = super::mongodb_uri();
        Self::start(&super::blackhole::server_of(&uri), rtt).uri(&uri)
    }
}

/// Copies `from` to `to` on two threads, each chunk `delay` after it was read.
fn carry(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (send, receive) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        while let Ok((at, bytes)) = receive.recv() {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if send
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    });
}
