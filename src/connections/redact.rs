//! Secrets out of printed text: the one place that turns a connection URL (REDIS_URL,
//! DATABASE_URL, a Sentinel URL) into something safe to log or print. Touches no Redis keys.

/// What stands in for a password.
const HIDDEN: &str = "***";

/// `url` with its password hidden: the password of `scheme://user:password@host` (every
/// `user:password@` of a multi-host URL), and `password=` parameters of a query string or of
/// a libpq `key=value` string. A user name alone (`redis://user@host`) is not a secret and is
/// kept, so an operator can still tell which ACL user was meant.
///
/// The userinfo is read as a lenient parser must read a URL typed by hand: it runs to the
/// *last* `@` after the scheme, not to the first `/`, `?` or `#`, because a password typed raw
/// may hold any of them (and such a URL is exactly the one that fails to parse and gets
/// printed). A query or path that holds an `@` is then hidden too: more hidden, never less.
pub fn url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    // Every "scheme://" (a printed list may repeat it): its part runs to the next one.
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail.find("://").unwrap_or(tail.len());
        let (part, after) = tail.split_at(end);
        out.push_str(&hide_userinfo(part));
        rest = after;
    }
    out.push_str(rest);
    hide_password_params(&out)
}

/// `user:password@rest` becomes `user:***@rest`, the userinfo ending at the last `@`.
fn hide_userinfo(part: &str) -> String {
    let Some(a) = part.rfind('@') else {
        return part.to_string();
    };
    let userinfo = &part[..a];
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:{HIDDEN}{}", &part[a..]),
        None => part.to_string(),
    }
}

/// `password=...` (query string or libpq keyword form) becomes `password=***`. The value runs
/// to the next `&`, space or `;` (not to a `#`, which a raw password may hold); a libpq value in
/// single quotes runs to its closing quote.
fn hide_password_params(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.to_ascii_lowercase().find("password=") {
        let start = i + "password=".len();
        let boundary = i == 0 || matches!(rest.as_bytes()[i - 1], b'?' | b'&' | b' ' | b';');
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if boundary {
            let end = match rest.strip_prefix('\'') {
                Some(quoted) => quoted_end(quoted).map_or(rest.len(), |e| e + 2),
                None => rest.find(['&', ' ', ';']).unwrap_or(rest.len()),
            };
            out.push_str(HIDDEN);
            rest = &rest[end..];
        }
    }
    out.push_str(rest);
    out
}

/// Where the closing quote of a libpq quoted value is (`\'` and `\\` are escapes).
fn quoted_end(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'\'' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::url;

    #[test]
    fn hides_passwords_keeps_the_rest() {
        assert_eq!(url("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(
            url("rediss://app:p@ss:w0rd@h/1#insecure"),
            "rediss://app:***@h/1#insecure"
        );
        assert_eq!(url("redis://app@h"), "redis://app@h");
        assert_eq!(
            url("redis-sentinel://u:secret@h1,h2/0#m"),
            "redis-sentinel://u:***@h1,h2/0#m"
        );
        assert_eq!(
            url("postgres://app:s3cr@t@db:5432/app?sslmode=prefer"),
            "postgres://app:***@db:5432/app?sslmode=prefer"
        );
        assert_eq!(
            url("host=db user=app password=hunter2 dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
        assert_eq!(url("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        assert_eq!(
            url("redis+sentinel://:pw@s1:26379,s2:26379/mymaster"),
            "redis+sentinel://:***@s1:26379,s2:26379/mymaster"
        );
        assert_eq!(
            url("postgres://u:pw@db/app?sslmode=require&password=x2"),
            "postgres://u:***@db/app?sslmode=require&password=***"
        );
        assert_eq!(
            url("host=db user=u password=pw dbname=app"),
            "host=db user=u password=*** dbname=app"
        );
        assert!(!url("redis://u:p%40ss@h").contains("p%40ss"));
    }

    /// A password typed raw with `#`, `/` or `?` in it: the URL does not parse as the user
    /// meant (a URL parser takes the rest as fragment, path or query), and that is exactly when
    /// the redacted URL is printed, in the "bad Redis URL" line. None of it may show.
    #[test]
    fn hides_passwords_holding_url_delimiters() {
        for pw in [
            "pa#ss", "pa/ss", "pa?ss", "a#b/c?d", "#lead", "tail?", "p@s#s",
        ] {
            for shape in [
                "redis://:{pw}@h:6379/0",
                "redis://app:{pw}@h:6379/0",
                "rediss://app:{pw}@h/1#insecure",
                "redis-sentinel://:{pw}@s1:26379,s2/0#mymaster",
                "postgres://u:{pw}@db:5432/app?sslmode=prefer",
                "postgres://db/app?sslmode=require&password={pw}",
                "host=db user=u password={pw} dbname=app",
            ] {
                let given = shape.replace("{pw}", pw);
                let shown = url(&given);
                let secret = pw.trim_start_matches('#').trim_end_matches('?');
                assert!(!shown.contains(secret), "{given:?} shows as {shown:?}");
                assert!(shown.contains("***"), "{given:?} shows as {shown:?}");
            }
        }
        assert_eq!(url("redis://:pa#ss@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(url("redis://app:a/b?c@h/0"), "redis://app:***@h/0");
        assert_eq!(
            url("postgres://db/app?password=a#b&sslmode=require"),
            "postgres://db/app?password=***&sslmode=require"
        );
        assert_eq!(
            url("host=db password='a b#c' dbname=app"),
            "host=db password=*** dbname=app"
        );
    }
}
