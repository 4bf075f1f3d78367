//! The documentation carries what it cites: every relative link in README.md and docs/*.md
//! names a file or directory of the repository, and every link to a heading (`contract.md#3-roles`,
//! `#sources`) names a heading the linked page has, by GitHub's anchor rules.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of docs/.
fn pages() -> Vec<PathBuf> {
    let root = repo();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap_or_else(|e| panic!("read docs/: {e}"))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// `text` without fenced code blocks and inline code spans (links there are examples, not
/// links).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if fenced {
            out.push('\n');
            continue;
        }
        // Drop `code spans`.
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of the page's links: inline `[text](target)` and `![alt](target)`, and reference
/// definitions `[name]: target`.
fn link_targets(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].trim();
        // `(path "title")`, `(<path>)`.
        let target = target.split_whitespace().next().unwrap_or_default();
        let target = target.trim_start_matches('<').trim_end_matches('>');
        if !target.is_empty() {
            out.push(target.to_string());
        }
        rest = &after[end..];
    }
    for line in prose.lines() {
        let line = line.trim_start();
        if let Some(def) = line.strip_prefix('[') {
            if let Some((_, target)) = def.split_once("]: ") {
                if let Some(t) = target.split_whitespace().next() {
                    out.push(t.to_string());
                }
            }
        }
    }
    out
}

/// GitHub's anchor for a heading's text: inline markup dropped (code ticks, emphasis, link
/// targets), lower-case, punctuation other than `-` and `_` dropped, each space a `-`.
fn anchor_of(heading: &str) -> String {
    // `[text](target)` reads as `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](").zip(rest[open..].find(')')) {
            Some((mid, close)) if mid < close => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = &rest[open + close + 1..];
            }
            _ => break,
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor a page's headings give, with GitHub's `-1`, `-2` ... for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = anchor_of(line[hashes..].trim().trim_end_matches('#').trim());
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// `path` with `.` and `..` resolved; `None` when it climbs above its root.
fn normalise(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// What is wrong with one link of `page` (a path below the repository), if anything.
fn check_link(root: &Path, page: &Path, target: &str) -> Option<String> {
    let external = ["http://", "https://", "mailto:"];
    if external.iter().any(|p| target.starts_with(p)) {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((f, a)) => (f, Some(a)),
        None => (target, None),
    };
    let linked = if file.is_empty() {
        page.to_path_buf()
    } else if let Some(from_root) = file.strip_prefix('/') {
        PathBuf::from(from_root)
    } else {
        page.parent().unwrap_or(Path::new("")).join(file)
    };
    let Some(linked) = normalise(&linked) else {
        return Some(format!("{target}: points outside the repository"));
    };
    if linked.starts_with("target") || !root.join(&linked).exists() {
        return Some(format!(
            "{target}: no such file in the repository ({})",
            linked.display()
        ));
    }
    let anchor = anchor?;
    if linked.extension().is_none_or(|x| x != "md") {
        return None;
    }
    let text = std::fs::read_to_string(root.join(&linked)).unwrap_or_default();
    if anchors(&text).contains(anchor) {
        None
    } else {
        Some(format!(
            "{target}: {} has no heading with anchor #{anchor}",
            linked.display()
        ))
    }
}

#[test]
fn every_relative_link_in_the_docs_resolves_in_the_repository() {
    let root = repo();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page)
            .unwrap_or_else(|e| panic!("read {}: {e}", page.display()));
        let rel = page.strip_prefix(&root).unwrap_or(&page).to_path_buf();
        for target in link_targets(&text) {
            checked += 1;
            if let Some(problem) = check_link(&root, &rel, &target) {
                broken.push(format!("{}: {problem}", rel.display()));
            }
        }
    }
    assert!(
        checked > 10,
        "only {checked} links found: is the link reader broken?"
    );
    assert!(
        broken.is_empty(),
        "links that do not resolve:\n{}",
        broken.join("\n")
    );
}

#[test]
fn contract_links_name_headings_of_the_contract() {
    let contract = std::fs::read_to_string(repo().join("docs/contract.md")).unwrap_or_default();
    let anchors = anchors(&contract);
    // The contract's numbered sections keep the anchors pages link to.
    for a in [
        "sources",
        "the-k1-a-adapter-rules",
        "2a-a2a-wire-traffic-as-turns",
        "3-roles",
        "4-the-turn-contract",
    ] {
        assert!(
            anchors.contains(a),
            "docs/contract.md has no #{a}: {anchors:?}"
        );
    }
    let mut links = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap_or_default();
        for target in link_targets(&text) {
            let Some((file, anchor)) = target.split_once('#') else {
                continue;
            };
            if file.ends_with("contract.md") {
                links += 1;
                assert!(
                    anchors.contains(anchor),
                    "{}: {target} names no heading of docs/contract.md",
                    page.display()
                );
            }
        }
    }
    assert!(links > 0, "no page links to a section of docs/contract.md");
}

/// The checker itself, on pages written here.
mod checker {
    use super::*;

    #[test]
    fn anchors_follow_github_rules() {
        assert_eq!(
            anchor_of("2a. A2A wire traffic as turns"),
            "2a-a2a-wire-traffic-as-turns"
        );
        assert_eq!(
            anchor_of("The K1-A adapter rules"),
            "the-k1-a-adapter-rules"
        );
        assert_eq!(
            anchor_of("`run` and `status`: what's shown"),
            "run-and-status-whats-shown"
        );
        assert_eq!(anchor_of("See [the API](api.md) now"), "see-the-api-now");
        let page = "# Title\n## Notes\n```\n## not a heading\n```\n## Notes\n";
        let found = anchors(page);
        assert_eq!(
            found,
            ["title", "notes", "notes-1"]
                .map(String::from)
                .into_iter()
                .collect()
        );
    }

    #[test]
    fn links_in_code_are_examples_and_titles_are_dropped() {
        let page = "See [a](a.md \"A\") and `[b](b.md)`.\n```\n[c](c.md)\n```\n[d]: d.md\n![e](<img/e.png>)\n";
        assert_eq!(link_targets(page), ["a.md", "img/e.png", "d.md"]);
    }

    #[test]
    fn a_link_outside_the_repository_or_to_a_missing_heading_is_named() {
        let root = repo();
        let page = Path::new("docs/architecture.md");
        assert!(check_link(&root, page, "contract.md#3-roles").is_none());
        assert!(check_link(&root, page, "../README.md").is_none());
        assert!(check_link(&root, page, "https://example.com/x.md").is_none());
        assert!(check_link(&root, page, "CONTRACT.md").is_some());
        assert!(check_link(&root, page, "../../elsewhere.md").is_some());
        assert!(check_link(&root, page, "contract.md#9-no-such-section").is_some());
        assert!(check_link(&root, page, "#no-such-heading").is_some());
    }
}
