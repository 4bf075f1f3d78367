//! The shape of `src/`: no import circle between the library's modules.
//!
//! The library's module tree is read from `src/lib.rs` down its `mod` declarations (files and
//! inline modules). A module *uses* another when its code names it: a `use crate::…`,
//! `use super::…`, `use self::…` or `use <child>::…` declaration, or a path written inline
//! (`crate::x::f()`, `super::X`, `child::f()`, or a path through a name a `use` brought in). A
//! path is resolved to the module that defines the item, following `pub use` re-exports, so a
//! name a parent re-exports from one of its children is a use of that child. Not uses: comments,
//! string literals, code under `#[cfg(test)]`, declaring a module, and re-exporting a
//! descendant's item the re-exporting module does not itself name in its code.
//!
//! The rule: draw each use of module B by module A as an edge between the two modules just below
//! their closest common ancestor. Between two siblings (top-level modules are siblings under the
//! crate) it joins those siblings; when A is inside B (a child using its ancestor's own items) it
//! goes from B's child on the way to A up to B; when B is inside A (an ancestor using a
//! descendant's items) it goes from A down to its child on the way to B. That graph must have no
//! cycle. So siblings never use each other both ways, and a parent that uses its children's items
//! (a router naming handlers) keeps the things its children need in a module below it rather
//! than in itself. docs/architecture.md states the same rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path below the crate root (`["api", "auth"]`); the root is empty.
type ModPath = Vec<String>;

/// One `use` declaration's leaf: the path it names, the name it binds (`None` for a glob), and
/// whether it is a re-export (`pub use`).
#[derive(Debug, Clone)]
struct UseItem {
    path: Vec<String>,
    binding: Option<String>,
    reexport: bool,
}

/// One module of the library.
#[derive(Debug, Default)]
struct Module {
    /// The file it is written in.
    file: String,
    /// Its code, with comments, literals, test-only items, `use` declarations and inline child
    /// modules blanked out.
    code: String,
    uses: Vec<UseItem>,
    children: BTreeSet<String>,
}

/// The library's modules, by path.
struct Tree {
    modules: BTreeMap<ModPath, Module>,
}

