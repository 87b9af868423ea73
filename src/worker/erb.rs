//! The ERB subset Rails apps write in `config/sidekiq.yml`, evaluated without Ruby: tags as
//! Sidekiq 7.3+ reads the file (`ERB.new(text, trim_mode: "-")`), and expressions built only
//! from `ENV["X"]`, `ENV.fetch("X")`, `ENV.fetch("X", d)`, `ENV.fetch("X") { d }`, `a || b`,
//! `.to_i`, parentheses and integer, string, boolean and nil literals. Anything else is an error
//! naming the line and the expression, never a guess. Touches no Redis keys.

use std::collections::HashMap;

/// Why a template could not be evaluated: the 1-based line of its tag and the tag's code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErbError {
    pub line: usize,
    pub expr: String,
    pub reason: String,
}

impl std::fmt::Display for ErbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "line {}: ERB `{}`: {}",
            self.line,
            self.expr.split_whitespace().collect::<Vec<_>>().join(" "),
            self.reason
        )
    }
}

/// Render `text` with `env` standing for Ruby's `ENV`.
pub fn render_with(text: &str, env: &HashMap<String, String>) -> Result<String, ErbError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut line = 1;
    while let Some((before, tag_start, after)) = next_start_tag(rest) {
        out.push_str(before);
        line += before.matches('\n').count();
        if tag_start == "<%%" {
            // ERB's escape for a literal `<%`.
            out.push_str("<%");
            line += tag_start.matches('\n').count();
            rest = after;
            continue;
        }
        let Some((code, trim, tail)) = split_end_tag(after) else {
            return Err(error(line, after, "the tag has no closing %>"));
        };
        let tag_line = line + tag_start.matches('\n').count();
        emit(tag_start, code, tag_line, env, &mut out)?;
        line = tag_line + code.matches('\n').count();
        rest = match (trim, tail.strip_prefix("\r\n").or(tail.strip_prefix('\n'))) {
            (true, Some(t)) => {
                line += 1;
                t
            }
            _ => tail,
        };
    }
    out.push_str(rest);
    Ok(out)
}

fn error(line: usize, expr: &str, reason: &str) -> ErbError {
    ErbError {
        line,
        expr: expr.trim().to_string(),
        reason: reason.to_string(),
    }
}

/// Evaluate one tag: `<%=` writes its value, `<%#` is a comment, `<%`/`<%-` may hold only a
/// Ruby comment (statements such as `if` are refused).
fn emit(
    start: &str,
    code: &str,
    line: usize,
    env: &HashMap<String, String>,
    out: &mut String,
) -> Result<(), ErbError> {
    if start.ends_with("<%#") {
        return Ok(());
    }
    if start.ends_with("<%=") {
        let value = Parser::new(code, env)
            .whole()
            .map_err(|reason| error(line, code, &reason))?;
        out.push_str(&value.to_s());
        return Ok(());
    }
    let code_trim = code.trim();
    if code_trim.is_empty() || (code_trim.starts_with('#') && !code_trim.contains('\n')) {
        return Ok(());
    }
    Err(error(
        line,
        code,
        "only <%= expression %> and comments are evaluated (no statements)",
    ))
}

/// The next start tag, as ERB's explicit-trim scanner finds it: `<%-` with only spaces or tabs
/// before it on its line drops them. Returns (text before, the tag with any dropped
/// indentation, text after).
fn next_start_tag(s: &str) -> Option<(&str, &str, &str)> {
    let at = s.find("<%")?;
    let after = &s[at..];
    let len = if after.starts_with("<%%") || after.starts_with("<%=") || after.starts_with("<%#") {
        3
    } else if after.starts_with("<%-") {
        let line_start = s[..at].rfind('\n').map_or(0, |i| i + 1);
        let indent = &s[line_start..at];
        if indent.chars().all(|c| c == ' ' || c == '\t') {
            return Some((&s[..line_start], &s[line_start..at + 3], &s[at + 3..]));
        }
        3
    } else {
        2
    };
    let tag = &s[at..at + len];
    // `<%-` not at a line's start is a plain `<%`.
    Some((&s[..at], tag, &s[at + len..]))
}

/// Split at the first `-%>` or `%>`: (code, whether it was `-%>`, text after).
fn split_end_tag(s: &str) -> Option<(&str, bool, &str)> {
    let at = s.find("%>")?;
    if s[..at].ends_with('-') {
        return Some((&s[..at - 1], true, &s[at + 2..]));
    }
    if s[..at].ends_with('%') {
        return None; // `%%>` inside a tag: Ruby code with a literal `%>`; not in the subset.
    }
    Some((&s[..at], false, &s[at + 2..]))
}

/// A Ruby value of the subset.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    Str(String),
}

impl Value {
    fn truthy(&self) -> bool {
        !matches!(self, Value::Nil | Value::Bool(false))
    }

