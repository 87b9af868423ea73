//! Prometheus counters kept in memory, and their text exposition ([`Metrics::render`]);
//! `server.rs` serves it on `--metrics-addr` with `/health`. Reads no Redis keys itself:
//! the heartbeat reports its own success and the queue latencies (from `queue:<q>`) here, and
//! the launcher attaches the slot table so busy slots are read live.
//!
//! Callers hand in plain labels ([`JobEnd`], [`JobFate`]), so this module needs neither the
//! handler's `Outcome` nor the retry `Decision`.

use super::redis_gauges::escape;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, Weak};

/// Most distinct class labels taken from payloads; later ones are counted as `class="other"`.
/// Class names come from whoever pushes jobs: unbounded labels would grow our memory and
/// every scrape. Classes this worker runs are not counted here: they always get their own.
const MAX_CLASS_LABELS: usize = 100;
/// The label every class past MAX_CLASS_LABELS shares.
const OTHER_CLASS: &str = "other";
/// Longest label value, in bytes. Values come from payloads (class, display_class) or the
/// command line (queues): a longer one is cut (see `capped`), so a 10,000-byte class name
/// costs neither memory nor scrape size.
pub const MAX_LABEL_BYTES: usize = 100;

/// Upper bounds (seconds) of the duration histograms.
const BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0,
];

#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    total: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.total += 1;
    }
}

type Labels = Vec<(&'static str, String)>;

/// How a job run ended, as the job counters see it (the processor maps its `Outcome` here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    Done,
    Failed,
    /// Interrupted by shutdown (or a lapsed liveness lease) and pushed back to its queue.
    Requeued,
}

/// What became of a failed job (the processor maps the retry `Decision` here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobFate {
    Retried,
    Dead,
    Discarded,
}

/// One process's counters, histograms and gauges, shared by every task through the runtime.
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<(&'static str, Labels), u64>>,
    histograms: Mutex<BTreeMap<(&'static str, Labels), Histogram>>,
    /// Slots this process runs jobs in (set by the launcher).
    pub concurrency: AtomicI64,
    /// Seconds of queue latency per queue, updated by the heartbeat.
    latency: Mutex<BTreeMap<String, f64>>,
    /// Unix ms of the last successful heartbeat write.
    pub last_redis_ok_ms: AtomicI64,
    /// Eviction policy, OOM, wrong-type queues (`process/redis_state.rs`), shared with fetch.
    pub redis: std::sync::Arc<crate::process::redis_state::RedisState>,
    fetched: AtomicU64,
    fetch_calls: AtomicU64,
    /// The slot table, once the launcher attached it; busy slots read 0 before that.
    slots: OnceLock<Weak<crate::process::slots::SlotTable>>,
    /// Classes this worker runs (set once at start): always a label of their own.
    known_classes: OnceLock<std::collections::HashSet<String>>,
    /// Labels of other class names seen in payloads (cut), up to MAX_CLASS_LABELS.
    other_classes: Mutex<std::collections::HashSet<String>>,
    /// The per-job families, by queue then class label (see `class_label`): bumped in place,
    /// no allocation once a (queue, class) was seen; folded into the labelled families when
    /// rendered. Keyed by label, not by the payload's name, so it is bounded as labels are.
    jobs: Mutex<crate::FastMap<String, crate::FastMap<String, JobSeries>>>,
}

/// What the job families hold for one (queue, class label).
#[derive(Default)]
struct JobSeries {
    processed: u64,
    failed: u64,
    requeued: u64,
    retried: u64,
    dead: u64,
    discarded: u64,
    duration: Histogram,
}

/// The labelled families, with their type and help, so a dashboard sees them all from the first
/// scrape, even before anything happened (lock and phase events come from the cycle engine).
/// The unlabelled gauges and fetch counters are written by `render` from their atomics.
const FAMILIES: [(&str, &str, &str); 12] = [
    (
        "playguard_jobs_processed_total",
        "counter",
        "Jobs that finished running (any outcome), by class and queue.",
    ),
    (
        "playguard_jobs_failed_total",
        "counter",
        "Jobs that raised/failed, by class and queue.",
    ),
    (
        "playguard_jobs_retried_total",
        "counter",
        "Failed jobs scheduled for a retry (retry set).",
    ),
    (
        "playguard_jobs_dead_total",
        "counter",
        "Jobs moved to the dead set (morgue).",
    ),
    (
        "playguard_jobs_discarded_total",
        "counter",
        "Failed jobs dropped (retry: false or dead: false).",
    ),
    (
        "playguard_jobs_requeued_total",
        "counter",
        "Jobs interrupted by shutdown and pushed back to their queue.",
    ),
    (
        "playguard_job_duration_seconds",
        "histogram",
        "Job run time, by class and queue.",
    ),
    (
        "playguard_lock_events_total",
        "counter",
        "Token lock events by class: acquired, skipped, lost, released.",
    ),
    (
        "playguard_phase_duration_seconds",
        "histogram",
        "Run time of each phase of phased jobs, by class and phase.",
    ),
    (
        "playguard_sentry_events_total",
        "counter",
        "Failure events for Sentry by event: sent, or suppressed by the rate limit (report/limit.rs).",
    ),
    (
        "playguard_hook_runs_total",
        "counter",
        "Runs of the manifest's [[hook]] commands by event: ok, failed, dropped.",
    ),
    (
        "playguard_queue_latency_seconds",
        "gauge",
        "Age of the oldest job in each queue we serve, as of the last heartbeat.",
    ),
];

fn family(name: &str) -> Option<(&'static str, &'static str)> {
    FAMILIES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, t, h)| (*t, *h))
}

