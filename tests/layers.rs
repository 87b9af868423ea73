//! The shape of src/, checked from the source text (no server, no process): every folder of
//! src/ is a layer, and a folder imports only the folders below it in `LAYERS` (the order of
//! src/lib.rs's layout map and ARCHITECTURE.md), so no two folders import each other; no two
//! files import each other either (through `crate::` or `super::` paths; a file's own folders'
//! mod.rs aside); and no function outside the unit tests is longer than `MAX_FN_LINES`.
//! `cargo test --test layers -- --nocapture` prints the folder graph and the longest functions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top to bottom: a folder may import any folder after it, never one before it.
const LAYERS: [&str; 17] = [
    "cli",
    "launcher",
    "ops",
    "loops",
    "manager",
    "worker",
    "manifest",
    "cycle",
    "report",
    "commands",
    "fetch",
    "job",
    "metrics",
    "process",
    "traces",
    "connections",
    "logging",
];

/// A function of src/ (unit tests aside) fits on one screen.
const MAX_FN_LINES: usize = 80;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every .rs file under `dir`, with its path.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's text without its unit tests (by this tree's habit, a `#[cfg(test)] mod tests`
/// at the end of the file).
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// The folder (layer) a file belongs to; None for the crate root files.
fn folder_of(path: &Path) -> Option<String> {
    let rel = path.strip_prefix(src()).unwrap();
    let mut parts = rel.components();
    let first = parts.next()?.as_os_str().to_str()?.to_string();
    parts.next().map(|_| first)
}

/// The top-level modules a file names through `crate::` (`crate::a::b`, `crate::{a, b::c}`).
fn imports(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                out.insert(first_ident(item.trim()));
            }
        } else {
            out.insert(first_ident(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn first_ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// (folder, imported folder) -> the files that make the edge.
fn folder_graph() -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut edges: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(from) = folder_of(f) else { continue };
        for to in imports(&code_of(f)) {
            if to != from && LAYERS.contains(&to.as_str()) {
                let shown = f.strip_prefix(src()).unwrap().display().to_string();
                edges.entry((from.clone(), to)).or_default().insert(shown);
            }
        }
    }
    edges
}

#[test]
fn every_folder_of_src_is_a_layer() {
    let mut folders = BTreeSet::new();
    for e in std::fs::read_dir(src()).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            folders.insert(p.file_name().unwrap().to_str().unwrap().to_string());
        }
    }
    let known: BTreeSet<String> = LAYERS.iter().map(|s| s.to_string()).collect();
    assert_eq!(folders, known, "src/'s folders and LAYERS differ");
}

#[test]
fn a_folder_imports_only_folders_below_it() {
    let rank = |f: &str| LAYERS.iter().position(|l| *l == f).unwrap();
    let mut upward = Vec::new();
    let mut by_folder: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let edges = folder_graph();
    for ((from, to), files) in &edges {
        by_folder.entry(from).or_default().push(to);
        if rank(from) >= rank(to) {
            upward.push(format!("{from} -> {to} (in {files:?})"));
        }
    }
    for layer in LAYERS {
        let below = by_folder.get(layer).cloned().unwrap_or_default();
        println!("{layer:>12} -> {}", below.join(", "));
    }
    assert!(upward.is_empty(), "imports up the layers: {upward:#?}");
}

/// Function lengths: from the `fn` line to the closing brace at its indentation.
fn function_lengths() -> Vec<(usize, String)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut out = Vec::new();
    for f in &files {
        let code = code_of(f);
        let lines: Vec<&str> = code.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(name) = fn_name(line) else { continue };
            let indent = line.len() - line.trim_start().len();
            let close = format!("{}}}", " ".repeat(indent));
            // A declaration without a body (in a trait) ends with `;` before any `{`.
            let sig = lines[i..]
                .iter()
                .position(|l| l.ends_with('{') || l.ends_with(';'));
            if sig.is_none_or(|n| lines[i + n].ends_with(';')) {
                continue;
            }
            let one_line = lines[i].ends_with('}');
            let end = if one_line {
                Some(0)
            } else {
                lines[i..].iter().position(|l| *l == close)
            };
            if let Some(n) = end {
                let at = f.strip_prefix(src()).unwrap().display();
                out.push((n + 1, format!("{at}:{} {name}", i + 1)));
            }
        }
    }
    out.sort_by(|a, b| b.cmp(a));
    out
}

