//! Lines: a process's output as it writes it (stdout and stderr collected by reader threads,
//! waited on with a deadline), and the line files job scripts append to (ledgers, stamps,
//! logs), read as they are at the moment, a missing file being empty.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The output lines of a child whose stdout and stderr are pipes: both streams in the order
/// the lines arrived, and stdout's alone.
///
/// PLAYGUARD_TEST_OUTPUT_LAG_MS=N shows each line to the test only N ms after it was read
/// (every line once the process has exited and `drain` ran). The worker logs through a writer
/// thread, so a line can trail the Redis state it reports; a test that reads a line at once
/// after waiting on Redis fails under this lag, where it would fail only now and then on a
/// loaded machine.
pub struct Lines {
    seen: Arc<Mutex<Seen>>,
    /// How long a read line stays hidden from the test (zero unless the variable is set).
    lag: Duration,
    /// The threads reading stdout and stderr: an exit is only fully seen once they reach
    /// end of file, else the last lines can still be in the pipe when a test reads them.
    readers: Vec<JoinHandle<()>>,
}

#[derive(Default)]
struct Seen {
    /// Read, not yet shown: (when read, from stdout, line), oldest first.
    pending: std::collections::VecDeque<(Instant, bool, String)>,
    all: Vec<String>,
    stdout: Vec<String>,
}

impl Lines {
    /// Take `child`'s stdout and stderr pipes and read them line by line from now on
    /// (echoed to the test's stderr under PLAYGUARD_TEST_ECHO).
    pub fn collect(child: &mut Child) -> Lines {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut readers = Vec::new();
        for (stream, is_stdout) in [
            (
                Box::new(child.stdout.take().expect("stdout piped")) as Box<dyn Read + Send>,
                true,
            ),
            (Box::new(child.stderr.take().expect("stderr piped")), false),
        ] {
            let seen = seen.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if std::env::var("PLAYGUARD_TEST_ECHO").is_ok() {
                        eprintln!("[worker] {line}");
                    }
                    let mut s = seen.lock().unwrap();
                    s.pending.push_back((Instant::now(), is_stdout, line));
                }
            }));
        }
        let lag = std::env::var("PLAYGUARD_TEST_OUTPUT_LAG_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        Lines { seen, lag, readers }
    }

    /// The lines the test may see now (those read at least `lag` ago).
    fn view(&self) -> std::sync::MutexGuard<'_, Seen> {
        let mut s = self.seen.lock().unwrap();
        while s.pending.front().is_some_and(|p| p.0.elapsed() >= self.lag) {
            let (_, is_stdout, line) = s.pending.pop_front().unwrap();
            if is_stdout {
                s.stdout.push(line.clone());
            }
            s.all.push(line);
        }
        s
    }

    /// Every line so far, both streams.
    pub fn all(&self) -> Vec<String> {
        self.view().all.clone()
    }

    /// Every line so far, joined with newlines.
    pub fn text(&self) -> String {
        self.view().all.join("\n")
    }

    /// Stdout's lines so far, joined with newlines.
    pub fn stdout_text(&self) -> String {
        self.view().stdout.join("\n")
    }

    /// The first line so far containing `needle`.
    pub fn find(&self, needle: &str) -> Option<String> {
        self.view().all.iter().find(|l| l.contains(needle)).cloned()
    }

    /// How many lines so far contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.view()
            .all
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    pub fn saw(&self, needle: &str) -> bool {
        self.view().all.iter().any(|l| l.contains(needle))
    }

    /// Wait until a line contains `needle`; panics with the output so far on timeout.
    pub fn wait_for(&self, needle: &str, timeout: Duration) {
        let what = format!("worker output line containing {needle:?}");
        let deadline = Instant::now() + timeout;
        while !self.saw(needle) {
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; output:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// After the exit: wait (up to `bound`) for the readers to reach end of file, so every
    /// line the process wrote is in. A child of the process that still holds the pipes open
    /// only makes this wait end at that bound.
    pub fn drain(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for r in std::mem::take(&mut self.readers) {
            if r.is_finished() {
                let _ = r.join();
            }
        }
        // The process is gone: nothing it wrote can trail anything any more.
        self.lag = Duration::ZERO;
    }
}

/// The file's content, or "" while it does not exist.
pub fn read_or_empty(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The file's lines, none while it does not exist.
pub fn file_lines(path: &Path) -> Vec<String> {
    read_or_empty(path).lines().map(str::to_string).collect()
}