impl Metrics {
    pub fn inc(&self, name: &'static str, labels: Labels) {
        self.add(name, labels, 1);
    }

    pub fn add(&self, name: &'static str, mut labels: Labels, n: u64) {
        cap_values(&mut labels);
        *self
            .counters
            .lock()
            .unwrap()
            .entry((name, labels))
            .or_default() += n;
    }

    pub fn observe(&self, name: &'static str, mut labels: Labels, secs: f64) {
        cap_values(&mut labels);
        self.histograms
            .lock()
            .unwrap()
            .entry((name, labels))
            .or_default()
            .observe(secs);
    }

    /// Name the classes this worker runs (the launcher calls this once).
    pub fn know_classes(&self, classes: impl IntoIterator<Item = String>) {
        let _ = self.known_classes.set(classes.into_iter().collect());
    }

    /// The label for a class name from a payload (cut, see `capped`): a class this worker
    /// runs always gets its own; another while fewer than MAX_CLASS_LABELS such labels have
    /// been seen, else "other".
    fn class_label(&self, class: &str) -> String {
        let label = capped(class);
        if self.known_classes.get().is_some_and(|k| k.contains(class)) {
            return label.into_owned();
        }
        let mut seen = self.other_classes.lock().unwrap();
        if seen.contains(label.as_ref()) {
            return label.into_owned();
        }
        if seen.len() < MAX_CLASS_LABELS {
            seen.insert(label.to_string());
            return label.into_owned();
        }
        OTHER_CLASS.to_string()
    }

    /// Bump the series of (class, queue), creating it on first use.
    fn job_series(&self, class: &str, queue: &str, bump: impl FnOnce(&mut JobSeries)) {
        let mut jobs = self.jobs.lock().unwrap();
        if let Some(s) = jobs.get_mut(queue).and_then(|q| q.get_mut(class)) {
            return bump(s);
        }
        // A name that is not its own label (cut, or past the cap) looks its label up each
        // time: its series is the label's, shared.
        let label = self.class_label(class);
        let classes = match jobs.get_mut(queue) {
            Some(c) => c,
            None => jobs.entry(queue.to_string()).or_default(),
        };
        bump(classes.entry(label).or_default());
    }

    /// A run ended: counted as processed (and failed or requeued), its duration observed.
    pub fn job_finished(&self, class: &str, queue: &str, end: JobEnd, secs: f64) {
        self.job_series(class, queue, |s| {
            s.processed += 1;
            match end {
                JobEnd::Failed => s.failed += 1,
                JobEnd::Requeued => s.requeued += 1,
                JobEnd::Done => {}
            }
            s.duration.observe(secs);
        });
    }

