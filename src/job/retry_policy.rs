//! A manifest job's own failure policy (`[[job]]` `retry_in`, `max_retries`), the place of a
//! Ruby class's `sidekiq_retry_in` and `sidekiq_options retry:`, and the exit-code contract
//! of command jobs: discard, kill, snooze. Touches no Redis keys (`retry.rs` decides what
//! lands where).

use serde_json::{Map, Value};

/// A command exiting with this drops its job: no retry, no dead (`sidekiq_retry_in` `:discard`).
pub const EXIT_DISCARD: i32 = 97;
/// A command exiting with this sends its job straight to `dead` (`:kill`), retries skipped.
pub const EXIT_KILL: i32 = 98;
/// A command exiting with this, its last stderr line the seconds to wait, snoozes its job:
/// back to `schedule` that much later, no retry counted.
pub const EXIT_SNOOZE: i32 = 99;
/// Where a snoozed job's snooze count is kept in its payload.
pub const SNOOZES_KEY: &str = "playguard_snoozes";
/// Snoozes a job may take; the next one counts as a failure (retried or dead as usual).
pub const MAX_SNOOZES: i64 = 100;
/// Retry counts a `retry_in` expression is checked over when the manifest loads.
const CHECKED_COUNTS: i64 = 100;

/// What a command's exit code asks for beyond a plain failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Discard,
    Kill,
    Snooze(u64),
}

impl Verdict {
    /// The verdict of exit `code` with `last_line` its last stderr line; Err: a snooze whose
    /// seconds cannot be read (then it is a plain failure, with this reason).
    pub fn of_exit(code: i32, last_line: Option<&str>) -> Result<Option<Verdict>, String> {
        match code {
            EXIT_DISCARD => Ok(Some(Verdict::Discard)),
            EXIT_KILL => Ok(Some(Verdict::Kill)),
            EXIT_SNOOZE => {
                let line = last_line.unwrap_or("").trim();
                let secs = line.strip_prefix("snooze").unwrap_or(line).trim();
                match secs.parse::<u64>() {
                    Ok(n) => Ok(Some(Verdict::Snooze(n))),
                    Err(_) => Err(format!(
                        "exit {EXIT_SNOOZE} (snooze) needs the seconds as its last stderr line, got {line:?}"
                    )),
                }
            }
            _ => Ok(None),
        }
    }
}

/// A `[[job]]`'s failure policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policy {
    pub retry_in: Option<RetryIn>,
    /// Replaces the count of the payload's `retry` (`true` or a number); `retry: false` stays.
    pub max_retries: Option<i64>,
}

/// The delay before retry `count` (0 for the first failure), before jitter.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryIn {
    /// Seconds by count; past the end the last one again.
    List(Vec<u64>),
    Expr(Expr),
}

impl RetryIn {
    /// From the manifest value: a list of whole seconds >= 0 (not empty) or an expression.
    pub fn parse(v: &toml::Value) -> Result<RetryIn, String> {
        match v {
            toml::Value::Array(items) if items.is_empty() => {
                Err("retry_in: the list is empty (give at least one delay)".into())
            }
            toml::Value::Array(items) => items
                .iter()
                .map(|i| match i.as_integer() {
                    Some(n) if n >= 0 => Ok(n as u64),
                    _ => Err(format!(
                        "retry_in: {i} is not a whole number of seconds >= 0"
                    )),
                })
                .collect::<Result<_, _>>()
                .map(RetryIn::List),
            toml::Value::String(s) => {
                let e = Expr::parse(s).map_err(|why| format!("retry_in = {s:?}: {why}"))?;
                for count in 0..=CHECKED_COUNTS {
                    match e.eval(count) {
                        Some(d) if d >= 0 => {}
                        Some(d) => {
                            return Err(format!(
                                "retry_in = {s:?} is negative ({d}) at count {count}"
                            ))
                        }
                        None => return Err(format!("retry_in = {s:?} overflows at count {count}")),
                    }
                }
                Ok(RetryIn::Expr(e))
            }
            other => Err(format!(
                "retry_in: {other} is neither a list of seconds nor an expression string"
            )),
        }
    }

    /// Seconds before retry `count`, jitter not added; None: Sidekiq's default backoff (as
    /// a `sidekiq_retry_in` returning 0 or less falls back to it).
    pub fn delay(&self, count: i64) -> Option<i64> {
        let d = match self {
            RetryIn::List(l) => {
                let i = (count.max(0) as usize).min(l.len() - 1);
                l[i] as i64
            }
            RetryIn::Expr(e) => e.eval(count).unwrap_or(i64::MAX / 4),
        };
        (d > 0).then_some(d)
    }
}

/// An integer expression of `count`: numbers, `count`, `+ - * **` and parentheses.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Num(i64),
    Count,
    Op(Box<Expr>, char, Box<Expr>),
}

impl Expr {
    pub fn parse(s: &str) -> Result<Expr, String> {
        let tokens = tokenize(s)?;
        let mut p = Parser { tokens, at: 0 };
        let e = p.sum()?;
        match p.tokens.get(p.at) {
            None => Ok(e),
            Some(t) => Err(format!("unexpected {t:?}")),
        }
    }

