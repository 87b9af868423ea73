//! Which job a log line belongs to: the job's jid, class and queue, set for this thread while
//! the job's future is polled, and read by both log formats (`mod.rs`) as if they were a
//! `job` span's fields between the root span and any inner span (a phase). Why not a tracing
//! span: a span per job cost 2k of a no-op job's 14.5k instructions at INFO (its slab entry,
//! its fields formatted, entered and left at every poll, closed), where this is one swap of a
//! pointer per poll. A task a job spawns carries its scope with `carry`, as a span is carried
//! with `in_current_span`. Touches no Redis keys.

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;

/// A job's names, as its log lines show them.
#[derive(Debug)]
pub(crate) struct JobTag {
    pub jid: Arc<str>,
    /// The class shown (the display rule's name).
    pub class: Arc<str>,
    pub queue: Arc<str>,
}

thread_local! {
    static CURRENT: Cell<Option<Arc<JobTag>>> = const { Cell::new(None) };
}

/// The job whose future this thread is polling, if any.
pub(crate) fn current() -> Option<Arc<JobTag>> {
    peek(|t| t.clone())
}

/// Call `f` with the current job's tag (no clone of it).
pub(crate) fn with_current<R>(f: impl FnOnce(Option<&JobTag>) -> R) -> R {
    peek(|t| f(t.as_deref()))
}

/// `f` on the thread's slot, taken out and put back (a `Cell` lends no reference).
fn peek<R>(f: impl FnOnce(&Option<Arc<JobTag>>) -> R) -> R {
    CURRENT.with(|c| {
        let t = c.take();
        let r = f(&t);
        c.set(t);
        r
    })
}

/// `fut` with `tag` as the current job while it is polled. Boxed once here: every layer
/// above it then moves a pointer, not the job's whole state machine.
pub(crate) fn scoped<F: Future>(tag: Option<Arc<JobTag>>, fut: F) -> Scoped<F> {
    Scoped {
        tag,
        fut: Box::pin(fut),
    }
}

pub(crate) struct Scoped<F> {
    tag: Option<Arc<JobTag>>,
    fut: std::pin::Pin<Box<F>>,
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.get_mut();
        let _in = Enter::new(&mut this.tag);
        this.fut.as_mut().poll(cx)
    }
}

/// `fut` in the current job's scope (for a task a job spawns).
pub(crate) fn carry<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    scoped(current(), fut)
}

/// Sets the tag for one poll and puts the previous one back after it, even if the poll
/// panics.
struct Enter<'a> {
    slot: &'a mut Option<Arc<JobTag>>,
    prev: Option<Arc<JobTag>>,
}

impl<'a> Enter<'a> {
    fn new(slot: &'a mut Option<Arc<JobTag>>) -> Enter<'a> {
        let prev = CURRENT.with(|c| c.replace(slot.take()));
        Enter { slot, prev }
    }
}

impl Drop for Enter<'_> {
    fn drop(&mut self) {
        *self.slot = CURRENT.with(|c| c.replace(self.prev.take()));
    }
}

/// For tests of the line formats: `tag` is the current job until the guard drops.
#[cfg(test)]
pub(crate) fn enter(jid: &str, class: &str, queue: &str) -> impl Drop {
    struct Guard(Option<Arc<JobTag>>);
    impl Drop for Guard {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0.take()));
        }
    }
    let tag = Arc::new(JobTag {
        jid: jid.into(),
        class: class.into(),
        queue: queue.into(),
    });
    Guard(CURRENT.with(|c| c.replace(Some(tag))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(jid: &str) -> Arc<JobTag> {
        Arc::new(JobTag {
            jid: jid.into(),
            class: "A".into(),
            queue: "q".into(),
        })
    }

    fn jid() -> Option<String> {
        with_current(|t| t.map(|t| t.jid.to_string()))
    }

    #[tokio::test]
    async fn set_while_polled_restored_after_and_carried_into_spawned_tasks() {
        assert_eq!(jid(), None);
        let outer = scoped(Some(tag("a")), async {
            assert_eq!(jid().as_deref(), Some("a"));
            let inner = scoped(Some(tag("b")), async { jid() }).await;
            assert_eq!(inner.as_deref(), Some("b"));
            // Across an await that really waits, and in a task it spawns.
            tokio::task::yield_now().await;
            assert_eq!(jid().as_deref(), Some("a"));
            let spawned = tokio::spawn(carry(async { jid() })).await.unwrap();
            let bare = tokio::spawn(async { jid() }).await.unwrap();
            (jid(), spawned, bare)
        })
        .await;
        assert_eq!(
            outer,
            (Some("a".into()), Some("a".into()), None),
            "spawned tasks see the job only when carried"
        );
        assert_eq!(jid(), None);
    }

    #[test]
    fn a_panicking_poll_restores_the_previous_job() {
        let r = std::panic::catch_unwind(|| {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(scoped(Some(tag("p")), async { panic!("boom") }))
        });
        assert!(r.is_err());
        assert_eq!(jid(), None);
    }
}