    /// What `<%= %>` writes: Ruby's `to_s`.
    fn to_s(&self) -> String {
        match self {
            Value::Nil => String::new(),
            Value::Bool(b) => b.to_string(),
            Value::Int(i) => i.to_string(),
            Value::Str(s) => s.clone(),
        }
    }

    fn to_i(&self) -> Result<Value, String> {
        match self {
            Value::Nil => Ok(Value::Int(0)),
            Value::Int(i) => Ok(Value::Int(*i)),
            Value::Str(s) => ruby_string_to_i(s).map(Value::Int),
            Value::Bool(b) => Err(format!("undefined method `to_i' for {b}")),
        }
    }
}

/// Ruby's `String#to_i`: leading whitespace, a sign, digits with single underscores between
/// them; it stops at the first other character, and is 0 when there are no digits.
fn ruby_string_to_i(s: &str) -> Result<i64, String> {
    let t = s.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let mut digits = String::new();
    let mut last_underscore = false;
    for c in t.chars() {
        match c {
            '0'..='9' => {
                digits.push(c);
                last_underscore = false;
            }
            '_' if !digits.is_empty() && !last_underscore => last_underscore = true,
            _ => break,
        }
    }
    if digits.is_empty() {
        return Ok(0);
    }
    let n: i64 = digits
        .parse()
        .map_err(|_| format!("{s:?}.to_i is out of range"))?;
    Ok(if neg { -n } else { n })
}

/// A recursive-descent parser that evaluates as it parses (`||` and blocks lazily, as Ruby).
struct Parser<'a> {
    src: &'a str,
    pos: usize,
    env: &'a HashMap<String, String>,
}

const SUBSET: &str = "playguard evaluates ENV[\"X\"], ENV.fetch(\"X\"[, default]), \
    ENV.fetch(\"X\") { default }, a || b, .to_i and literals";

impl<'a> Parser<'a> {
    fn new(src: &'a str, env: &'a HashMap<String, String>) -> Self {
        Parser { src, pos: 0, env }
    }

    fn whole(mut self) -> Result<Value, String> {
        let v = self.expr(true)?;
        self.skip_ws();
        if self.pos != self.src.len() {
            return Err(format!("unexpected `{}` ({SUBSET})", &self.src[self.pos..]));
        }
        Ok(v)
    }