/// The name of the function a line starts, if it starts one.
fn fn_name(line: &str) -> Option<String> {
    const PREFIXES: [&str; 6] = [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ];
    let mut t = line.trim_start();
    while let Some(rest) = PREFIXES.iter().find_map(|p| t.strip_prefix(p)) {
        t = rest;
    }
    Some(first_ident(t.strip_prefix("fn ")?))
}

#[test]
fn no_function_is_longer_than_a_screen() {
    let lengths = function_lengths();
    for (n, at) in lengths.iter().take(10) {
        println!("{n:>4} {at}");
    }
    let long: Vec<_> = lengths.iter().filter(|(n, _)| *n > MAX_FN_LINES).collect();
    assert!(long.is_empty(), "over {MAX_FN_LINES} lines: {long:#?}");
}

/// A file's module path under src/ (`loops/heartbeat.rs` -> [loops, heartbeat], a `mod.rs`
/// -> its folder); None for the crate root files.
fn module_of(path: &Path) -> Option<Vec<String>> {
    let rel = path.strip_prefix(src()).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_str().unwrap().to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    (parts.len() > 1 || path.parent() != Some(&src())).then_some(parts)
}

/// Every path a file names through `crate::` or `super::` (use trees expanded), as module
/// segments from the crate root.
fn paths_named(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        expand(&code[i + "crate::".len()..], Vec::new(), &mut out);
    }
    for (i, _) in code.match_indices("super::") {
        if code[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        // `super` of a file is its folder's module; of a mod.rs, the folder above.
        let mut base: Vec<String> = me.to_vec();
        base.pop();
        let mut rest = &code[i + "super::".len()..];
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        expand(rest, base, &mut out);
    }
    out
}

/// Expand one path (or use tree) starting at `s` under `prefix` into `out`.
fn expand(s: &str, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut s = s;
    loop {
        if let Some(group) = s.strip_prefix('{') {
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        expand(group[start..i].trim(), prefix.clone(), out);
                        return;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(group[start..i].trim(), prefix.clone(), out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        let id = first_ident(s);
        if id.is_empty() || id == "self" {
            break;
        }
        prefix.push(id.clone());
        s = &s[id.len()..];
        match s.strip_prefix("::") {
            Some(r) => s = r,
            None => break,
        }
    }
    out.push(prefix);
}

/// (file, file) edges between files of src/ through `crate::` and `super::` paths, a file's
/// own ancestors (its folders' mod.rs) left out.
fn file_graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter_map(|f| {
            let shown = f.strip_prefix(src()).unwrap().display().to_string();
            module_of(f).map(|m| (m, shown))
        })
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(me) = module_of(f) else { continue };
        let shown = &modules[&me];
        for path in paths_named(&code_of(f), &me) {
            let target = (1..=path.len())
                .rev()
                .find_map(|k| modules.get_key_value(&path[..k]));
            let Some((target_mod, target_file)) = target else {
                continue;
            };
            if me.starts_with(target_mod) || target_mod.starts_with(&me) {
                continue;
            }
            edges
                .entry(shown.clone())
                .or_default()
                .insert(target_file.clone());
        }
    }
    edges
}

#[test]
fn no_two_files_import_each_other() {
    let edges = file_graph();
    let mut circles = Vec::new();
    for (a, tos) in &edges {
        for b in tos {
            if a < b && edges.get(b).is_some_and(|t| t.contains(a)) {
                circles.push(format!("{a} <-> {b}"));
            }
        }
    }
    assert!(circles.is_empty(), "two-file circles: {circles:#?}");
}
