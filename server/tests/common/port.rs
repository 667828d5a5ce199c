//! Free loopback ports for the processes the end-to-end tests start with a port by number.
//!
//! Invariant: a port handed out lies below the kernel's ephemeral range and was not handed out
//! before by this process. Why not `bind("127.0.0.1:0")` and pass that on: the probe gets a port
//! from the ephemeral range, which the kernel also gives every outgoing connection and every
//! `--grpc-port 0` listener of the tests running beside it; between the probe closing and the
//! child binding, one of those can take it (CI saw a router fail with "Address already in use"
//! on its registry port). Below the range, only a listener that names the port can hold it,
//! i.e. another test's pick here: a random pick among ~20,000 ports makes that a rare event
//! instead of a routine one.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// The lowest port picked: above the well-known and most registered service ports.
const LOWEST: u16 = 10_000;

/// A loopback port that no listener holds now, below the ephemeral range (see the module doc).
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32_768);
    if ephemeral_low <= LOWEST + 1_000 {
        // No room below the range: the kernel's pick is the best left.
        return TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    }
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for _ in 0..1_000 {
        let port = rand::random_range(LOWEST..ephemeral_low);
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    panic!("no free loopback port in {LOWEST}..{ephemeral_low} after 1000 tries");
}
