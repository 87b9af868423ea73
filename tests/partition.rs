//! A worker host cut off from Redis (not dead), with hosts as network namespaces this test
//! creates and removes: `<tag>r` runs redis-server, `<tag>a` and `<tag>b` run one worker each,
//! each linked to `<tag>r` by a veth pair with 10.212.x addresses that exist only inside those
//! namespaces (nothing is routed anywhere else). Host A is cut off (link down) in the middle of
//! a phase and of a plain job; host B keeps running. Commands write one shared ledger
//! (`<kind> <host> <phase> <fence> <pid> <µs> [reply]`; a watcher outside each command's
//! process group writes its `gone` line). Phase b writes the Redis hash `partition:result`
//! through `lua/fenced_set.lua`; A's write is sent into the dead link and arrives after the
//! heal. Needs root (or CAP_NET_ADMIN): without it the test fails and says why.
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

/// Bash, so every stamp is `$EPOCHREALTIME` (µs, no fork between the event and its stamp).
/// Phase b is where both hosts write their result to the fenced hash `partition:result`.
const PHASE: &str = r#"#!/bin/bash
export LC_ALL=C
L=@LEDGER@
me="$HOST_TAG $PLAYGUARD_PHASE $PLAYGUARD_FENCE $$"
# A KILLed phase writes nothing, so a watcher outside our process group writes `gone` once
# we and our children are dead: it reads a pipe only we hold and sees EOF then.
export W_LINE="gone $me" L
exec 9> >(exec setsid bash -c 'cat >/dev/null; echo "$W_LINE ${EPOCHREALTIME/./}" >> "$L"' >/dev/null 2>&1)
echo "start $me ${EPOCHREALTIME/./}" >> "$L"
resp() { printf '*%d\r\n' $#; for a in "$@"; do printf '$%d\r\n%s\r\n' "${#a}" "$a"; done; }
if [ "$PLAYGUARD_PHASE" = b ] && [ "$HOST_TAG" = a ]; then
  # The cut-off host's result write, on a connection opened while the link was up (as a
  # pool holds one) and sent once the link is down: it sits in the kernel's send queue, the
  # lease deadline kills us, and the kernel still delivers it after the link heals.
  exec 3<>"/dev/tcp/$REDIS_HOST/$REDIS_PORT"
  while [ ! -e @CUT@ ]; do sleep 0.05; done
  resp EVAL "$(cat @LUA@)" 1 partition:result "$PLAYGUARD_FENCE" "a-$PLAYGUARD_FENCE" >&3
  echo "sent $me ${EPOCHREALTIME/./}" >> "$L"
  sleep 60
elif [ "$PLAYGUARD_PHASE" = b ]; then
  r=$(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" EVAL "$(cat @LUA@)" 1 partition:result "$PLAYGUARD_FENCE" "b-$PLAYGUARD_FENCE")
  echo "wrote $me ${EPOCHREALTIME/./} $r" >> "$L"
fi
sleep 0.3
echo "end $me ${EPOCHREALTIME/./}" >> "$L"
"#;

/// A plain job that outlives the test's cut, with the same watcher as a phase.
const SLOW: &str = r#"#!/bin/bash
L=@LEDGER@
export W_LINE="slow-gone $HOST_TAG - 0 $$" L
exec 9> >(exec setsid bash -c 'cat >/dev/null; echo "$W_LINE ${EPOCHREALTIME/./}" >> "$L"' >/dev/null 2>&1)
echo "slow-start $HOST_TAG - 0 $$ ${EPOCHREALTIME/./}" >> "$L"
sleep 60
"#;

/// One ledger line: `<kind> <host> <phase> <fence> <pid> <µs since the epoch> [reply]`.
#[derive(Debug, Clone)]
struct Entry {
    kind: String,
    host: String,
    phase: String,
    fence: i64,
    pid: i32,
    us: i64,
    reply: String,
}

/// The whole lines of a file another process is appending to (not a line still being written).
fn whole_lines(path: &std::path::Path) -> Vec<String> {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let done = s.rfind('\n').map_or(0, |i| i + 1);
    s[..done].lines().map(str::to_string).collect()
}

fn ledger(path: &std::path::Path) -> Vec<Entry> {
    whole_lines(path)
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let num = |i: usize| -> i64 {
                f.get(i)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("bad ledger line {l:?}"))
            };
            Entry {
                kind: f[0].to_string(),
                host: f[1].to_string(),
                phase: f[2].to_string(),
                fence: num(3),
                pid: num(4) as i32,
                us: num(5),
                reply: f.get(6).unwrap_or(&"").to_string(),
            }
        })
        .collect()
}