fn show(path: &[String]) -> String {
    if path.is_empty() {
        "crate".to_string()
    } else {
        path.join("::")
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `src` with comments, string and character literals replaced by spaces (line breaks kept, so
/// positions and line numbers stay as they were).
fn strip_comments_and_literals(src: &str) -> String {
    let s: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = s.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for c in out.iter_mut().take(to.min(s.len())).skip(from) {
            if *c != '\n' {
                *c = ' ';
            }
        }
    };
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        let prev_ident = i > 0 && is_ident_char(s[i - 1]);
        if c == '/' && next == Some('/') {
            let end = (i..s.len()).find(|&j| s[j] == '\n').unwrap_or(s.len());
            blank(&mut out, i, end);
            i = end;
        } else if c == '/' && next == Some('*') {
            let (mut depth, mut j) = (0usize, i);
            while j < s.len() {
                if s[j] == '/' && s.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if s[j] == '*' && s.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if c == 'r'
            && (!prev_ident || (i > 0 && s[i - 1] == 'b' && !(i > 1 && is_ident_char(s[i - 2]))))
            && matches!(next, Some('"' | '#'))
        {
            // A raw string: r"…", r#"…"#, br"…".
            let hashes = s[i + 1..].iter().take_while(|&&c| c == '#').count();
            if s.get(i + 1 + hashes) != Some(&'"') {
                i += 1;
                continue;
            }
            let body = i + 2 + hashes;
            let mut j = body;
            while j < s.len() {
                if s[j] == '"'
                    && s[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&c| c == '#')
                        .count()
                        == hashes
                {
                    break;
                }
                j += 1;
            }
            let end = (j + 1 + hashes).min(s.len());
            blank(&mut out, i + 1, end);
            i = end;
        } else if c == '"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != '"' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or else a lifetime or label.
            if next == Some('\\') {
                let end = (i + 3..s.len()).find(|&j| s[j] == '\'').unwrap_or(s.len());
                blank(&mut out, i, end + 1);
                i = end + 1;
            } else if s.get(i + 2) == Some(&'\'') {
                blank(&mut out, i, i + 3);
                i += 3;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out.into_iter().collect()
}

/// The index just past the item starting at `from`: its `;`, or the `}` closing its body.
fn item_end(code: &[char], from: usize) -> usize {
    let mut depth = 0i32;
    let mut j = from;
    while j < code.len() {
        match code[j] {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ';' if depth == 0 => return j + 1,
            '{' if depth == 0 => return matching_brace(code, j) + 1,
            // The end of the enclosing body.
            '}' if depth == 0 => return j,
            _ => {}
        }
        j += 1;
    }
    code.len()
}

/// The index of the `}` closing the `{` at `open`.
fn matching_brace(code: &[char], open: usize) -> usize {
    let mut depth = 0usize;
    for (j, &c) in code.iter().enumerate().skip(open) {
        if c == '{' {
            depth += 1;
        } else if c == '}' {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    code.len().saturating_sub(1)
}

fn blank_range(code: &mut [char], from: usize, to: usize) {
    for c in code.iter_mut().take(to).skip(from) {
        if *c != '\n' {
            *c = ' ';
        }
    }
}

/// Blank every item under `#[cfg(test)]` (its attributes included).
fn blank_test_items(code: &mut [char]) {
    const ATTR: &str = "#[cfg(test)]";
    let attr: Vec<char> = ATTR.chars().collect();
    let mut i = 0;
    while i + attr.len() <= code.len() {
        if code[i..i + attr.len()] == attr[..] {
            let end = item_end(code, i + attr.len());
            blank_range(code, i, end);
            i = end;
        } else {
            i += 1;
        }
    }
}

/// The identifier starting at `i`, if one starts there.
fn ident_at(code: &[char], i: usize) -> Option<String> {
    if i >= code.len() || !(code[i].is_ascii_alphabetic() || code[i] == '_') {
        return None;
    }
    if i > 0 && (is_ident_char(code[i - 1]) || code[i - 1] == '$' || code[i - 1] == '#') {
        return None;
    }
    let end = (i..code.len())
        .find(|&j| !is_ident_char(code[j]))
        .unwrap_or(code.len());
    Some(code[i..end].iter().collect())
}

fn skip_ws(code: &[char], mut i: usize) -> usize {
    while i < code.len() && code[i].is_whitespace() {
        i += 1;
    }
    i
}

/// The tokens of a use tree: identifiers, `::`, `{`, `}`, `,`, `*`.
fn use_tokens(text: &str) -> Vec<String> {
    let s: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == ':' && s.get(i + 1) == Some(&':') {
            out.push("::".to_string());
            i += 2;
        } else if is_ident_char(c) {
            let end = (i..s.len())
                .find(|&j| !is_ident_char(s[j]))
                .unwrap_or(s.len());
            out.push(s[i..end].iter().collect());
            i = end;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// Expand one use tree (`a::{b, c::{d as e, *}}`) into its leaves.
fn expand_use(
    toks: &[String],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut prefix = prefix;
    while *i < toks.len() {
        let t = toks[*i].as_str();
        match t {
            "{" => {
                *i += 1;
                while *i < toks.len() && toks[*i] != "}" {
                    expand_use(toks, i, prefix.clone(), out);
                    if toks.get(*i).map(String::as_str) == Some(",") {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            "*" => {
                *i += 1;
                out.push((prefix, None));
                return;
            }
            "::" => *i += 1,
            _ => {
                *i += 1;
                if toks.get(*i).map(String::as_str) == Some("::") {
                    prefix.push(t.to_string());
                    continue;
                }
                let (path, mut binding) = if t == "self" && !prefix.is_empty() {
                    (prefix.clone(), prefix.last().cloned().unwrap_or_default())
                } else {
                    let mut p = prefix.clone();
                    p.push(t.to_string());
                    (p, t.to_string())
                };
                if toks.get(*i).map(String::as_str) == Some("as") {
                    binding = toks.get(*i + 1).cloned().unwrap_or_default();
                    *i += 2;
                }
                out.push((path, Some(binding)));
                return;
            }
        }
    }
}

/// Take the `use` declarations out of `code` (blanking them) and return their leaves.
fn take_uses(code: &mut [char]) -> Vec<UseItem> {
    let mut uses = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if ident_at(code, i).as_deref() != Some("use")
            || !code.get(i + 3).is_some_and(|c| c.is_whitespace())
        {
            i += 1;
            continue;
        }
        // `pub use`, `pub(crate) use`: look back past the visibility.
        let before: String = code[..i].iter().collect();
        let head = before.trim_end();
        let head = match head.strip_suffix(')') {
            Some(h) => h.rfind('(').map_or(h, |p| h[..p].trim_end()),
            None => head,
        };
        let reexport = head.ends_with("pub")
            && !head[..head.len() - 3]
                .chars()
                .last()
                .is_some_and(is_ident_char);
        let start = if reexport {
            head.chars().count() - 3
        } else {
            i
        };
        let end = (i..code.len())
            .find(|&j| code[j] == ';')
            .unwrap_or(code.len());
        let tree: String = code[i + 3..end].iter().collect();
        let toks = use_tokens(&tree);
        let mut leaves = Vec::new();
        let mut at = 0;
        expand_use(&toks, &mut at, Vec::new(), &mut leaves);
        uses.extend(leaves.into_iter().map(|(path, binding)| UseItem {
            path,
            binding,
            reexport,
        }));
        blank_range(code, start, end + 1);
        i = end + 1;
    }
    uses
}

/// Where the source files are: a path below `src/` to its text.
type Sources = BTreeMap<PathBuf, String>;

impl Tree {
    /// Read the module tree from `sources`, rooted at `lib.rs`.
    fn load(sources: &Sources) -> Tree {
        let mut tree = Tree {
            modules: BTreeMap::new(),
        };
        let root = PathBuf::from("lib.rs");
        let text = sources.get(&root).cloned().unwrap_or_default();
        let code: Vec<char> = strip_comments_and_literals(&text).chars().collect();
        tree.add(sources, Vec::new(), "lib.rs", code);
        tree
    }

    /// Add the module at `path`, written in `file` with (stripped) `code`, and its children.
    fn add(&mut self, sources: &Sources, path: ModPath, file: &str, mut code: Vec<char>) {
        blank_test_items(&mut code);
        let mut module = Module {
            file: file.to_string(),
            ..Module::default()
        };
        let mut i = 0;
        while i < code.len() {
            if ident_at(&code, i).as_deref() != Some("mod") {
                i += 1;
                continue;
            }
            let name_at = skip_ws(&code, i + 3);
            let Some(name) = ident_at(&code, name_at) else {
                i += 1;
                continue;
            };
            let after = skip_ws(&code, name_at + name.len());
            let mut child_path = path.clone();
            child_path.push(name.clone());
            match code.get(after) {
                Some(';') => {
                    let dir: PathBuf = path.iter().collect();
                    let candidates = [
                        dir.join(format!("{name}.rs")),
                        dir.join(&name).join("mod.rs"),
                    ];
                    if let Some((f, text)) = candidates
                        .iter()
                        .find_map(|c| sources.get(c).map(|t| (c, t)))
                    {
                        let child_code = strip_comments_and_literals(text).chars().collect();
                        self.add(sources, child_path, &f.display().to_string(), child_code);
                    }
                    module.children.insert(name);
                    i = after + 1;
                }
                Some('{') => {
                    let close = matching_brace(&code, after);
                    let inner = code[after + 1..close].to_vec();
                    self.add(sources, child_path, &format!("{file} (mod {name})"), inner);
                    blank_range(&mut code, i, close + 1);
                    module.children.insert(name);
                    i = close + 1;
                }
                _ => i += 1,
            }
        }
        module.uses = take_uses(&mut code);
        module.code = code.into_iter().collect();
        self.modules.insert(path, module);
    }

    /// `path` written in module `at`, made absolute (below the crate root); `None` for a path
    /// outside the crate.
    fn absolute(&self, at: &[String], path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let module = self.modules.get(at)?;
        match first.as_str() {
            "crate" => Some(path[1..].to_vec()),
            "self" => Some([at, &path[1..]].concat()),
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                let base = at.get(..at.len().checked_sub(ups)?)?;
                Some([base, &path[ups..]].concat())
            }
            name if module.children.contains(name) => Some([at, path].concat()),
            name => {
                // A name a `use` of this module brought in.
                let leaf = module.uses.iter().find(|u| {
                    u.binding.as_deref() == Some(name)
                        && u.path.first().map(String::as_str) != Some(name)
                })?;
                let base = self.absolute(at, &leaf.path)?;
                Some([&base[..], &path[1..]].concat())
            }
        }
    }

    /// The module that defines what the absolute `path` names, following re-exports.
    fn resolve(&self, path: &[String], depth: usize) -> ModPath {
        let mut module: ModPath = Vec::new();
        let mut rest = 0;
        for (n, seg) in path.iter().enumerate() {
            let mut next = module.clone();
            next.push(seg.clone());
            if self.modules.contains_key(&next) {
                module = next;
                rest = n + 1;
            } else {
                break;
            }
        }
        let Some(name) = path.get(rest) else {
            return module;
        };
        if depth > 8 {
            return module;
        }
        let reexported = self.modules.get(&module).and_then(|m| {
            m.uses
                .iter()
                .find(|u| u.reexport && u.binding.as_deref() == Some(name.as_str()))
        });
        match reexported.and_then(|u| self.absolute(&module, &u.path)) {
            Some(target) => self.resolve(&[&target[..], &path[rest + 1..]].concat(), depth + 1),
            None => module,
        }
    }

    /// Every use of one module by another: (user, used) with what shows it.
    fn uses(&self) -> Vec<(ModPath, ModPath, String)> {
        let mut out = Vec::new();
        for (at, module) in &self.modules {
            let mut note = |target: ModPath, what: String| {
                if &target != at {
                    out.push((at.clone(), target, format!("{}: {what}", module.file)));
                }
            };
            for u in &module.uses {
                let Some(abs) = self.absolute(at, &u.path) else {
                    continue;
                };
                let target = self.resolve(&abs, 0);
                let descendant = target.len() > at.len() && target.starts_with(at);
                // Re-exporting a descendant's item is not a use, unless the module names it too.
                if u.reexport && descendant {
                    let named = u
                        .binding
                        .as_ref()
                        .is_some_and(|b| names_ident(&module.code, b));
                    if !named {
                        continue;
                    }
                }
                let kind = if u.reexport { "pub use" } else { "use" };
                note(target, format!("{kind} {}", u.path.join("::")));
            }
            for path in inline_paths(&module.code) {
                let Some(abs) = self.absolute(at, &path) else {
                    continue;
                };
                let target = self.resolve(&abs, 0);
                note(target, path.join("::"));
            }
        }
        out
    }

    /// The circles of the use graph drawn by the rule in this file's header.
    fn circles(&self) -> Vec<Circle> {
        let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, String>> = BTreeMap::new();
        for (from, to, why) in self.uses() {
            let (a, b) = project(&from, &to);
            edges.entry(a).or_default().entry(b).or_insert(why);
        }
        let mut reported = Vec::new();
        for scc in strongly_connected(&edges) {
            if scc.len() < 2 {
                continue;
            }
            let cycle = cycle_in(&edges, &scc);
            let mut text = cycle
                .iter()
                .map(|m| show(m))
                .collect::<Vec<_>>()
                .join(" -> ");
            text.push_str(&format!(" -> {}", show(&cycle[0])));
            if scc.len() > cycle.len() {
                let mut all: Vec<String> = scc.iter().map(|m| show(m)).collect();
                all.sort();
                text.push_str(&format!(" (one of the circles among {})", all.join(", ")));
            }
            for (n, m) in cycle.iter().enumerate() {
                let next = &cycle[(n + 1) % cycle.len()];
                if let Some(why) = edges.get(m).and_then(|e| e.get(next)) {
                    text.push_str(&format!("\n    {} -> {}: {why}", show(m), show(next)));
                }
            }
            let mut members: Vec<String> = scc.iter().map(|m| show(m)).collect();
            members.sort();
            reported.push(Circle { members, text });
        }
        reported
    }

    /// The circles, each as its modules in order with what shows each step.
    fn cycles(&self) -> Vec<String> {
        self.circles().into_iter().map(|c| c.text).collect()
    }
}

/// Modules that use each other, directly or through others.
#[derive(Debug)]
struct Circle {
    /// Every module of the circle (of the graph's strongly connected component), sorted.
    members: Vec<String>,
    /// One way round it, with what shows each step.
    text: String,
}

/// Whether `code` names the identifier `name` on its own.
fn names_ident(code: &str, name: &str) -> bool {
    let c: Vec<char> = code.chars().collect();
    (0..c.len()).any(|i| ident_at(&c, i).as_deref() == Some(name))
}

/// Every path of two or more segments written in `code` (`a::b::C`), as its segments.
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let Some(first) = ident_at(&c, i) else {
            i += 1;
            continue;
        };
        // Not the tail of a longer path (`x::first`).
        let mut back = c[..i].iter().rev().filter(|ch| !ch.is_whitespace());
        let tail = back.next() == Some(&':') && back.next() == Some(&':');
        let mut segs = vec![first.clone()];
        let mut j = i + first.len();
        loop {
            let k = skip_ws(&c, j);
            if c.get(k) == Some(&':') && c.get(k + 1) == Some(&':') {
                let n = skip_ws(&c, k + 2);
                if let Some(seg) = ident_at(&c, n) {
                    j = n + seg.len();
                    segs.push(seg);
                    continue;
                }
            }
            break;
        }
        if !tail && segs.len() > 1 {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// A use of `to` by `from`, drawn between the two modules just below their closest common
/// ancestor (an ancestor is itself one end).
fn project(from: &[String], to: &[String]) -> (ModPath, ModPath) {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    let below = |p: &[String]| p[..(common + 1).min(p.len())].to_vec();
    (below(from), below(to))
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<ModPath, BTreeMap<ModPath, String>>) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        edges: &'a BTreeMap<ModPath, BTreeMap<ModPath, String>>,
        index: BTreeMap<ModPath, usize>,
        low: BTreeMap<ModPath, usize>,
        stack: Vec<ModPath>,
        on_stack: BTreeSet<ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    fn visit(s: &mut State<'_>, v: &ModPath) {
        let n = s.index.len();
        s.index.insert(v.clone(), n);
        s.low.insert(v.clone(), n);
        s.stack.push(v.clone());
        s.on_stack.insert(v.clone());
        let next: Vec<ModPath> = s
            .edges
            .get(v)
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default();
        for w in next {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let lw = s.low[&w];
                let lv = s.low[v];
                s.low.insert(v.clone(), lv.min(lw));
            } else if s.on_stack.contains(&w) {
                let iw = s.index[&w];
                let lv = s.low[v];
                s.low.insert(v.clone(), lv.min(iw));
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = &w == v;
                scc.push(w);
                if done {
                    break;
                }
            }
            s.out.push(scc);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<ModPath> = edges
        .iter()
        .flat_map(|(a, e)| std::iter::once(a.clone()).chain(e.keys().cloned()))
        .collect();
    for v in &nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One cycle through the component `scc`: the shortest way from its first module back to it.
fn cycle_in(edges: &BTreeMap<ModPath, BTreeMap<ModPath, String>>, scc: &[ModPath]) -> Vec<ModPath> {
    let members: BTreeSet<&ModPath> = scc.iter().collect();
    let mut start = scc.to_vec();
    start.sort();
    let start = start[0].clone();
    let mut came_from: BTreeMap<ModPath, ModPath> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.clone()]);
    while let Some(v) = queue.pop_front() {
        for w in edges.get(&v).map(|e| e.keys()).into_iter().flatten() {
            if !members.contains(w) {
                continue;
            }
            if w == &start {
                let mut cycle = vec![v.clone()];
                let mut at = v.clone();
                while let Some(p) = came_from.get(&at) {
                    cycle.push(p.clone());
                    at = p.clone();
                }
                cycle.reverse();
                return cycle;
            }
            if !came_from.contains_key(w) && w != &start {
                came_from.insert(w.clone(), v.clone());
                queue.push_back(w.clone());
            }
        }
    }
    scc.to_vec()
}

/// Every `.rs` file below `dir`, keyed by its path below `dir`.
fn read_sources(dir: &Path) -> Sources {
    fn walk(root: &Path, dir: &Path, out: &mut Sources) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .filter_map(Result::ok)
            .map(|e| e.path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p)
                    .unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
                let rel = p.strip_prefix(root).unwrap_or(&p).to_path_buf();
                out.insert(rel, text);
            }
        }
    }
    let mut out = Sources::new();
    walk(dir, dir, &mut out);
    out
}

/// Circles known and not yet broken, each as its modules (sorted). The test fails on any other
/// circle, and on an entry here that is no longer one (remove it then): the list only shrinks.
const KNOWN_CIRCLES: &[&[&str]] = &[];

#[test]
fn src_has_no_import_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let tree = Tree::load(&read_sources(&src));
    // The tree was read: the crate's top-level modules and nested ones are in it.
    for m in [
        vec!["api", "state"],
        vec!["bus", "leases"],
        vec!["ingest", "input"],
        vec!["redact", "rules"],
    ] {
        let path: ModPath = m.iter().map(|s| s.to_string()).collect();
        assert!(
            tree.modules.contains_key(&path),
            "{} was not read",
            show(&path)
        );
    }
    let circles = tree.circles();
    let new: Vec<&str> = circles
        .iter()
        .filter(|c| !KNOWN_CIRCLES.iter().any(|k| *k == c.members.as_slice()))
        .map(|c| c.text.as_str())
        .collect();
    assert!(
        new.is_empty(),
        "import circles in src/ (the rule: tests/it/layout.rs, docs/architecture.md):\n{}",
        new.join("\n")
    );
    let gone: Vec<String> = KNOWN_CIRCLES
        .iter()
        .filter(|k| !circles.iter().any(|c| c.members.as_slice() == **k))
        .map(|k| k.join(", "))
        .collect();
    assert!(
        gone.is_empty(),
        "no longer a circle, remove it from KNOWN_CIRCLES: {}",
        gone.join("; ")
    );
}

/// The checker itself, over small crates written here.
mod checker {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> Tree {
        let sources: Sources = files
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect();
        Tree::load(&sources)
    }

    fn cycles(files: &[(&str, &str)]) -> Vec<String> {
        tree(files).cycles()
    }

    #[test]
    fn a_circle_between_top_level_modules_is_named() {
        let found = cycles(&[
            ("lib.rs", "pub mod a;\npub mod b;\nmod c;"),
            ("a.rs", "use crate::b::Thing;\npub struct Other;"),
            ("b.rs", "pub struct Thing;\nfn f(_: crate::a::Other) {}"),
            ("c.rs", "use crate::a::Other;"),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("a -> b -> a"), "{}", found[0]);
        assert!(
            found[0].contains("a.rs: use crate::b::Thing"),
            "{}",
            found[0]
        );
        assert!(found[0].contains("b.rs: crate::a::Other"), "{}", found[0]);
    }

    #[test]
    fn a_longer_circle_through_a_submodule_is_named() {
        // a::x uses b, b uses c, c uses a: a circle of three top-level modules.
        let found = cycles(&[
            ("lib.rs", "mod a; mod b; mod c;"),
            ("a.rs", "mod x;"),
            ("a/x.rs", "fn f() { crate::b::g() }"),
            ("b.rs", "use super::c;\npub fn g() { c::h() }"),
            ("c.rs", "pub fn h() { let _ = crate::a::x::f; }"),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("a -> b -> c -> a"), "{}", found[0]);
    }

    #[test]
    fn a_parent_and_child_using_each_other_are_a_circle() {
        let found = cycles(&[
            ("lib.rs", "pub mod api;"),
            (
                "api/mod.rs",
                "pub mod auth;\npub struct State;\npub fn router() { auth::require(); }",
            ),
            ("api/auth.rs", "use super::State;\npub fn require() {}"),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("api::auth -> api: api/auth.rs: use super::State"),
            "{}",
            found[0]
        );
        assert!(
            found[0].contains("api -> api::auth: api/mod.rs: auth::require"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn a_parent_naming_a_re_exported_item_uses_its_child() {
        let found = cycles(&[
            ("lib.rs", "pub mod r;"),
            (
                "r.rs",
                "mod s;\npub use s::Streamer;\npub struct Rules;\nfn f(_: Streamer) {}",
            ),
            ("r/s.rs", "use super::Rules;\npub struct Streamer;"),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
    }

    #[test]
    fn declaring_and_re_exporting_a_child_is_not_a_use() {
        let found = cycles(&[
            ("lib.rs", "pub mod r;"),
            ("r.rs", "//! Uses [`s::Streamer`].\nmod rules;\nmod s;\npub use rules::Rules;\npub use s::Streamer;"),
            // `super::Rules` is re-exported from a sibling: a use of that sibling.
            ("r/s.rs", "use super::Rules;\npub struct Streamer;"),
            ("r/rules.rs", "pub struct Rules;"),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_parent_using_a_child_that_only_uses_its_siblings_is_no_circle() {
        let found = cycles(&[
            ("lib.rs", "pub mod api;"),
            ("api/mod.rs", "pub mod state;\npub mod auth;\npub use state::State;\npub fn router(s: State) { auth::require(&s); }"),
            ("api/state.rs", "pub struct State;"),
            ("api/auth.rs", "use super::state::State;\npub fn require(_: &State) {}"),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn comments_literals_and_test_code_are_not_uses() {
        let found = cycles(&[
            ("lib.rs", "mod a; mod b;"),
            ("a.rs", "use crate::b::X;"),
            (
                "b.rs",
                concat!(
                    "// crate::a::Y\n/* use crate::a; */\n",
                    "pub struct X;\n",
                    "const S: &str = \"crate::a::Y\";\n",
                    "const R: &str = r#\"use crate::a::Y;\"#;\n",
                    "const C: char = '\"'; fn lt<'a>(_: &'a str) {}\n",
                    "#[cfg(test)]\nmod tests { use crate::a::Y; }\n",
                    "#[cfg(test)]\nfn helper() { crate::a::f(); }\n",
                ),
            ),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn sibling_submodules_using_each_other_are_a_circle() {
        let found = cycles(&[
            ("lib.rs", "pub mod bus;"),
            ("bus/mod.rs", "pub mod sessions;\npub mod worker;"),
            (
                "bus/sessions.rs",
                "use super::worker::Ctx;\npub fn lapsed() {}",
            ),
            (
                "bus/worker.rs",
                "pub struct Ctx;\nfn f() { super::sessions::lapsed() }",
            ),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("bus::sessions -> bus::worker -> bus::sessions"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn use_trees_are_expanded() {
        let t = tree(&[
            ("lib.rs", "mod a;"),
            (
                "a.rs",
                "pub(crate) use crate::x::{self, y::{Z as W, *}, q};\nuse super::*;",
            ),
        ]);
        let uses: Vec<(String, Option<String>, bool)> = t.modules[&vec!["a".to_string()]]
            .uses
            .iter()
            .map(|u| (u.path.join("::"), u.binding.clone(), u.reexport))
            .collect();
        assert_eq!(
            uses,
            [
                ("crate::x".into(), Some("x".into()), true),
                ("crate::x::y::Z".into(), Some("W".into()), true),
                ("crate::x::y".into(), None, true),
                ("crate::x::q".into(), Some("q".into()), true),
                ("super".into(), None, false),
            ]
        );
    }
}
