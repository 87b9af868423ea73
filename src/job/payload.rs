//! A fetched job: the exact popped string plus its parsed JSON object.
//!
//! The popped string is the source of truth: we parse it with
//! serde_json's `arbitrary_precision` + `preserve_order`, so unknown keys, key order, 2**70 and
//! float spellings survive every re-push. Touches no Redis keys.

use serde_json::{Map, Number, Value};

/// The class name Rails' ActiveJob adapter enqueues (Sidekiq <= 7), and Sidekiq 8's alias.
pub const ACTIVE_JOB_WRAPPERS: [&str; 2] = [
    "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
    "Sidekiq::ActiveJob::Wrapper",
];

#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("job payload is JSON but not an object")]
    NotObject,
}

/// One job as fetched from `queue:<queue>`.
///
/// Only the fields the job's run needs are parsed up front (`Head`); the whole object, with
/// every key in order, is parsed the first time `msg` is asked for, which only a failure
/// (Sidekiq's retry bookkeeping) does. A finished job never builds it.
#[derive(Debug, Clone)]
pub struct Job {
    /// The exact string popped from Redis; pushed back unchanged on requeue. Shared with the
    /// job's context and its slot (the Busy page's payload).
    pub raw: std::sync::Arc<str>,
    /// The queue it was popped from (Sidekiq uses this, not the payload's `queue`, for retries).
    pub queue: std::sync::Arc<str>,
    head: Head,
    msg: std::sync::OnceLock<Map<String, Value>>,
}

/// The top-level fields a run reads, named once: `Head` holds each as a `Field` (the JSON
/// value the payload has, or where in the payload a plain string is), `HeadRef` the same fields
/// borrowed from the payload (every other key is skipped: checked as JSON, never built). A
/// field given twice fails the borrowed parse; the full parse then decides (its rule: the last
/// one wins), so the answer never differs from parsing the whole object.
macro_rules! head_fields {
    ($($field:ident),*) => {
        #[derive(Debug, Clone, Default)]
        struct Head {
            $($field: Field,)*
        }

        #[derive(serde::Deserialize)]
        struct HeadRef<'a> {
            $(
                #[serde(borrow, default, deserialize_with = "present")]
                $field: Option<&'a serde_json::value::RawValue>,
            )*
        }

        impl Head {
            fn from_ref(h: HeadRef<'_>, raw: &str) -> Result<Head, serde_json::Error> {
                Ok(Head {
                    $($field: match h.$field {
                        Some(r) => Field::of(r.get(), raw)?,
                        None => Field::Absent,
                    },)*
                })
            }

            fn from_map(m: &Map<String, Value>) -> Head {
                Head {
                    $($field: m
                        .get(stringify!($field))
                        .map_or(Field::Absent, |v| Field::Value(Box::new(v.clone()))),)*
                }
            }

            /// Every field as a JSON value (None = absent), whatever its form.
            #[cfg(test)]
            fn values(&self, raw: &str) -> Vec<Option<Value>> {
                vec![$(self.$field.value(raw),)*]
            }
        }
    };
}

/// One head field. A plain string (no escapes, the common case) is where it lies in the
/// payload, not a copy: reading it allocates nothing.
#[derive(Debug, Clone, Default)]
enum Field {
    #[default]
    Absent,
    /// A string without escapes: `raw[start..end]`, the text between its quotes.
    Text(usize, usize),
    /// `[]`.
    EmptyArray,
    /// Anything else, parsed.
    Value(Box<Value>),
}

impl Field {
    /// The field from its JSON text `text`, a slice of `raw` the borrowed parse has already
    /// checked is valid JSON: a string without escapes is exactly the text between its quotes
    /// (control characters would have failed that check, and a quote inside needs a
    /// backslash), `[]` is an empty array, everything else is parsed.
    fn of(text: &str, raw: &str) -> Result<Field, serde_json::Error> {
        if let Some(inner) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
            // Borrowed from `raw`, so inside it (checked, not assumed).
            let (base, at) = (raw.as_ptr() as usize, inner.as_ptr() as usize);
            let inside = at >= base && at + inner.len() <= base + raw.len();
            if inside && !inner.as_bytes().contains(&b'\\') {
                return Ok(Field::Text(at - base, at - base + inner.len()));
            }
        }
        if text == "[]" {
            return Ok(Field::EmptyArray);
        }
        serde_json::from_str(text).map(|v| Field::Value(Box::new(v)))
    }

    /// A string field's text (None when absent or not a string).
    fn str<'a>(&'a self, raw: &'a str) -> Option<&'a str> {
        match self {
            Field::Text(a, b) => raw.get(*a..*b),
            Field::Value(v) => v.as_str(),
            _ => None,
        }
    }

    /// The field as a JSON value (None when absent).
    fn value(&self, raw: &str) -> Option<Value> {
        match self {
            Field::Absent => None,
            Field::Text(..) => self.str(raw).map(Value::from),
            Field::EmptyArray => Some(Value::Array(Vec::new())),
            Field::Value(v) => Some((**v).clone()),
        }
    }
}

