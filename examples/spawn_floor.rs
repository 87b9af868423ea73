//! The ceiling under the reconcile curve: how many `/bin/true` processes this machine can
//! start and reap per second when it does nothing else, with `THREADS` threads each spawning
//! one after another (std's `Command`, which uses posix_spawn here, as the guardian does).
//! A one-phase cycle runs one such process, so no worker can run more cycles per second than
//! this. Run by bench/scale.rb: `spawn_floor THREADS SPAWNS`; prints `spawns/s`.

use std::process::{Command, Stdio};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let (Some(Ok(threads)), Some(Ok(spawns))) = (args.next(), args.next()) else {
        eprintln!("usage: spawn_floor THREADS SPAWNS");
        std::process::exit(2);
    };
    let each = spawns.div_ceil(threads.max(1));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..each {
                    let ok = Command::new("/bin/true")
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success());
                    assert!(ok, "/bin/true failed");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("spawning thread");
    }
    let secs = t0.elapsed().as_secs_f64();
    println!("{:.0}", (each * threads.max(1)) as f64 / secs);
}
