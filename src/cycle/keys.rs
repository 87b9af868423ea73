//! Lock key and label templates: `{args.N}`, `{class}`, `{queue}` (and `{jid}` in labels)
//! filled from a job, checked once when a manifest is loaded and rendered at every cycle. A
//! rendered key never reaches another key (no `:`, brace or whitespace from an argument).
//! Touches no Redis keys itself.

use serde_json::Value;

/// Placeholders a lock key may use: `{args.N}`, `{class}`, `{queue}`. Not `{jid}`: a lock per
/// job excludes nothing, and each key's `:fence` counter lives forever (fences must never go
/// back), so a per-jid key would leave one counter behind per job. `{{` and `}}` are literal
/// braces, so a key can carry a Redis Cluster hash tag: `pg:{{marquee-{args.0}}}`.
pub fn check_template(t: &str) -> Result<(), String> {
    for piece in pieces(t).map_err(|e| format!("lock.key {t:?}: {e}"))? {
        if let Piece::Placeholder(name) = piece {
            let ok = matches!(name, "class" | "queue")
                || name
                    .strip_prefix("args.")
                    .is_some_and(|n| n.parse::<usize>().is_ok());
            if !ok {
                return Err(format!(
                    "lock.key {t:?}: unknown placeholder {{{name}}} (use {{args.N}}, {{class}}, {{queue}})"
                ));
            }
        }
    }
    Ok(())
}

enum Piece<'a> {
    Text(&'a str),
    Placeholder(&'a str),
}

/// Split a template into literal text and `{name}` placeholders (`{{`, `}}` are literal).
fn pieces(t: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = t;
    while let Some(i) = rest.find(['{', '}']) {
        if i > 0 {
            out.push(Piece::Text(&rest[..i]));
        }
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push(Piece::Text(&tail[..1]));
            rest = &tail[2..];
        } else if tail.starts_with('}') {
            return Err("a lone '}' (write '}}' for a literal brace)".into());
        } else {
            let close = tail
                .find('}')
                .ok_or("unclosed '{' (write '{{' for a literal brace)")?;
            out.push(Piece::Placeholder(&tail[1..close]));
            rest = &tail[close + 1..];
        }
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    Ok(out)
}

/// Fill a label template from a job (for log lines): anything goes, a missing argument is `nil`.
pub fn render_template(t: &str, jid: &str, class: &str, queue: &str, args: &[Value]) -> String {
    render(t, jid, class, queue, args, false).unwrap_or_else(|_| t.to_string())
}

/// Fill a lock key template from a job. A string argument is used as is, a number as JSON.
/// Refused (the reason is returned) when the key would not be a key of its own: an argument
/// that is missing, null, empty, not a string or number, or holds a `:` (`9:fence` would be
/// Marquee 9's fence counter; `x:other` a key of another namespace), a brace (a hash tag of
/// its own), whitespace or a control character.
pub fn render_key(
    t: &str,
    jid: &str,
    class: &str,
    queue: &str,
    args: &[Value],
) -> Result<String, String> {
    render(t, jid, class, queue, args, true)
}

fn render(
    t: &str,
    jid: &str,
    class: &str,
    queue: &str,
    args: &[Value],
    strict: bool,
) -> Result<String, String> {
    let mut out = String::new();
    for piece in pieces(t)? {
        let name = match piece {
            Piece::Text(s) => {
                out.push_str(s);
                continue;
            }
            Piece::Placeholder(name) => name,
        };
        match name {
            "jid" => out.push_str(jid),
            "class" => out.push_str(class),
            "queue" => out.push_str(queue),
            _ => {
                let i: usize = name
                    .strip_prefix("args.")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(usize::MAX);
                let value = match args.get(i) {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Number(_)) => v.to_string(),
                    Some(v) if !strict => v.to_string(),
                    None if !strict => "nil".to_string(),
                    None => {
                        return Err(format!(
                            "{{{name}}} is missing (the job has {} argument(s))",
                            args.len()
                        ))
                    }
                    Some(v) => return Err(format!("{{{name}}} is {v}, not a string or number")),
                };
                if strict {
                    if value.is_empty() {
                        return Err(format!("{{{name}}} is an empty string"));
                    }
                    if let Some(c) = value.chars().find(|c| {
                        matches!(c, ':' | '{' | '}') || c.is_whitespace() || c.is_control()
                    }) {
                        return Err(format!(
                            "{{{name}}} = {value:?} holds {c:?}, which would reach another key"
                        ));
                    }
                }
                out.push_str(&value);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_templates() {
        let args = vec![Value::from(42), Value::from("m-1")];
        assert_eq!(
            render_template("pg:{args.0}:{args.1}:{jid}", "j", "C", "q", &args),
            "pg:42:m-1:j"
        );
        assert_eq!(
            render_key("pg:{{m-{args.0}}}:{queue}", "j", "C", "q", &args).unwrap(),
            "pg:{m-42}:q"
        );
        for bad in [
            vec![Value::from("9:fence")],
            vec![],
            vec![Value::Null],
            vec![Value::from("")],
        ] {
            let e = render_key("pg:{args.0}", "j", "C", "q", &bad).unwrap_err();
            assert!(e.contains("{args.0}"), "{e}");
        }
        assert!(check_template("pg:{{{args.0}}}").is_ok());
        assert!(check_template("pg:}").is_err() && check_template("pg:{args.0").is_err());
    }
}