// The last five are Pro and Enterprise options (`job/options.rs`): read on every job, so they
// are head fields rather than a reason to parse the whole object.
head_fields!(
    class,
    args,
    jid,
    wrapped,
    display_class,
    retry_count,
    expires_at,
    unique_for,
    unique_until,
    bid,
    encrypt
);

/// A key that is there, even as `null`, is Some (as `Map::get` sees it).
fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'de serde_json::value::RawValue>, D::Error> {
    serde::Deserialize::deserialize(d).map(Some)
}

impl Job {
    pub fn parse(
        queue: impl Into<std::sync::Arc<str>>,
        raw: impl Into<std::sync::Arc<str>>,
    ) -> Result<Job, PayloadError> {
        let raw = raw.into();
        let msg = std::sync::OnceLock::new();
        // serde would also read a struct from a JSON array, by position: objects only.
        let object = raw.trim_start().starts_with('{');
        let head = match object
            .then(|| serde_json::from_str::<HeadRef>(&raw).map(|h| Head::from_ref(h, &raw)))
        {
            Some(Ok(Ok(h))) => h,
            // Not an object, not JSON, a key given twice: the full parse says which.
            _ => match serde_json::from_str::<Value>(&raw)? {
                Value::Object(m) => {
                    let h = Head::from_map(&m);
                    let _ = msg.set(m);
                    h
                }
                _ => return Err(PayloadError::NotObject),
            },
        };
        Ok(Job {
            raw,
            queue: queue.into(),
            head,
            msg,
        })
    }

    /// The whole payload object (keys in order, numbers as spelled), parsed on first use.
    pub fn msg(&self) -> &Map<String, Value> {
        self.msg
            .get_or_init(|| match serde_json::from_str(&self.raw) {
                Ok(Value::Object(m)) => m,
                // Parsed as an object once already (`parse`): cannot happen.
                _ => Map::new(),
            })
    }

    /// Whether this is a job at all: `class` a non-empty string, `args` (when present) an
    /// array, as Sidekiq's client insists. The reason otherwise.
    pub fn check(&self) -> Result<(), String> {
        match self.head.class.str(&self.raw) {
            Some(c) if !c.is_empty() => {}
            _ => match self.head.class.value(&self.raw) {
                None => return Err("the payload has no class".into()),
                Some(v) => return Err(format!("class is {v}, not a class name")),
            },
        }
        match &self.head.args.value(&self.raw) {
            None | Some(Value::Array(_)) => Ok(()),
            Some(v) => Err(format!(
                "args is {}, not an array",
                match v {
                    Value::String(_) => "a string",
                    Value::Object(_) => "an object",
                    Value::Null => "null",
                    Value::Bool(_) => "a boolean",
                    _ => "a number",
                }
            )),
        }
    }

    pub fn jid(&self) -> &str {
        self.head.jid.str(&self.raw).unwrap_or("")
    }

    /// The `class` field as enqueued (the wrapper for ActiveJob).
    pub fn class(&self) -> &str {
        self.head.class.str(&self.raw).unwrap_or("")
    }

    /// `wrapped`: the job class Rails' adapter names for a wrapper payload.
    pub fn wrapped(&self) -> Option<&str> {
        self.head.wrapped.str(&self.raw)
    }