    /// None on overflow.
    pub fn eval(&self, count: i64) -> Option<i64> {
        match self {
            Expr::Num(n) => Some(*n),
            Expr::Count => Some(count),
            Expr::Op(a, op, b) => {
                let (a, b) = (a.eval(count)?, b.eval(count)?);
                match op {
                    '+' => a.checked_add(b),
                    '-' => a.checked_sub(b),
                    '*' => a.checked_mul(b),
                    _ => a.checked_pow(u32::try_from(b).ok()?),
                }
            }
        }
    }
}

fn tokenize(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ' ' => {}
            '+' | '-' | '(' | ')' => out.push(c.to_string()),
            '*' if chars.peek() == Some(&'*') => {
                chars.next();
                out.push("**".into());
            }
            '*' => out.push("*".into()),
            '0'..='9' => {
                let mut n = c.to_string();
                while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                    n.push(*d);
                    chars.next();
                }
                out.push(n);
            }
            'a'..='z' | '_' => {
                let mut w = c.to_string();
                while let Some(d) = chars
                    .peek()
                    .filter(|d| d.is_ascii_alphanumeric() || **d == '_')
                {
                    w.push(*d);
                    chars.next();
                }
                if w != "count" {
                    return Err(format!("unknown name {w:?} (only `count`)"));
                }
                out.push(w);
            }
            other => {
                return Err(format!(
                    "unexpected {other:?} (only numbers, count, + - * ** and parentheses)"
                ))
            }
        }
    }
    if out.is_empty() {
        return Err("empty expression".into());
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<String>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    fn sum(&mut self) -> Result<Expr, String> {
        let mut e = self.product()?;
        while let Some(op @ ("+" | "-")) = self.peek() {
            let op = op.chars().next().unwrap_or('+');
            self.at += 1;
            e = Expr::Op(Box::new(e), op, Box::new(self.product()?));
        }
        Ok(e)
    }

    fn product(&mut self) -> Result<Expr, String> {
        let mut e = self.power()?;
        while self.peek() == Some("*") {
            self.at += 1;
            e = Expr::Op(Box::new(e), '*', Box::new(self.power()?));
        }
        Ok(e)
    }

    fn power(&mut self) -> Result<Expr, String> {
        let base = self.atom()?;
        if self.peek() == Some("**") {
            self.at += 1;
            return Ok(Expr::Op(Box::new(base), '^', Box::new(self.power()?)));
        }
        Ok(base)
    }

    fn atom(&mut self) -> Result<Expr, String> {
        let t = self.peek().map(str::to_string);
        self.at += 1;
        match t.as_deref() {
            Some("count") => Ok(Expr::Count),
            Some("(") => {
                let e = self.sum()?;
                if self.peek() != Some(")") {
                    return Err("missing `)`".into());
                }
                self.at += 1;
                Ok(e)
            }
            Some(n) if n.starts_with(|c: char| c.is_ascii_digit()) => n
                .parse()
                .map(Expr::Num)
                .map_err(|_| format!("{n} is too large")),
            Some(t) => Err(format!("unexpected {t:?}")),
            None => Err("ends too early".into()),
        }
    }
}

/// The snoozes a payload has taken.
pub fn snoozes(msg: &Map<String, Value>) -> i64 {
    msg.get(SNOOZES_KEY).and_then(Value::as_i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expressions_follow_precedence() {
        let e = Expr::parse("count ** 4 + 15").unwrap();
        assert_eq!(e.eval(2), Some(31));
        assert_eq!(Expr::parse("2 * (count + 1) - 1").unwrap().eval(3), Some(7));
        assert_eq!(Expr::parse("2 ** 3 ** 2").unwrap().eval(0), Some(512));
        for bad in ["", "count +", "system(1)", "count / 2", "(count"] {
            assert!(Expr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lists_repeat_their_last_and_bad_values_are_refused() {
        let l = RetryIn::parse(&toml::Value::try_from(vec![5, 60]).unwrap()).unwrap();
        assert_eq!(
            (l.delay(0), l.delay(1), l.delay(9)),
            (Some(5), Some(60), Some(60))
        );
        assert!(RetryIn::parse(&toml::Value::Array(vec![])).is_err());
        assert!(RetryIn::parse(&toml::Value::try_from(vec![-1]).unwrap()).is_err());
        assert!(RetryIn::parse(&toml::Value::String("10 - count".into())).is_err());
        assert!(RetryIn::parse(&toml::Value::String("count ** 40".into())).is_err());
    }

    #[test]
    fn exit_codes() {
        assert_eq!(Verdict::of_exit(97, None), Ok(Some(Verdict::Discard)));
        assert_eq!(Verdict::of_exit(98, None), Ok(Some(Verdict::Kill)));
        assert_eq!(
            Verdict::of_exit(99, Some("snooze 30")),
            Ok(Some(Verdict::Snooze(30)))
        );
        assert_eq!(
            Verdict::of_exit(99, Some("7")),
            Ok(Some(Verdict::Snooze(7)))
        );
        assert!(Verdict::of_exit(99, Some("soon")).is_err());
        assert_eq!(Verdict::of_exit(1, None), Ok(None));
    }
}
