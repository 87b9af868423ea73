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
pub struct Lines {
    all: Arc<Mutex<Vec<String>>>,
    stdout: Arc<Mutex<Vec<String>>>,
    /// The threads reading stdout and stderr: an exit is only fully seen once they reach
    /// end of file, else the last lines can still be in the pipe when a test reads them.
    readers: Vec<JoinHandle<()>>,
}

impl Lines {
    /// Take `child`'s stdout and stderr pipes and read them line by line from now on
    /// (echoed to the test's stderr under PLAYGUARD_TEST_ECHO).
    pub fn collect(child: &mut Child) -> Lines {
        let all = Arc::new(Mutex::new(Vec::new()));
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        for (stream, is_stdout) in [
            (
                Box::new(child.stdout.take().expect("stdout piped")) as Box<dyn Read + Send>,
                true,
            ),
            (Box::new(child.stderr.take().expect("stderr piped")), false),
        ] {
            let (all, stdout) = (all.clone(), stdout.clone());
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if std::env::var("PLAYGUARD_TEST_ECHO").is_ok() {
                        eprintln!("[worker] {line}");
                    }
                    if is_stdout {
                        stdout.lock().unwrap().push(line.clone());
                    }
                    all.lock().unwrap().push(line);
                }
            }));
        }
        Lines {
            all,
            stdout,
            readers,
        }
    }

    /// Every line so far, both streams.
    pub fn all(&self) -> Vec<String> {
        self.all.lock().unwrap().clone()
    }

    /// Every line so far, joined with newlines.
    pub fn text(&self) -> String {
        self.all.lock().unwrap().join("\n")
    }

    /// Stdout's lines so far, joined with newlines.
    pub fn stdout_text(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    /// The first line so far containing `needle`.
    pub fn find(&self, needle: &str) -> Option<String> {
        self.all
            .lock()
            .unwrap()
            .iter()
            .find(|l| l.contains(needle))
            .cloned()
    }

    /// How many lines so far contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.all
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    pub fn saw(&self, needle: &str) -> bool {
        self.all.lock().unwrap().iter().any(|l| l.contains(needle))
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