    pub fn args(&self) -> Vec<Value> {
        match &self.head.args {
            Field::Value(v) => v.as_array().cloned().unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    fn active_job(&self) -> Option<&Map<String, Value>> {
        if !ACTIVE_JOB_WRAPPERS.contains(&self.class()) {
            return None;
        }
        match &self.head.args {
            Field::Value(v) => v.as_array()?.first()?.as_object(),
            _ => None,
        }
    }

    /// The class we dispatch on: `args[0].job_class` for ActiveJob wrappers, else `class`.
    pub fn dispatch_class(&self) -> &str {
        self.active_job()
            .and_then(|aj| aj.get("job_class"))
            .and_then(Value::as_str)
            .unwrap_or_else(|| self.class())
    }

    /// The arguments a handler sees: ActiveJob's `arguments` array, else `args`.
    pub fn dispatch_args(&self) -> Vec<Value> {
        match self.active_job().and_then(|aj| aj.get("arguments")) {
            Some(Value::Array(a)) => a.clone(),
            _ => self.args(),
        }
    }

    /// Name shown in logs, following the Web UI's display rule (display_class, wrapped, class).
    pub fn display_class(&self) -> &str {
        self.display_class_or(self.dispatch_class())
    }

    /// `display_class` when `dispatch_class` is already known.
    pub fn display_class_or<'a>(&'a self, dispatch_class: &'a str) -> &'a str {
        self.head
            .display_class
            .str(&self.raw)
            .or_else(|| self.wrapped())
            .unwrap_or(dispatch_class)
    }

    /// One of the Pro and Enterprise option fields (`job/options.rs`), None when absent.
    pub fn option(&self, key: &str) -> Option<Value> {
        let field = match key {
            "expires_at" => &self.head.expires_at,
            "unique_for" => &self.head.unique_for,
            "unique_until" => &self.head.unique_until,
            "bid" => &self.head.bid,
            "encrypt" => &self.head.encrypt,
            _ => return None,
        };
        field.value(&self.raw)
    }

    pub fn retry_count(&self) -> Option<i64> {
        match &self.head.retry_count {
            Field::Value(v) => v.as_i64(),
            _ => None,
        }
    }

    /// Sidekiq 8 writes integer epoch milliseconds; <= 7 float seconds. We answer in the unit
    /// the job's own `created_at` uses.
    pub fn uses_millis(&self) -> bool {
        // From the whole object: no run needs it, and a number costs the head parse more
        // than all its other fields (arbitrary_precision keeps each one's spelling).
        uses_millis(self.msg())
    }
}

pub fn uses_millis(msg: &Map<String, Value>) -> bool {
    matches!(msg.get("created_at"), Some(Value::Number(n)) if n.is_i64() || n.is_u64())
}

/// The class a run is counted under: `wrapped || class`, as the metrics middleware does.
pub fn class_of(job: &Job) -> &str {
    job.wrapped().unwrap_or_else(|| job.class())
}

/// Float epoch seconds as Ruby's `Time.now.to_f` (shortest round-trip float).
pub fn now_f64() -> f64 {
    let now = chrono::Utc::now();
    now.timestamp() as f64 + f64::from(now.timestamp_subsec_nanos()) / 1e9
}

/// "now" as a JSON number in the job's unit.
pub fn now_value(millis: bool) -> Value {
    if millis {
        Value::Number(Number::from(chrono::Utc::now().timestamp_millis()))
    } else {
        float_value(now_f64())
    }
}

pub fn float_value(f: f64) -> Value {
    Number::from_f64(f)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

/// Serialize as Sidekiq's `JSON.generate` does: compact, raw UTF-8.
pub fn dump(msg: &Map<String, Value>) -> String {
    serde_json::to_string(msg).expect("a JSON map always serializes")
}

/// A fresh jid: 12 random bytes as 24 lowercase hex characters, as SecureRandom.hex(12).
pub fn new_jid() -> String {
    let bytes: [u8; 12] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_big_ints_floats_and_unknown_keys() {
        let raw = r#"{"class":"A","args":[1180591620717411303424,1.5,1.0,"é"],"zz":{"k":[null]},"jid":"x","created_at":1796095478.8430314}"#;
        let job = Job::parse("default", raw.to_string()).unwrap();
        assert_eq!(dump(job.msg()), raw);
        assert!(!job.uses_millis());
    }

    #[test]
    fn active_job_dispatches_on_job_class() {
        let raw = r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"SendReportJob","args":[{"job_class":"SendReportJob","arguments":[7,"x"]}],"jid":"j"}"#;
        let job = Job::parse("default", raw.to_string()).unwrap();
        assert_eq!(job.dispatch_class(), "SendReportJob");
        assert_eq!(job.dispatch_args(), vec![Value::from(7), Value::from("x")]);
    }

    #[test]
    fn head_and_full_parse_agree() {
        for raw in [
            r#"{"class":"A","class":"B","args":[1]}"#,
            r#"{"class":null,"args":"x"}"#,
            r#"{"class":"A\u00e9","jid":"j\"1","args":[{"k":1e400}],"retry_count":2}"#,
            r#"{"args":[]}"#,
            r#"{"class":"Plain::Job","jid":"abc","args":[ ],"wrapped":"","display_class":"é x"}"#,
        ] {
            let job = Job::parse("q", raw.to_string()).unwrap();
            let full = match serde_json::from_str::<Value>(raw).unwrap() {
                Value::Object(m) => m,
                _ => unreachable!(),
            };
            let head = Head::from_map(&full);
            assert_eq!(job.head.values(raw), head.values(raw), "{raw}");
            assert_eq!(job.msg(), &full);
        }
        assert!(matches!(
            Job::parse("q", "[1]"),
            Err(PayloadError::NotObject)
        ));
        assert!(matches!(Job::parse("q", "{"), Err(PayloadError::Json(_))));
    }

    #[test]
    fn millis_detected_by_json_type() {
        let job = Job::parse("q", r#"{"created_at":1796095478843}"#).unwrap();
        assert!(job.uses_millis());
        assert!(now_value(true).is_i64());
    }

    #[test]
    fn jid_is_24_hex() {
        let j = new_jid();
        assert_eq!(j.len(), 24);
        assert!(j
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }
}
