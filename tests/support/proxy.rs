//! A small TCP proxy on a loopback port, run on threads of the test process: each new
//! connection goes to the proxy's current target, and connections already open stay where they
//! were when the target moves, as a moved DNS name or a VIP does. Stopped on drop (its listener
//! stops accepting; open pairs end when either side closes).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A proxy listening on `port`, forwarding new connections to `127.0.0.1:<target>`.
pub struct Proxy {
    pub port: u16,
    target: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let p = Proxy {
            port,
            target: Arc::new(AtomicU16::new(target)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (target, stop) = (p.target.clone(), p.stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => pair(client, target.load(Ordering::SeqCst)),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        p
    }

    /// Send new connections to `127.0.0.1:<target>` from now on.
    pub fn move_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Join `client` to a new connection to `target`, one copying thread per direction.
fn pair(client: TcpStream, target: u16) {
    client.set_nonblocking(false).unwrap();
    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
        return;
    };
    for (mut from, mut to) in [
        (client.try_clone().unwrap(), server.try_clone().unwrap()),
        (server, client),
    ] {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16384];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 || to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        });
    }
}