fn find(path: &std::path::Path, pred: impl Fn(&Entry) -> bool) -> Option<Entry> {
    ledger(path).into_iter().find(|e| pred(e))
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// The fenced writes to `partition:result` Redis executed, from MONITOR:
/// (Redis clock in µs, client address, fence, value).
fn fenced_writes(monitor: &std::path::Path) -> Vec<(i64, String, i64, String)> {
    whole_lines(monitor)
        .iter()
        .filter_map(|l| {
            let (head, args) = l.split_once("] \"EVAL\" ")?;
            let (_, tail) = args.rsplit_once("\"1\" \"partition:result\" ")?;
            let (ts, client) = head.split_once(" [")?;
            let (sec, usec) = ts.split_once('.')?;
            let mut t = tail.split_whitespace().map(|s| s.trim_matches('"'));
            Some((
                sec.parse::<i64>().ok()? * 1_000_000 + usec.parse::<i64>().ok()?,
                client.split_whitespace().nth(1)?.to_string(),
                t.next()?.parse().ok()?,
                t.next()?.to_string(),
            ))
        })
        .collect()
}

fn secs(us: i64) -> f64 {
    us as f64 / 1e6
}

#[test]
fn a_cut_off_host_stops_in_time_its_late_write_is_refused_and_it_starts_nothing_after_healing() {
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
    let cut_file = p.path().join("cut");
    let lua = p.write("jobs/fenced_set.lua", include_str!("../lua/fenced_set.lua"));
    let fill = |s: &str| {
        s.replace("@LEDGER@", &ledger_path.display().to_string())
            .replace("@CUT@", &cut_file.display().to_string())
            .replace("@LUA@", &lua.display().to_string())
    };
    p.script("jobs/bin/phase", &fill(PHASE));
    p.script("jobs/bin/slow", &fill(SLOW));
    // ttl 10 s: A's phase b is killed by its lease deadline 9 s after it starts, time enough
    // for B to start and for the cut to land inside the phase on a loaded machine.
    p.write(
        "jobs/app.toml",
        "[[job]]\nclass = \"Slow\"\nrun = [\"jobs/bin/slow\"]\n\
         [[job]]\nclass = \"PlayguardJob\"\n\
         lock = { key = \"playguard:marquee:{args.0}\", ttl_secs = 10, when_locked = \"skip\", label = \"Marquee {args.0}\" }\n\
         on_lock_lost = \"abort\"\n\
         [[job.phase]]\nname = \"a\"\nrun = [\"jobs/bin/phase\"]\n\
         [[job.phase]]\nname = \"b\"\nrun = [\"jobs/bin/phase\"]\n\
         [[job.phase]]\nname = \"c\"\nrun = [\"jobs/bin/phase\"]\n",
    );
    // Every command Redis runs, with the client's address and Redis's clock: shows whether and
    // when A's late write arrives.
    let monitor_path = p.path().join("monitor.log");
    let monitor = net
        .exec(
            'r',
            &["redis-cli", "-h", B_REDIS, "-p", REDIS_PORT, "MONITOR"],
        )
        .stdout(std::fs::File::create(&monitor_path).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli MONITOR");
    net.children.push(monitor);
    wait_until("MONITOR attached", Duration::from_secs(10), || {
        net.cli(&["SET", "partition:monitor", "on"]);
        std::fs::read_to_string(&monitor_path)
            .unwrap_or_default()
            .contains("partition:monitor")
    });

    let url_a = format!("redis://{A_REDIS}:{REDIS_PORT}/0");
    let url_b = format!("redis://{B_REDIS}:{REDIS_PORT}/0");
    let start = |host: char, url: &str, redis_host: &str| {
        Worker::builder_url(url)
            .wrapped_in(["ip", "netns", "exec", &net.ns(host)])
            .jobs(p.path())
            .args(["-c", "3", "-t", "3"])
            .env("HOST_TAG", host.to_string())
            .env("REDIS_HOST", redis_host)
            .env("REDIS_PORT", REDIS_PORT)
            .start()
    };
    let enqueue_b = |args: &[&str]| {
        let out = net
            .exec('b', &[bin(), "enqueue", "-r", &url_b])
            .args(args)
            .output()
            .unwrap();
        assert_success(&out);
    };

    // Host A takes the slow plain job and Marquee 1, and enters phase b (its write phase).
    let wa = start('a', &url_a, A_REDIS);
    wa.wait_for_line("playguard starting", Duration::from_secs(20));
    enqueue_b(&["Slow"]);
    enqueue_b(&["PlayguardJob", "1"]);
    wait_until("A runs Slow and phase b", Duration::from_secs(30), || {
        let e = ledger(&ledger_path);
        e.iter().any(|e| e.kind == "slow-start")
            && e.iter().any(|e| e.kind == "start" && e.phase == "b")
    });
    let wb = start('b', &url_b, B_REDIS);
    wb.wait_for_line("playguard starting", Duration::from_secs(20));
    let a_phase = find(&ledger_path, |e| e.kind == "start" && e.phase == "b").unwrap();
    let a_slow = find(&ledger_path, |e| e.kind == "slow-start").unwrap();
    assert!(
        find(&ledger_path, |e| e.kind == "gone" && e.pid == a_phase.pid).is_none(),
        "the machine is too slow for this test: A's phase b ended before the cut"
    );

    // Cut A off, then let its phase send its write into the dead link.
    net.link('a', false);
    let cut = now_us();
    std::fs::write(&cut_file, "").unwrap();
    let a_sent = {
        wait_until("A's phase sent its write", Duration::from_secs(10), || {
            find(&ledger_path, |e| e.kind == "sent").is_some()
        });
        find(&ledger_path, |e| e.kind == "sent").unwrap()
    };
    assert!(a_sent.us > cut, "A's write was sent after the cut");

    // B keeps asking for Marquee 1 until it gets it.
    let deadline = Instant::now() + Duration::from_secs(40);
    let b_start = loop {
        if let Some(e) = find(&ledger_path, |e| e.kind == "start" && e.host == "b") {
            break e;
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
    let a_phase_gone = find(&ledger_path, |e| e.kind == "gone" && e.pid == a_phase.pid)
        .expect("A's phase b was gone before B started Marquee 1");
    assert!(
        a_phase_gone.us < b_start.us,
        "A's phase was gone ({}) before B's first phase of Marquee 1 ({})",
        a_phase_gone.us,
        b_start.us
    );
    wait_until("B wrote its result", Duration::from_secs(20), || {
        find(&ledger_path, |e| e.kind == "wrote").is_some()
    });

    // Its plain job goes to B once A's liveness lapses and a sweep runs.
    wait_until("B runs A's slow job", Duration::from_secs(60), || {
        find(&ledger_path, |e| e.kind == "slow-start" && e.host == "b").is_some()
    });
    let b_slow = find(&ledger_path, |e| e.kind == "slow-start" && e.host == "b").unwrap();
    let a_slow_gone = find(&ledger_path, |e| {
        e.kind == "slow-gone" && e.pid == a_slow.pid
    })
    .unwrap_or_else(|| {
        panic!(
            "A's copy of Slow (pid {}) was still running when B started its own",
            a_slow.pid
        )
    });
    assert!(
        a_slow_gone.us < b_slow.us,
        "A's copy of Slow was gone ({}) before B's started ({})",
        a_slow_gone.us,
        b_slow.us
    );

    // B has drained the queue and finished its cycles: what it wrote last is what must stay.
    wait_until("B idle but for Slow", Duration::from_secs(30), || {
        let e = ledger(&ledger_path);
        net.cli(&["LLEN", "queue:default"]) == "0"
            && e.iter()
                .filter(|s| s.kind == "start" && s.host == "b")
                .all(|s| e.iter().any(|x| x.kind == "end" && x.pid == s.pid))
    });
    let before_heal = net.cli(&["HGET", "partition:result", "fence"]);

    // Heal: A comes back, beats again, and starts no phase of the cycle it lost.
    net.link('a', true);
    let healed = now_us();
    wait_until(
        "a beat from A after the heal",
        Duration::from_secs(20),
        || {
            let procs = net.cli(&["SMEMBERS", "processes"]);
            procs.lines().any(|id| {
                id.contains(&format!(":{}:", wa.pid()))
                    && net.cli(&["HGET", id, "beat"]).parse::<f64>().unwrap_or(0.0) > secs(healed)
            })
        },
    );

    // The kernel delivers A's queued write at its next retransmission; Redis runs it, and the
    // fence refuses it.
    let a_client = format!("{A_ADDR}:");
    wait_until(
        "A's late write reaches Redis",
        Duration::from_secs(90),
        || {
            fenced_writes(&monitor_path)
                .iter()
                .any(|w| w.1.starts_with(&a_client))
        },
    );
    let writes = fenced_writes(&monitor_path);
    let late = writes
        .iter()
        .find(|w| w.1.starts_with(&a_client))
        .unwrap()
        .clone();
    assert_eq!(late.2, a_phase.fence, "the late write carries A's fence");
    assert!(
        late.0 > healed,
        "A's write arrived after the heal (at {}, healed at {healed})",
        late.0
    );
    let b_writes: Vec<_> = writes.iter().filter(|w| w.1.starts_with(B_ADDR)).collect();
    assert!(
        b_writes.iter().any(|w| w.0 < late.0),
        "B wrote before A's late write arrived: {writes:?}"
    );
    let stored_fence: i64 = net
        .cli(&["HGET", "partition:result", "fence"])
        .parse()
        .unwrap();
    let stored_value = net.cli(&["HGET", "partition:result", "value"]);
    assert_eq!(
        stored_value,
        format!("b-{stored_fence}"),
        "A's late write was refused: the hash holds B's result"
    );
    assert!(
        stored_fence >= before_heal.parse().unwrap() && stored_fence > a_phase.fence,
        "stored fence {stored_fence}, B's before the heal {before_heal}, A's {}",
        a_phase.fence
    );
    let e = ledger(&ledger_path);
    for w in e.iter().filter(|x| x.kind == "wrote") {
        assert_eq!(w.reply, "1", "B's fenced writes were all taken: {w:?}");
    }

    // A started nothing after the cut, and never phase c of the cycle it lost.
    let after: Vec<_> = e
        .iter()
        .filter(|x| x.kind.ends_with("start") && x.host == "a" && x.us > cut)
        .collect();
    assert!(
        after.is_empty(),
        "A started nothing after the cut: {after:?}"
    );
    assert!(
        !wa.saw("phase start phase=c"),
        "A never started phase c:\n{}",
        wa.output()
    );
    // Phases of Marquee 1 never overlap (a phase ends at its `end` line, a killed one when its
    // watcher saw it gone), and a new holder's fence is above the previous one's.
    let mut starts: Vec<&Entry> = e.iter().filter(|s| s.kind == "start").collect();
    starts.sort_by_key(|s| s.us);
    let end_of = |s: &Entry| {
        e.iter()
            .find(|x| x.kind == "end" && x.pid == s.pid)
            .or_else(|| e.iter().find(|x| x.kind == "gone" && x.pid == s.pid))
            .map(|x| x.us)
            .unwrap_or(i64::MAX)
    };
    for w in starts.windows(2) {
        assert!(end_of(w[0]) <= w[1].us, "phases overlap: {w:?}");
        if (w[0].host.as_str(), w[0].fence) != (w[1].host.as_str(), w[1].fence) {
            assert!(
                w[1].fence > w[0].fence,
                "fences strictly increase from one holder to the next: {w:?}"
            );
        }
    }
    assert!(
        b_start.fence > a_phase.fence,
        "B's fence {} is above A's {}",
        b_start.fence,
        a_phase.fence
    );

    eprintln!(
        "FIGURES (partition): after the cut, A's phase was gone in {:.2}s (its lease deadline, \
         {:.2}s after the phase started); B started Marquee 1 in {:.2}s ({:.2}s after A's last \
         renewal, ttl 10 s); A's plain job was gone in {:.2}s; B started it in {:.2}s. A's late \
         write reached Redis {:.2}s after the heal and was refused (fence {} < {}).",
        secs(a_phase_gone.us - cut),
        secs(a_phase_gone.us - a_phase.us),
        secs(b_start.us - cut),
        secs(b_start.us - a_phase.us),
        secs(a_slow_gone.us - cut),
        secs(b_slow.us - cut),
        secs(late.0 - healed),
        a_phase.fence,
        stored_fence
    );
    for w in [&wa, &wb] {
        w.signal("TERM");
    }
    let (mut wa, mut wb) = (wa, wb);
    assert!(wa.wait_exit(Duration::from_secs(30)).is_some());
    assert!(wb.wait_exit(Duration::from_secs(30)).is_some());
    drop(net);
}