    /// A failed job was retried, moved to the dead set or dropped.
    pub fn job_fate(&self, class: &str, queue: &str, fate: JobFate) {
        self.job_series(class, queue, |s| match fate {
            JobFate::Retried => s.retried += 1,
            JobFate::Dead => s.dead += 1,
            JobFate::Discarded => s.discarded += 1,
        });
    }

    /// The job series as labelled samples, added to `counters` and `histograms` (only the
    /// counts that are not zero, as if each had been counted there one by one).
    fn fold_jobs(
        &self,
        counters: &mut BTreeMap<(&'static str, Labels), u64>,
        histograms: &mut BTreeMap<(&'static str, Labels), Histogram>,
    ) {
        for (queue, classes) in self.jobs.lock().unwrap().iter() {
            let queue = capped(queue);
            for (class, s) in classes {
                let labels = || vec![("class", class.clone()), ("queue", queue.to_string())];
                for (name, n) in [
                    ("playguard_jobs_processed_total", s.processed),
                    ("playguard_jobs_failed_total", s.failed),
                    ("playguard_jobs_requeued_total", s.requeued),
                    ("playguard_jobs_retried_total", s.retried),
                    ("playguard_jobs_dead_total", s.dead),
                    ("playguard_jobs_discarded_total", s.discarded),
                ] {
                    if n > 0 {
                        *counters.entry((name, labels())).or_default() += n;
                    }
                }
                if s.duration.total > 0 {
                    let h = histograms
                        .entry(("playguard_job_duration_seconds", labels()))
                        .or_default();
                    for (c, add) in h.counts.iter_mut().zip(s.duration.counts) {
                        *c += add;
                    }
                    h.sum += s.duration.sum;
                    h.total += s.duration.total;
                }
            }
        }
    }

    /// A payload that is not a job went to the dead set (no class label: it has none).
    pub fn garbage(&self, queue: &str) {
        self.inc(
            "playguard_jobs_dead_total",
            vec![("class", "".into()), ("queue", queue.into())],
        );
    }

    /// `event` is what the cycle engine saw: acquired, skipped (held by another) or lost.
    /// (The class is the one shown, display_class maybe: bounded as the job families'.)
    pub fn lock_event(&self, class: &str, event: &'static str) {
        self.inc(
            "playguard_lock_events_total",
            vec![
                ("class", self.class_label(class)),
                ("event", event.to_string()),
            ],
        );
    }

    pub fn phase_finished(&self, class: &str, phase: &str, secs: f64) {
        self.observe(
            "playguard_phase_duration_seconds",
            vec![
                ("class", self.class_label(class)),
                ("phase", phase.to_string()),
            ],
            secs,
        );
    }

    /// One fetch round trip to Redis brought `n` jobs.
    pub fn fetch_batch(&self, n: usize) {
        self.fetched.fetch_add(n as u64, Ordering::Relaxed);
        self.fetch_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Read busy slots from the live slot table from now on (the launcher calls this).
    pub fn attach_slots(&self, slots: &std::sync::Arc<crate::process::slots::SlotTable>) {
        let _ = self.slots.set(std::sync::Arc::downgrade(slots));
    }

    /// Busy slots right now, read from the slot table (0 before one is attached).
    pub fn busy_now(&self) -> i64 {
        self.slots
            .get()
            .and_then(Weak::upgrade)
            .map_or(0, |w| w.busy() as i64)
    }

    pub fn set_latency(&self, queue: &str, secs: f64) {
        self.latency.lock().unwrap().insert(queue.to_string(), secs);
    }

    /// Healthy when Redis answered within `max_age_ms`.
    pub fn healthy(&self, max_age_ms: i64) -> bool {
        let last = self.last_redis_ok_ms.load(Ordering::Relaxed);
        last > 0 && chrono::Utc::now().timestamp_millis() - last <= max_age_ms
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut counters = self.counters.lock().unwrap().clone();
        let mut histograms = self.histograms.lock().unwrap().clone();
        self.fold_jobs(&mut counters, &mut histograms);
        for (fname, kind, help) in family_names(&counters, &histograms) {
            write_header(&mut out, fname, kind, help);
            if fname == "playguard_queue_latency_seconds" {
                self.write_latencies(&mut out, fname);
                continue;
            }
            write_samples(&mut out, fname, &counters, &histograms);
        }
        self.write_singles(&mut out);
        super::redis_gauges::write(&mut out, &self.redis);
        out
    }

    /// The queue latency family's samples, one per queue the heartbeat measured.
    fn write_latencies(&self, out: &mut String, fname: &str) {
        for (q, s) in self.latency.lock().unwrap().iter() {
            let _ = writeln!(out, "{fname}{{queue=\"{}\"}} {s}", escape(&capped(q)));
        }
    }

    /// The unlabelled families, read from their atomics: two gauges, the fetch counters, the
    /// trace export's drops and failures.
    fn write_singles(&self, out: &mut String) {
        let singles: [(&str, &str, &str, String); 6] = [
            (
                "playguard_busy_slots",
                "gauge",
                "Jobs running right now (the busy count the heartbeat publishes).",
                self.busy_now().to_string(),
            ),
            (
                "playguard_concurrency",
                "gauge",
                "Slots this process runs jobs in.",
                self.concurrency.load(Ordering::Relaxed).to_string(),
            ),
            (
                "playguard_fetched_jobs_total",
                "counter",
                "Jobs taken from Redis queues.",
                self.fetched.load(Ordering::Relaxed).to_string(),
            ),
            (
                "playguard_fetch_calls_total",
                "counter",
                "Fetch round trips to Redis.",
                self.fetch_calls.load(Ordering::Relaxed).to_string(),
            ),
            (
                "playguard_trace_spans_dropped_total",
                "counter",
                "Spans dropped because the OTLP export queue was full (traces/gate.rs).",
                crate::traces::dropped().to_string(),
            ),
            (
                "playguard_trace_exports_failed_total",
                "counter",
                "OTLP export requests that failed (their spans are lost).",
                crate::traces::failed_exports().to_string(),
            ),
        ];
        for (name, kind, help, v) in singles {
            write_header(out, name, kind, help);
            let _ = writeln!(out, "{name} {v}");
        }
    }
}

/// A family's `# HELP` and `# TYPE` lines.
fn write_header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// (name, type, help) of every labelled family to write.
fn family_names<'a>(
    counters: &'a BTreeMap<(&'static str, Labels), u64>,
    histograms: &'a BTreeMap<(&'static str, Labels), Histogram>,
) -> Vec<(&'a str, &'a str, &'a str)> {
    // Families we know first (each once, its samples right under its header), then any
    // family another module invented, with a bare TYPE line.
    let mut names: Vec<(&str, &str, &str)> = FAMILIES.to_vec();
    for (name, _) in counters.keys() {
        if family(name).is_none() && !names.iter().any(|(n, _, _)| n == name) {
            names.push((name, "counter", "playguard counter."));
        }
    }
    for (name, _) in histograms.keys() {
        if family(name).is_none() && !names.iter().any(|(n, _, _)| n == name) {
            names.push((name, "histogram", "playguard histogram."));
        }
    }
    names
}

