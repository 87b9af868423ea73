//! Secrets out of printed text: the one place that turns a connection URL (REDIS_URL,
//! DATABASE_URL, a Sentinel URL) into something safe to log or print. Touches no Redis keys.

/// What stands in for a password.
const HIDDEN: &str = "***";

/// `url` with its password hidden: the password of `scheme://user:password@host` (every
/// `user:password@` of a multi-host URL), and `password=` parameters of a query string or of
/// a libpq `key=value` string. A user name alone (`redis://user@host`) is not a secret and is
/// kept, so an operator can still tell which ACL user was meant.
pub fn url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    // Userinfo: every "scheme://" (a Sentinel list may repeat it) up to the host.
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail.find(['/', '?', '#']).unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(a) => {
                let userinfo = &authority[..a];
                match userinfo.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push(':');
                        out.push_str(HIDDEN);
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[a..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    hide_password_params(&out)
}

/// `password=...` (query string or libpq keyword form) becomes `password=***`.
fn hide_password_params(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.to_ascii_lowercase().find("password=") {
        let start = i + "password=".len();
        let boundary = i == 0 || matches!(rest.as_bytes()[i - 1], b'?' | b'&' | b' ' | b';');
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if boundary {
            let end = rest.find(['&', ' ', ';', '#']).unwrap_or(rest.len());
            out.push_str(HIDDEN);
            rest = &rest[end..];
        }
    }
    out.push_str(rest);
    out
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
}