    fn skip_ws(&mut self) {
        let rest = &self.src[self.pos..];
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_ws();
        let rest = &self.src[self.pos..];
        let word_goes_on = token.ends_with(|c: char| c.is_alphanumeric())
            && rest[token.len().min(rest.len())..]
                .starts_with(|c: char| c.is_alphanumeric() || c == '_');
        if rest.starts_with(token) && !word_goes_on {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, token: &str) -> Result<(), String> {
        if self.eat(token) {
            Ok(())
        } else {
            Err(format!("expected `{token}` ({SUBSET})"))
        }
    }

    /// `postfix ('||' postfix)*`. With `live` false the value is parsed but not wanted (the
    /// right side of a `||` whose left is truthy): it must not fail on a missing variable.
    fn expr(&mut self, live: bool) -> Result<Value, String> {
        let mut v = self.postfix(live)?;
        while self.eat("||") {
            let wanted = live && !v.truthy();
            let right = self.postfix(wanted)?;
            if wanted {
                v = right;
            }
        }
        Ok(v)
    }

    fn postfix(&mut self, live: bool) -> Result<Value, String> {
        let mut v = self.primary(live)?;
        while self.eat(".to_i") {
            if live {
                v = v.to_i()?;
            }
        }
        Ok(v)
    }

    fn primary(&mut self, live: bool) -> Result<Value, String> {
        self.skip_ws();
        if self.eat("(") {
            let v = self.expr(live)?;
            self.expect(")")?;
            return Ok(v);
        }
        if self.eat("ENV") {
            return self.env_access(live);
        }
        self.literal()
    }

    fn env_access(&mut self, live: bool) -> Result<Value, String> {
        if self.eat("[") {
            let name = self.string()?;
            self.expect("]")?;
            return Ok(self.env.get(&name).cloned().map_or(Value::Nil, Value::Str));
        }
        self.expect(".fetch")?;
        self.expect("(")?;
        let name = self.string()?;
        // Ruby evaluates a default argument before the call, even when the variable is set.
        let default = if self.eat(",") {
            Some(self.expr(live)?)
        } else {
            None
        };
        self.expect(")")?;
        let found = self.env.get(&name).cloned().map(Value::Str);
        if self.eat("{") {
            // A block supersedes a default argument and runs only when the variable is unset.
            let v = self.expr(live && found.is_none())?;
            self.expect("}")?;
            return Ok(found.unwrap_or(v));
        }
        match (found, default) {
            (Some(v), _) => Ok(v),
            (None, Some(d)) => Ok(d),
            (None, None) if live => Err(format!(
                "key not found: {name:?} (ENV.fetch without a default)"
            )),
            (None, None) => Ok(Value::Nil),
        }
    }

    fn literal(&mut self) -> Result<Value, String> {
        let rest = &self.src[self.pos..];
        for (word, v) in [
            ("true", Value::Bool(true)),
            ("false", Value::Bool(false)),
            ("nil", Value::Nil),
        ] {
            let after = rest.strip_prefix(word);
            if after.is_some_and(|a| !a.starts_with(|c: char| c.is_alphanumeric() || c == '_')) {
                self.pos += word.len();
                return Ok(v);
            }
        }
        if rest.starts_with(['"', '\'']) {
            return self.string().map(Value::Str);
        }
        self.integer()
    }

    /// A decimal integer literal: `10`, `-3`, `1_000` (no octal `010` or hex).
    fn integer(&mut self) -> Result<Value, String> {
        let rest = &self.src[self.pos..];
        let sign = usize::from(rest.starts_with(['-', '+']));
        let len = rest[sign..]
            .find(|c: char| !(c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len() - sign);
        let text = &rest[..sign + len];
        let digits = &text[sign..];
        let malformed = digits.is_empty()
            || digits.starts_with('_')
            || digits.ends_with('_')
            || digits.contains("__")
            || (digits.len() > 1 && digits.starts_with('0'));
        if malformed {
            let word: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
            return Err(format!("`{word}` is not in the subset ({SUBSET})"));
        }
        let n: i64 = text
            .replace('_', "")
            .parse()
            .map_err(|_| format!("{text} is out of range"))?;
        self.pos += text.len();
        Ok(Value::Int(n))
    }

    /// A string literal: "…" with the escapes \" \\ \n \t (no interpolation), or '…' with \' \\.
    fn string(&mut self) -> Result<String, String> {
        self.skip_ws();
        let rest = &self.src[self.pos..];
        let quote = rest
            .chars()
            .next()
            .filter(|c| *c == '"' || *c == '\'')
            .ok_or_else(|| format!("expected a string literal ({SUBSET})"))?;
        let mut out = String::new();
        let mut chars = rest.char_indices().skip(1);
        while let Some((i, c)) = chars.next() {
            match c {
                c if c == quote => {
                    self.pos += i + 1;
                    return Ok(out);
                }
                '#' if quote == '"' && rest[i..].starts_with("#{") => {
                    return Err("string interpolation is not in the subset".into());
                }
                '\\' => {
                    let (_, e) = chars.next().ok_or("unterminated string")?;
                    match (quote, e) {
                        (_, '\\') => out.push('\\'),
                        (q, e) if e == q => out.push(e),
                        ('"', 'n') => out.push('\n'),
                        ('"', 't') => out.push('\t'),
                        ('\'', e) => {
                            out.push('\\');
                            out.push(e);
                        }
                        (_, e) => return Err(format!("the escape \\{e} is not in the subset")),
                    }
                }
                c => out.push(c),
            }
        }
        Err("unterminated string".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> HashMap<String, String> {
        [("SET", "12"), ("EMPTY", ""), ("WORD", " 7x")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn r(t: &str) -> Result<String, ErbError> {
        render_with(t, &env())
    }

    #[test]
    fn expressions() {
        assert_eq!(r("<%= ENV['SET'] %>").unwrap(), "12");
        assert_eq!(r("<%= ENV[\"NO\"] %>").unwrap(), "");
        assert_eq!(r("<%= ENV.fetch('NO', 3) %>").unwrap(), "3");
        assert_eq!(r("<%= ENV.fetch('NO') { 'a' } %>").unwrap(), "a");
        assert_eq!(r("<%= ENV['NO'] || 5 %>").unwrap(), "5");
        assert_eq!(r("<%= ENV['EMPTY'] || 5 %>").unwrap(), "");
        assert_eq!(r("<%= ENV['WORD'].to_i %>").unwrap(), "7");
        assert_eq!(r("<%= ENV['SET'] || ENV.fetch('NO') %>").unwrap(), "12");
        assert_eq!(r("<%= (ENV['NO'] || '1_0').to_i %>").unwrap(), "10");
        assert_eq!(r("<%= false || nil %>").unwrap(), "");
    }

    #[test]
    fn refusals_name_line_and_expression() {
        let e = r("a: 1\nb: <%= ENV.fetch('NO') %>\n").unwrap_err();
        assert_eq!((e.line, e.expr.as_str()), (2, "ENV.fetch('NO')"));
        let e = r("\n\n<%- if Rails.env.production? -%>\n").unwrap_err();
        assert_eq!(e.line, 3);
        assert!(r("<%= `id` %>").is_err());
        assert!(r("<%= \"#{1}\" %>").is_err());
        assert!(r("<%= 010 %>").is_err());
        assert!(r("<%= ENV['SET'] %").is_err());
    }

    #[test]
    fn trimming() {
        assert_eq!(r("a\n  <%- # x -%>\nb").unwrap(), "a\nb");
        assert_eq!(r("a: <%= 1 -%>\nb").unwrap(), "a: 1b");
        assert_eq!(r("<%# c %>\nb <%% x").unwrap(), "\nb <% x");
    }
}
