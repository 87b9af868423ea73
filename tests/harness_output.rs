//! The test harness itself: `Worker::wait_exit` returns only once every line the process
//! wrote has been read, so a test that checks the last line of a process that exits at start
//! (a refused configuration, say) never sees an empty output. No Redis keys.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

/// The line is written 300 ms after the process itself has exited (by a background shell that
/// holds the same pipe), the widest form of the race where the exit is seen before the reader
/// thread has pushed the line.
#[test]
fn wait_exit_sees_lines_still_in_the_pipe() {
    let mut w = Worker::spawn(Command::new("sh").args([
        "-c",
        "(sleep 0.3; echo 'playguard: the last line') & exit 1",
    ]));
    assert_eq!(w.wait_exit(Duration::from_secs(10)), Some(1));
    assert!(
        w.saw("playguard: the last line"),
        "output: {:?}",
        w.output()
    );
}
