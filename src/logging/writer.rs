//! Where log lines go: appended to one shared buffer, which a writer thread hands to stdout in
//! large writes. A line costs a lock and a copy; the writer is woken only when it sleeps for
//! want of lines, and after each write it lets `GATHER` pass before it looks again, so under
//! load one write carries a millisecond of lines and no logger makes a system call, while an
//! idle process still shows its next line at once. (tracing-appender's non-blocking writer, used
//! before, allocated and sent one message per line and woke its thread for most of them:
//! a third of a job's cost at INFO.) Not lossy: past `MAX_BUFFERED` a logger waits for the
//! writer. Touches no Redis keys.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};

/// Past this many bytes waiting, loggers wait for the writer rather than grow the buffer.
const MAX_BUFFERED: usize = 4 << 20;

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
    /// The buffer was taken (loggers waiting on a full buffer wait on it).
    drained: Condvar,
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
        while st.buf.len() > MAX_BUFFERED && !st.closed {
            st = self.0.drained.wait(st).unwrap();
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
                s.drained.notify_all();
                // A failed write (stdout closed) drops these lines; nothing else can be done
                // with them, and the worker must go on.
                let _ = out.write_all(&spare).and_then(|_| out.flush());
                spare.clear();
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
