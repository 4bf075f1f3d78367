//! Golden files for the tests of the adapter and the normalisers: what the code produces for a
//! fixture, diffed against the file beside it, and rewritten on purpose with `UPDATE_GOLDEN=1`.

use std::path::Path;

/// Compare `actual` with the golden file at `path`: `None` when they match (or when
/// `UPDATE_GOLDEN=1` rewrote it), else a description of the first difference with both texts.
pub fn check(path: &Path, actual: &str) -> Option<String> {
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        return std::fs::write(path, actual)
            .err()
            .map(|e| format!("{}: {e}", path.display()));
    }
    let expected = std::fs::read_to_string(path).unwrap_or_default();
    if expected == actual {
        return None;
    }
    let line = expected
        .lines()
        .zip(actual.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
    Some(format!(
        "{}: first difference at line {}\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display(),
        line + 1
    ))
}
