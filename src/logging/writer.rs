//! Where log lines go: appended to one shared buffer, which a writer thread hands to stdout in
//! large writes. A line costs a lock and a copy; the writer is woken only when it sleeps for
//! want of lines, and after each write it lets `GATHER` pass before it looks again, so under
//! load one write carries a millisecond of lines and no logger makes a system call, while an
//! idle process still shows its next line at once. (tracing-appender's non-blocking writer, used
//! before, allocated and sent one message per line and woke its thread for most of them:
//! a third of a job's cost at INFO.) Never blocks a logger: past `MAX_BUFFERED` (stdout not
//! read: a stuck log pipe, a paused shipper) a line is dropped and counted, and once the
//! writer has caught up one WARN line says how many. A logger that waited there would hold a
//! runtime thread, and with it jobs, beats and lease deadlines. Touches no Redis keys.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Past this many bytes waiting, lines are dropped (and counted) rather than grow the buffer.
const MAX_BUFFERED: usize = 4 << 20;
/// The dropped count is reported once the buffer is below this: the report itself must fit.
const CAUGHT_UP: usize = MAX_BUFFERED / 2;

/// How long the writer lets lines gather after a write.
const GATHER: std::time::Duration = std::time::Duration::from_millis(1);

#[derive(Default)]
struct State {
    buf: Vec<u8>,
    /// No more lines: the writer drains what is left and ends.
    closed: bool,
    /// The writer waits for a line (the next logger wakes it).
    parked: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Lines arrived (writer waits on it).
    ready: Condvar,
    /// Lines dropped on a full buffer since the last report.
    dropped: AtomicU64,
}

/// The `MakeWriter` handed to tracing-subscriber: each line it formats is one `write` here.
#[derive(Clone)]
pub struct LineWriter(Arc<Shared>);

impl Write for LineWriter {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        self.append(line);
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LineWriter {
    /// Add one whole line (or several) to the buffer.
    pub fn append(&self, line: &[u8]) {
        let mut st = self.0.state.lock().unwrap();
        if st.buf.len() > MAX_BUFFERED && !st.closed {
            drop(st);
            self.0.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        st.buf.extend_from_slice(line);
        let wake = std::mem::take(&mut st.parked);
        drop(st);
        if wake {
            self.0.ready.notify_one();
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LineWriter {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        self.clone()
    }
}

/// Flushes what is buffered and stops the writer thread when dropped (keep it until exit).
pub struct Guard {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap().closed = true;
        self.shared.ready.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Once the buffer has room again, say how many lines were dropped (a line of its own, in
/// the process's log format, through the subscriber).
fn report_dropped(s: &Shared) {
    if s.state.lock().unwrap().buf.len() >= CAUGHT_UP {
        return;
    }
    let n = s.dropped.swap(0, Ordering::Relaxed);
    if n > 0 {
        tracing::warn!(
            dropped = n,
            "{n} log lines dropped: stdout was not being read (a stuck log pipe or a paused log shipper); logging never makes the worker wait"
        );
    }
}

/// Lines dropped and not yet reported.
#[cfg(test)]
fn dropped(w: &LineWriter) -> u64 {
    w.0.dropped.load(Ordering::Relaxed)
}

/// Start the writer thread over `out`.
pub fn start(mut out: impl Write + Send + 'static) -> (LineWriter, Guard) {
    let shared = Arc::new(Shared::default());
    let s = shared.clone();
    let thread = std::thread::Builder::new()
        .name("playguard-log".into())
        .spawn(move || {
            let mut spare = Vec::new();
            loop {
                let closed = {
                    let mut st = s.state.lock().unwrap();
                    while st.buf.is_empty() && !st.closed {
                        st.parked = true;
                        st = s.ready.wait(st).unwrap();
                    }
                    st.parked = false;
                    std::mem::swap(&mut st.buf, &mut spare);
                    st.closed
                };
                // A failed write (stdout closed) drops these lines; nothing else can be done
                // with them, and the worker must go on.
                let _ = out.write_all(&spare).and_then(|_| out.flush());
                spare.clear();
                report_dropped(&s);
                if closed && s.state.lock().unwrap().buf.is_empty() {
                    return;
                }
                if !closed {
                    std::thread::sleep(GATHER);
                }
            }
        })
        .expect("spawn the log writer thread");
    (
        LineWriter(shared.clone()),
        Guard {
            shared,
            thread: Some(thread),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logging::test_lines::Buf as Sink;

    /// A sink whose writes wait until it is opened: a stdout nobody reads.
    #[derive(Clone, Default)]
    struct Gate(Arc<(Mutex<bool>, Condvar)>, Sink);

    impl Write for Gate {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let (open, cv) = &*self.0;
            let mut o = open.lock().unwrap();
            while !*o {
                o = cv.wait(o).unwrap();
            }
            self.1.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// With stdout not read, loggers go on (their lines past the buffer dropped and counted);
    /// once it is read again the writer catches up and the count is reported (and reset).
    #[test]
    fn a_stuck_stdout_drops_lines_instead_of_blocking_loggers() {
        let gate = Gate::default();
        let (w, guard) = start(gate.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut lw = w.clone();
        std::thread::spawn(move || {
            let line = [b'x'; 1023]
                .iter()
                .chain(b"\n")
                .copied()
                .collect::<Vec<u8>>();
            for _ in 0..(3 * MAX_BUFFERED / 1024) {
                lw.write_all(&line).unwrap();
            }
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("a logger never waits for a stdout nobody reads");
        assert!(dropped(&w) > 0);
        *gate.0 .0.lock().unwrap() = true;
        gate.0 .1.notify_all();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while dropped(&w) > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the drop is reported once caught up"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Caught up: lines are taken again.
        w.clone().write_all(b"after\n").unwrap();
        drop(guard);
        assert!(gate.1.text().ends_with("after\n"));
    }

    /// Every line from every thread arrives whole, and dropping the guard flushes the rest.
    #[test]
    fn lines_from_many_threads_all_arrive_whole() {
        let sink = Sink::default();
        let (w, guard) = start(sink.clone());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let mut w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..5000 {
                        w.write_all(format!("t{t} line {i}\n").as_bytes()).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(guard);
        let text = sink.text();
        assert_eq!(text.lines().count(), 20_000);
        for t in 0..4 {
            let mine: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with(&format!("t{t} ")))
                .collect();
            assert_eq!(mine.len(), 5000);
            assert_eq!(mine[4999], format!("t{t} line 4999"));
        }
    }
}
