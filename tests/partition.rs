//! A worker host cut off from Redis (not dead), with hosts as network namespaces this test
//! creates and removes: `<tag>r` runs redis-server, `<tag>a` and `<tag>b` run one worker each,
//! each linked to `<tag>r` by a veth pair with 10.212.x addresses that exist only inside those
//! namespaces (nothing is routed anywhere else). Host A is cut off (link down) in the middle of
//! a phase; host B keeps running. Phase scripts write a shared ledger
//! (`<start|end> <marquee> <phase> <fence> <pid> <epoch>`), plain jobs `ran.log`. Needs root
//! (or CAP_NET_ADMIN): without it the test fails and says why.
mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

const REDIS_PORT: &str = "7379";
const A_ADDR: &str = "10.212.1.2";
const A_REDIS: &str = "10.212.1.1";
const B_ADDR: &str = "10.212.2.2";
const B_REDIS: &str = "10.212.2.1";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip (apt-get install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The three namespaces; removed (with every process we started in them) on drop.
struct Net {
    tag: String,
    children: Vec<std::process::Child>,
}

impl Net {
    fn ns(&self, host: char) -> String {
        format!("{}{host}", self.tag)
    }

    fn create() -> Net {
        let tag = format!("pg12x{}", std::process::id() % 1_000_000);
        let net = Net {
            tag,
            children: Vec::new(),
        };
        let (r, a, b) = (net.ns('r'), net.ns('a'), net.ns('b'));
        let setup = || -> Result<(), String> {
            for ns in [&r, &a, &b] {
                ip(&["netns", "add", ns])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            // Each pair is created inside its host's namespace with its peer moved straight into
            // the Redis namespace: neither end ever exists in the namespace running the test.
            for (ns, dev, peer, addr, raddr) in [
                (&a, "va", "ra", A_ADDR, A_REDIS),
                (&b, "vb", "rb", B_ADDR, B_REDIS),
            ] {
                ip(&[
                    "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", &r,
                ])?;
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
                ip(&["-n", &r, "addr", "add", &format!("{raddr}/24"), "dev", peer])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", &r, "link", "set", peer, "up"])?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            panic!("cannot create the network namespaces this test needs (it must run as root or with CAP_NET_ADMIN): {e}");
        }
        net
    }

    fn exec(&self, host: char, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(host)]).args(argv);
        c
    }

    /// A redis-cli command against the Redis namespace; its stdout.
    fn cli(&self, args: &[&str]) -> String {
        let out = self
            .exec('r', &["redis-cli", "-h", A_REDIS, "-p", REDIS_PORT])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn link(&self, host: char, up: bool) {
        let dev = if host == 'a' { "va" } else { "vb" };
        ip(&[
            "-n",
            &self.ns(host),
            "link",
            "set",
            dev,
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for h in ['a', 'b', 'r'] {
            let _ = ip(&["netns", "del", &self.ns(h)]);
        }
    }
}

fn phase_script(ledger: &std::path::Path) -> String {
    format!(
        "#!/bin/sh\n\
         echo \"start $HOST_TAG $PLAYGUARD_PHASE $PLAYGUARD_FENCE $$ $(date +%s.%N)\" >> {l}\n\
         if [ \"$PLAYGUARD_PHASE\" = b ]; then sleep \"$PHASE_B_SECS\"; else sleep 0.5; fi\n\
         echo \"end $HOST_TAG $PLAYGUARD_PHASE $PLAYGUARD_FENCE $$ $(date +%s.%N)\" >> {l}\n",
        l = ledger.display()
    )
}

/// (kind, phase, pid, epoch, host) per ledger line.
fn ledger(path: &std::path::Path) -> Vec<(String, String, i32, f64, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 6).then(|| {
                (
                    f[0].to_string(),
                    f[2].to_string(),
                    f[4].parse().unwrap(),
                    f[5].parse().unwrap(),
                    f[1].to_string(),
                )
            })
        })
        .collect()
}

fn epoch() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

#[test]
fn a_cut_off_host_stops_before_its_lease_ends_and_starts_nothing_after_healing() {
    let mut net = Net::create();
    let redis = net
        .exec(
            'r',
            &[
                "redis-server",
                "--port",
                REDIS_PORT,
                "--bind",
                A_REDIS,
                B_REDIS,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                // Reachable only inside the namespaces this test made.
                "--protected-mode",
                "no",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server");
    net.children.push(redis);
    wait_until("redis in its namespace", Duration::from_secs(10), || {
        net.cli(&["PING"]) == "PONG"
    });

    let p = Project::new();
    let ledger_path = p.path().join("ledger.log");
    p.script("jobs/bin/phase", &phase_script(&ledger_path));
    p.script(
        "jobs/bin/slow",
        &format!(
            "#!/bin/sh\necho \"slow $$ $(date +%s.%N)\" >> {}\nsleep 25\n",
            p.path().join("ran.log").display()
        ),
    );
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"Slow\"\nrun = [\"jobs/bin/slow\"]\n\
         [[job]]\nclass = \"PlayguardJob\"\n\
         lock = { key = \"playguard:marquee:{args.0}\", ttl_secs = 4, when_locked = \"skip\", label = \"Marquee {args.0}\" }\n\
         on_lock_lost = \"abort\"\n\
         [[job.phase]]\nname = \"a\"\nrun = [\"jobs/bin/phase\"]\n\
         [[job.phase]]\nname = \"b\"\nrun = [\"jobs/bin/phase\"]\n\
         [[job.phase]]\nname = \"c\"\nrun = [\"jobs/bin/phase\"]\n",
    );
    let url_a = format!("redis://{A_REDIS}:{REDIS_PORT}/0");
    let url_b = format!("redis://{B_REDIS}:{REDIS_PORT}/0");
    let start = |host: char, url: &str, phase_b: &str| {
        let mut cmd = net.exec(host, &[bin(), "run", "-r", url, "-c", "3", "-t", "3"]);
        cmd.current_dir(p.path())
            .env("PHASE_B_SECS", phase_b)
            .env("HOST_TAG", host.to_string())
            .env("RUST_LOG", "info");
        spawn_collecting(cmd)
    };
    let enqueue_b = |args: &[&str]| {
        let out = net
            .exec('b', &[bin(), "enqueue", "-r", &url_b])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };

    // Host A takes a slow plain job and Marquee 1, whose phase b outlives the 4 s lease.
    let wa = start('a', &url_a, "20");
    wa.wait_for_line("playguard starting", Duration::from_secs(10));
    enqueue_b(&["Slow"]);
    enqueue_b(&["PlayguardJob", "1"]);
    wait_until("A is in phase b", Duration::from_secs(15), || {
        ledger(&ledger_path)
            .iter()
            .any(|e| e.0 == "start" && e.1 == "b")
    });
    let wb = start('b', &url_b, "0.5");
    wb.wait_for_line("playguard starting", Duration::from_secs(10));
    let a_phase_pid = ledger(&ledger_path)
        .iter()
        .find(|e| e.0 == "start" && e.1 == "b")
        .unwrap()
        .2;

    // Cut A off. B keeps asking for Marquee 1 until it gets it.
    net.link('a', false);
    let cut = Instant::now();
    let cut_epoch = epoch();
    let mut a_phase_gone: Option<f64> = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    let b_start = loop {
        if a_phase_gone.is_none() && !pid_alive(a_phase_pid) {
            a_phase_gone = Some(epoch());
        }
        if let Some(e) = ledger(&ledger_path)
            .iter()
            .find(|e| e.0 == "start" && e.4 == "b")
        {
            break e.3;
        }
        assert!(
            Instant::now() < deadline,
            "B never took Marquee 1 over:\nA:\n{}\nB:\n{}",
            wa.output(),
            wb.output()
        );
        enqueue_b(&["PlayguardJob", "1"]);
        std::thread::sleep(Duration::from_millis(300));
    };
    let marquee_takeover = b_start - cut_epoch;
    let a_gone = a_phase_gone.expect("A's phase was stopped before B started Marquee 1");
    assert!(
        a_gone < b_start,
        "A's phase was stopped ({a_gone}) before B's first phase of Marquee 1 ({b_start})"
    );

    // Its plain job goes to B once A's liveness lapses.
    wait_until("B runs A's slow job", Duration::from_secs(40), || {
        std::fs::read_to_string(p.path().join("ran.log"))
            .unwrap_or_default()
            .lines()
            .count()
            >= 2
    });
    let job_takeover = cut.elapsed();

    // Heal: A comes back, beats again, and starts no phase of the cycle it lost.
    net.link('a', true);
    let healed = epoch();
    wait_until(
        "a beat from A after the heal",
        Duration::from_secs(20),
        || {
            let procs = net.cli(&["SMEMBERS", "processes"]);
            procs.lines().any(|id| {
                id.contains(&format!(":{}:", wa_pid(&wa)))
                    && net.cli(&["HGET", id, "beat"]).parse::<f64>().unwrap_or(0.0) > healed
            })
        },
    );
    let e = ledger(&ledger_path);
    let late: Vec<_> = e
        .iter()
        .filter(|x| x.0 == "start" && x.4 == "a" && x.3 > cut_epoch)
        .collect();
    assert!(late.is_empty(), "A started nothing after the cut: {late:?}");
    assert!(
        !wa.saw("phase start phase=c"),
        "A never started phase c:\n{}",
        wa.output()
    );
    // Phases of Marquee 1 never overlap.
    let mut runs: Vec<(f64, f64)> = e
        .iter()
        .filter(|s| s.0 == "start")
        .map(|s| {
            let end = e
                .iter()
                .find(|x| x.0 == "end" && x.2 == s.2)
                .map(|x| x.3)
                .unwrap_or(if s.2 == a_phase_pid {
                    a_gone
                } else {
                    f64::INFINITY
                });
            (s.3, end)
        })
        .collect();
    runs.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    for w in runs.windows(2) {
        assert!(w[0].1 <= w[1].0, "phases overlap: {w:?}");
    }
    eprintln!(
        "FIGURES (partition): A's phase stopped {:.2}s after the cut; B started Marquee 1 {:.2}s after the cut; \
         B ran A's plain job {:.2}s after the cut",
        a_gone - cut_epoch,
        marquee_takeover,
        job_takeover.as_secs_f64()
    );
    for w in [&wa, &wb] {
        w.signal("TERM");
    }
    let (mut wa, mut wb) = (wa, wb);
    assert!(wa.wait_exit(Duration::from_secs(30)).is_some());
    assert!(wb.wait_exit(Duration::from_secs(30)).is_some());
    drop(net);
}

fn wa_pid(w: &Worker) -> i32 {
    w.pid()
}

fn spawn_collecting(mut cmd: Command) -> Worker {
    Worker::spawn(&mut cmd)
}
