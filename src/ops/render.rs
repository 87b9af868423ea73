//! The text formatting both operator commands share: an aligned table or one JSON array, and
//! how durations, times and missing cells read. Touches no Redis keys.

/// Print what a command found: with `--json` one pretty JSON array on stdout and the notes on
/// stderr (so stdout stays one JSON document), otherwise the table and its notes.
pub fn print<T: serde::Serialize>(
    rows: &T,
    table: impl FnOnce() -> String,
    notes: &[&str],
    json: bool,
) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(rows).expect("rows serialize")
        );
        for n in notes {
            eprintln!("playguard: {n}");
        }
    } else {
        print!("{}", table());
        for n in notes {
            println!("note: {n}");
        }
    }
}

/// A command's table: one row per item, or the `empty` line when there is none.
pub fn render_rows<T>(
    items: &[T],
    empty: &str,
    header: &[&str],
    row: impl Fn(&T) -> Vec<String>,
) -> String {
    if items.is_empty() {
        return format!("{empty}\n");
    }
    let rows: Vec<Vec<String>> = items.iter().map(row).collect();
    table(header, &rows)
}

/// Columns padded to their widest cell, two spaces apart; the last column is not padded.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let head: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&head).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                let pad = widths[i] - cell.chars().count() + 2;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A duration for people: `850ms`, `12.3s`, `4m05s`, `2h03m`, `3d04h`; `-` for none.
pub fn duration(ms: Option<i64>) -> String {
    let Some(ms) = ms else {
        return "-".into();
    };
    let ms = ms.max(0);
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m{:02}s", s / 60, s % 60),
        3_600_000..86_400_000 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// Unix milliseconds as RFC 3339 UTC with milliseconds (`2026-03-01T12:00:03.250Z`), for JSON.
pub fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| ms.to_string())
}

/// Unix milliseconds as `2026-03-01 12:00:03` (UTC), for the tables.
pub fn clock(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| ms.to_string())
}

/// A cell that may be absent.
pub fn cell(v: Option<&str>) -> String {
    match v {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => "-".into(),
    }
}

/// At most `n` characters, with an ellipsis when cut (long error texts in a table row).
pub fn clip(s: &str, n: usize) -> String {
    let one_line = s.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= n {
        return one_line;
    }
    let mut out: String = one_line.chars().take(n.saturating_sub(1)).collect();
    out.push('…');
    out
}

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_well() {
        assert_eq!(duration(None), "-");
        assert_eq!(duration(Some(-5)), "0ms");
        assert_eq!(duration(Some(850)), "850ms");
        assert_eq!(duration(Some(12_345)), "12.3s");
        assert_eq!(duration(Some(245_000)), "4m05s");
        assert_eq!(duration(Some(7_380_000)), "2h03m");
        assert_eq!(duration(Some(273_600_000)), "3d04h");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["KEY", "PHASE", "FENCE"],
            &[
                vec!["lock:a".into(), "apply".into(), "7".into()],
                vec!["lock:marquee:12".into(), "-".into(), "1234".into()],
            ],
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "KEY              PHASE  FENCE");
        assert_eq!(lines[1], "lock:a           apply  7");
        assert_eq!(lines[2], "lock:marquee:12  -      1234");
    }

    #[test]
    fn clip_cuts_long_text() {
        assert_eq!(clip("short", 10), "short");
        assert_eq!(clip("a\nb", 10), "a b");
        assert_eq!(clip("abcdefghijkl", 5), "abcd…");
        assert_eq!(rfc3339(1_700_000_000_250), "2023-11-14T22:13:20.250Z");
    }
}