/// The samples of family `fname`: its counters, then its histograms (buckets, sum, count).
fn write_samples(
    out: &mut String,
    fname: &str,
    counters: &BTreeMap<(&'static str, Labels), u64>,
    histograms: &BTreeMap<(&'static str, Labels), Histogram>,
) {
    for ((name, labels), v) in counters.iter().filter(|((n, _), _)| *n == fname) {
        let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
    }
    for ((name, labels), h) in histograms.iter().filter(|((n, _), _)| *n == fname) {
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{} {}",
                fmt_labels(labels, Some(&b.to_string())),
                h.counts[i]
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{} {}",
            fmt_labels(labels, Some("+Inf")),
            h.total
        );
        let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels, None), h.sum);
        let _ = writeln!(out, "{name}_count{} {}", fmt_labels(labels, None), h.total);
    }
}

/// `s` if it fits MAX_LABEL_BYTES; else its head, cut at a char boundary, then "…" and a hash
/// of the whole (FNV-1a, the same in every process), so two long names with one head stay
/// two labels and a dashboard sees where a name was cut.
fn capped(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_LABEL_BYTES {
        return Cow::Borrowed(s);
    }
    let hash = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let suffix = format!("…{hash:016x}");
    let mut end = MAX_LABEL_BYTES - suffix.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{suffix}", &s[..end]))
}

/// Cut every label value that is too long (see `capped`).
fn cap_values(labels: &mut Labels) {
    for (_, v) in labels.iter_mut() {
        if v.len() > MAX_LABEL_BYTES {
            *v = capped(v).into_owned();
        }
    }
}

fn fmt_labels(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_one_header_and_samples_follow_it() {
        let m = Metrics::default();
        m.job_finished("A", "default", JobEnd::Done, 0.02);
        m.lock_event("A", "acquired");
        m.set_latency("default", 1.5);
        let text = m.render();
        for (name, kind, _) in FAMILIES {
            assert_eq!(
                text.matches(&format!("# TYPE {name} {kind}\n")).count(),
                1,
                "{name}\n{text}"
            );
        }
        assert!(text.contains("playguard_jobs_processed_total{class=\"A\",queue=\"default\"} 1\n"));
        assert!(text.contains("playguard_lock_events_total{class=\"A\",event=\"acquired\"} 1\n"));
        assert!(text.contains("playguard_queue_latency_seconds{queue=\"default\"} 1.5\n"));
        assert!(text.contains(
            "playguard_job_duration_seconds_bucket{class=\"A\",queue=\"default\",le=\"0.025\"} 1\n"
        ));
        assert!(text.contains("playguard_busy_slots 0\n"));
    }

    /// Distinct class names from payloads (display_class can be anything) keep one series
    /// per label, not one per raw name: past MAX_CLASS_LABELS they share "other".
    #[test]
    fn job_series_are_kept_per_label_not_per_raw_class() {
        let m = Metrics::default();
        for i in 0..10_000 {
            m.job_finished(&format!("Class{i}"), "q", JobEnd::Done, 0.001);
        }
        let series = m.jobs.lock().unwrap().get("q").map_or(0, |c| c.len());
        assert!(series <= MAX_CLASS_LABELS + 1, "{series} series");
        let text = m.render();
        let total: u64 = text
            .lines()
            .filter(|l| l.starts_with("playguard_jobs_processed_total{"))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, 10_000);
    }

    /// A cycle's class label comes from its payload too (display_class): lock events and
    /// phases are bounded in count and length like the job families.
    #[test]
    fn lock_and_phase_labels_are_bounded() {
        let m = Metrics::default();
        for i in 0..1_000 {
            let class = format!("{}{i}", "C".repeat(5_000));
            m.lock_event(&class, "acquired");
            m.phase_finished(&class, "plan", 0.5);
        }
        let counters = m.counters.lock().unwrap();
        let histograms = m.histograms.lock().unwrap();
        assert!(counters.len() <= MAX_CLASS_LABELS + 1, "{}", counters.len());
        assert!(
            histograms.len() <= MAX_CLASS_LABELS + 1,
            "{}",
            histograms.len()
        );
        for (_, labels) in counters.keys().chain(histograms.keys()) {
            for (_, v) in labels {
                assert!(v.len() <= 100, "a label of {} bytes", v.len());
            }
        }
        let acquired: u64 = counters.values().sum();
        assert_eq!(acquired, 1_000);
    }

    #[test]
    fn long_values_are_cut_at_a_char_boundary_and_stay_apart() {
        assert_eq!(capped("OkJob"), "OkJob");
        let fits = "x".repeat(MAX_LABEL_BYTES);
        assert_eq!(capped(&fits), fits);
        let a = capped(&"é".repeat(300)).into_owned();
        let b = capped(&format!("{}!", "é".repeat(300))).into_owned();
        for v in [&a, &b] {
            assert!(v.len() <= MAX_LABEL_BYTES && v.starts_with("éé"), "{v}");
            assert!(v.contains('…'), "{v}");
        }
        assert_ne!(a, b);
        assert_eq!(capped(&"é".repeat(300)), a, "the same name, the same label");
    }
}
