//! The delegation tree (pure): from a conversation, or one of its turns or runs, down to
//! everything it caused across keys: the `delegation.subagent` conversations it spawned, the
//! tasks it started, the runs and tool calls, each with start, duration, outcome and the tokens
//! and cost rolled up from below. `GET /api/tree/{key}` serves it.
//!
//! Two steps, both over projected envelopes:
//!
//! 1. **Which keys.** [`LinkIndex`] reads the link facts of events ([`Facts::of`]) and answers
//!    which keys are children of a key ([`LinkIndex::children`]). A key C is a child of K when C
//!    names something K defines as its parent (`parentConversationId`, `parentSessionId`,
//!    `parentThreadId`, `parentRunId`, A2A `referenceTaskIds`), or K names something C defines
//!    as what it started (an `a2a.spawn` / `a2a.spawn_result`'s `targetSessionKey`,
//!    `childSessionKey`, `childConversationId`, `childSessionId`, `childThreadId`; the `taskId`
//!    of a turn or run whose task events live under C).
//! 2. **The tree.** [`build`] assembles each key as [`crate::threads`] does and hangs each child
//!    key under the item that caused it: the run its `parentRunId` names, the turn or run whose
//!    event named it, else the parent conversation. Tasks (`task.*` and
//!    `orchestration.task` events, by `taskId`) hang under the turn or run that carries the same
//!    `taskId`, else under their conversation; tool calls under their run; runs under the run
//!    that started them (`parentRunId`) within a key.
//!
//! Links the producers did not give are never guessed: an unlinked conversation is not in the
//! tree. Every key is placed once (cycles are cut), the caller bounds the keys read, and a tree
//! holds at most [`MAX_NODES`] nodes, [`MAX_CHILDREN`] under one node, [`MAX_DEPTH`] levels.

use crate::model::{id_text, key_token, Envelope, Role};
use crate::threads::{self, RunOutcome, RunView, Stored, ToolStatus, TurnOutcome, TurnView};
use crate::usage::{self, Prices, Usage, UsageRollup};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, HashSet};

/// Children listed under one node at most (the earliest kept).
pub const MAX_CHILDREN: usize = 500;
/// Nodes in one tree at most (depth first, earliest first).
pub const MAX_NODES: usize = 5_000;
/// Levels below the root at most.
pub const MAX_DEPTH: usize = 32;
/// Characters of a label.
const LABEL_CHARS: usize = 120;

/// What a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    /// A conversation, AG-UI thread or session: one key.
    Conversation,
    Turn,
    Run,
    Task,
    Tool,
}

/// Where a node is: a run's, a turn's, a task's or a tool call's own outcome; a conversation's
/// is the most pressing of its items' (`waiting`, then `running` / `awaiting_reply`, then
/// `failed` / `blocked` / `timed_out`, else `finished`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "TreeNodeOutcome")]
pub enum NodeOutcome {
    Running,
    Finished,
    Waiting,
    Failed,
    TimedOut,
    AwaitingReply,
    Answered,
    Blocked,
    Completed,
    Unfinished,
    /// Nothing tells (a conversation with no turn, run or task).
    Unknown,
}

/// One node of the tree.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct TreeNode {
    pub kind: NodeKind,
    /// Its id: the key of a conversation, else the run, turn, task or tool call id.
    pub id: String,
    /// The key it was read from: `GET /api/threads/{key}` shows it.
    pub key: String,
    /// The viewer's link to it within its thread (`run:<id>`, `turn:<id>`), for runs and turns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item: Option<String>,
    /// What to show: who asked whom and what, an agent and its run, a task's title, a tool's name.
    pub label: String,
    /// The agent that runs it, answers it or owns it, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Event times (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
    pub outcome: NodeOutcome,
    /// The tokens it reported itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageRollup>,
    /// Its own tokens and those of everything below it, with their cost.
    pub total: UsageRollup,
    /// What it caused, earliest first.
    pub children: Vec<TreeNode>,
}

/// A run or turn of a key to root the tree at (`run:<id>`, `turn:<id>`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ItemRef {
    Run(String),
    Turn(String),
}

impl ItemRef {
    /// `run:<id>` or `turn:<id>`.
    pub fn parse(s: &str) -> Option<ItemRef> {
        let (kind, id) = s.split_once(':')?;
        if id.is_empty() {
            return None;
        }
        match kind {
            "run" => Some(ItemRef::Run(id.to_string())),
            "turn" => Some(ItemRef::Turn(id.to_string())),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Link facts

/// The link facts of one event: the ids its key defines, the parents it names, the children it
/// names (with the item of its own key that named them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// Namespaced ids the event's key defines (`ctx:`, `run:`, `task:`).
    pub defines: Vec<String>,
    /// Namespaced parent ids it names, most precise first (`run:` before `ctx:`).
    pub parents: Vec<String>,
    /// Namespaced child ids it names.
    pub children: Vec<String>,
    /// The run or turn of its key that the event belongs to.
    pub item: Option<ItemRef>,
    /// The task it belongs to, when it is a task event.
    pub task: Option<String>,
    /// The run a send names (`runId`, the run that handles the turn): (turn id, run id).
    pub turn_run: Option<(String, String)>,
}

fn payload(env: &Envelope) -> Option<&Map<String, Value>> {
    env.payload.as_ref().and_then(Value::as_object)
}

fn ptext(p: Option<&Map<String, Value>>, k: &str) -> Option<String> {
    crate::model::field_text(p, k)
}

fn slot(v: &Option<Value>) -> Option<String> {
    v.as_ref().and_then(id_text)
}

/// A task's own event: `orchestration.task`, `task.*`, or an `agent.*` / `worker.*` lifecycle
/// event of a subagent that carries its `taskId`.
fn is_task_event(env: &Envelope, task: Option<&String>) -> bool {
    let t = env.event_type.as_str();
    env.event_role == Some(Role::OrchestrationTask)
        || t.starts_with("task.")
        || (task.is_some() && (t.starts_with("agent.") || t.starts_with("worker.")))
}

fn turn_of(env: &Envelope) -> String {
    let p = payload(env);
    crate::model::turn_id([
        env.turn_id.as_ref(),
        p.and_then(|p| p.get("turnId")),
        p.and_then(|p| p.get("turn")),
    ])
}

impl Facts {
    pub fn of(key: &str, env: &Envelope) -> Facts {
        let p = payload(env);
        let mut f = Facts::default();
        f.defines.push(format!("ctx:{key}"));
        for id in [
            slot(&env.conversation_id),
            slot(&env.session_id),
            slot(&env.thread_id),
        ]
        .into_iter()
        .flatten()
        {
            f.defines.push(format!("ctx:{}", key_token(&id)));
        }
        let run = slot(&env.run_id).or_else(|| ptext(p, "runId"));
        let task = slot(&env.task_id).or_else(|| ptext(p, "taskId"));
        let task_event = is_task_event(env, task.as_ref());
        if task_event {
            f.task.clone_from(&task);
            if let Some(t) = &task {
                f.defines.push(format!("task:{t}"));
            }
        } else if env.event_type.starts_with("a2a.") {
            f.item = Some(ItemRef::Turn(turn_of(env)));
        } else if let Some(r) = &run {
            f.item = Some(ItemRef::Run(r.clone()));
        }
        if let Some(r) = &run {
            if !env.event_type.starts_with("a2a.") {
                f.defines.push(format!("run:{r}"));
            } else if env.event_type == "a2a.send" {
                // A run started for the turn: what names it as its parent hangs under the turn.
                f.defines.push(format!("run:{r}"));
                f.turn_run = Some((turn_of(env), r.clone()));
            }
        }
        if !task_event {
            if let Some(t) = &task {
                f.children.push(format!("task:{t}"));
            }
        }
        if let Some(r) = ptext(p, "parentRunId") {
            f.parents.push(format!("run:{r}"));
        }
        for id in [
            ptext(p, "parentConversationId"),
            slot(&env.parent_session_id),
            slot(&env.parent_thread_id),
        ]
        .into_iter()
        .flatten()
        {
            f.parents.push(format!("ctx:{}", key_token(&id)));
        }
        for t in reference_task_ids(p) {
            f.parents.push(format!("task:{t}"));
        }
        if matches!(env.event_type.as_str(), "a2a.spawn" | "a2a.spawn_result") {
            for k in [
                "targetSessionKey",
                "childSessionKey",
                "childConversationId",
                "childSessionId",
                "childThreadId",
            ] {
                if let Some(id) = ptext(p, k) {
                    f.children.push(format!("ctx:{}", key_token(&id)));
                }
            }
        }
        // A key names itself: no self-links.
        let own: HashSet<String> = f.defines.iter().cloned().collect();
        f.parents.retain(|x| !own.contains(x));
        f.children.retain(|x| !own.contains(x));
        f
    }
}

/// An A2A message's `referenceTaskIds` (on the request as the wire normaliser keeps it, or on the
/// payload itself).
fn reference_task_ids(p: Option<&Map<String, Value>>) -> Vec<String> {
    let Some(p) = p else { return Vec::new() };
    let msg = p
        .get("a2a")
        .and_then(|a| a.get("params"))
        .and_then(|x| x.get("message"))
        .or_else(|| p.get("message").filter(|m| m.is_object()));
    let list = msg
        .and_then(|m| m.get("referenceTaskIds"))
        .or_else(|| p.get("referenceTaskIds"))
        .and_then(Value::as_array);
    list.into_iter()
        .flatten()
        .filter_map(id_text)
        .take(64)
        .collect()
}

/// Link facts of many keys, kept small: which ids each key defines and names.
#[derive(Debug, Default)]
pub struct LinkIndex {
    keys: HashMap<String, KeyLinks>,
    /// id -> keys defining it.
    defined_by: HashMap<String, BTreeSet<String>>,
    /// parent id -> keys naming it as their parent.
    named_as_parent: HashMap<String, BTreeSet<String>>,
}

#[derive(Debug, Default)]
struct KeyLinks {
    defines: BTreeSet<String>,
    children: BTreeSet<String>,
}

/// Ids remembered per key at most (defined and named), so one noisy key cannot fill memory.
const MAX_IDS_PER_KEY: usize = 4096;

impl LinkIndex {
    pub fn add(&mut self, key: &str, env: &Envelope) {
        let f = Facts::of(key, env);
        let k = self.keys.entry(key.to_string()).or_default();
        for c in f.children {
            if k.children.len() < MAX_IDS_PER_KEY {
                k.children.insert(c);
            }
        }
        for d in f.defines {
            if k.defines.len() < MAX_IDS_PER_KEY {
                k.defines.insert(d.clone());
            }
            let set = self.defined_by.entry(d).or_default();
            if set.len() < MAX_IDS_PER_KEY {
                set.insert(key.to_string());
            }
        }
        for p in f.parents {
            let set = self.named_as_parent.entry(p).or_default();
            if set.len() < MAX_IDS_PER_KEY {
                set.insert(key.to_string());
            }
        }
    }

    /// The keys linked below `key`, in a stable order.
    pub fn children(&self, key: &str) -> Vec<String> {
        let mut out = BTreeSet::new();
        let Some(k) = self.keys.get(key) else {
            return Vec::new();
        };
        for id in &k.defines {
            if let Some(keys) = self.named_as_parent.get(id) {
                out.extend(keys.iter().cloned());
            }
        }
        for c in &k.children {
            if let Some(keys) = self.defined_by.get(c) {
                out.extend(keys.iter().cloned());
            }
        }
        out.remove(key);
        out.into_iter().collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Assembly

/// One key's events, stream order.
pub struct KeyEvents<'a> {
    pub key: String,
    pub events: Vec<Stored<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Node {
    Conversation(String),
    Item(String, ItemRef),
    Task(String),
}

struct Task {
    key: String,
    title: Option<String>,
    agent: Option<String>,
    started_at: Option<String>,
    ended_at: Option<String>,
    outcome: NodeOutcome,
    usage: Option<Usage>,
}

/// What the keys read say: each assembled, who defines which id, and the links they name.
#[derive(Default)]
struct Gathered {
    threads: HashMap<String, threads::ThreadView>,
    /// Namespaced id -> the first key defining it.
    defined_by: HashMap<String, String>,
    /// Key -> the parent ids it names, in the order found.
    parents: HashMap<String, Vec<String>>,
    /// (key, item naming it, namespaced child id) of spawn targets.
    child_names: Vec<(String, Option<ItemRef>, String)>,
    /// (key, turn or run, task id) of turns and runs carrying a task id.
    item_tasks: Vec<(String, ItemRef, String)>,
    /// Run id -> (key, turn id) of sends naming the run that handles them.
    turn_runs: HashMap<String, (String, String)>,
    tasks: HashMap<String, Task>,
    task_order: Vec<String>,
}

fn gather(keys: &[KeyEvents<'_>], prices: &Prices) -> Gathered {
    let mut g = Gathered::default();
    for k in keys {
        let view = threads::assemble(&k.key, &k.events, false, prices);
        g.threads.insert(k.key.clone(), view);
        for e in &k.events {
            let env = e.envelope;
            let f = Facts::of(&k.key, env);
            for d in &f.defines {
                g.defined_by
                    .entry(d.clone())
                    .or_insert_with(|| k.key.clone());
            }
            let parents = g.parents.entry(k.key.clone()).or_default();
            for p in &f.parents {
                if !parents.contains(p) {
                    parents.push(p.clone());
                }
            }
            for c in &f.children {
                match (c.strip_prefix("task:"), &f.item) {
                    (Some(t), Some(it)) => {
                        g.item_tasks
                            .push((k.key.clone(), it.clone(), t.to_string()));
                    }
                    (Some(_), None) => {}
                    (None, _) => g
                        .child_names
                        .push((k.key.clone(), f.item.clone(), c.clone())),
                }
            }
            let at = || {
                env.timestamp
                    .clone()
                    .unwrap_or_else(|| e.stored_at.to_string())
            };
            if let Some((turn, run)) = &f.turn_run {
                g.turn_runs
                    .entry(run.clone())
                    .or_insert_with(|| (k.key.clone(), turn.clone()));
            }
            if let Some(t) = &f.task {
                let at = at();
                let task = g.tasks.entry(t.clone()).or_insert_with(|| {
                    g.task_order.push(t.clone());
                    Task::new(&k.key, &at)
                });
                task.observe(env, &at);
            } else if env.event_type == "a2a.response" {
                // An A2A answer that ends the task it worked through (its final frame is the
                // turn's response, not a task event) settles the task's outcome; its usage
                // stays the turn's.
                let id = slot(&env.task_id).or_else(|| ptext(payload(env), "taskId"));
                if let Some(task) = id.and_then(|id| g.tasks.get_mut(&id)) {
                    task.settle(env, &at());
                }
            }
        }
    }
    g
}

impl Gathered {
    /// The node a key hangs under: the run its `parentRunId` names (or the turn whose send names
    /// that run as the one handling it), else the conversation or
    /// task it names as its parent, else the item of a key that names it as what it started,
    /// else the turn or run whose task lives under it.
    fn parent_of(&self, key: &str) -> Option<Node> {
        let parents = self.parents.get(key).map(Vec::as_slice).unwrap_or_default();
        let by_run = parents.iter().find_map(|p| {
            let r = p.strip_prefix("run:")?;
            let pk = self.defined_by.get(p).filter(|pk| *pk != key)?;
            let is_run = self
                .threads
                .get(pk)
                .is_some_and(|v| v.runs.iter().any(|x| x.run_id == r));
            Some(match self.turn_runs.get(r).filter(|(k, _)| k == pk) {
                Some((_, turn)) if !is_run => Node::Item(pk.clone(), ItemRef::Turn(turn.clone())),
                _ => Node::Item(pk.clone(), ItemRef::Run(r.to_string())),
            })
        });
        let by_name = || {
            parents.iter().find_map(|p| {
                let pk = self.defined_by.get(p).filter(|pk| *pk != key)?;
                Some(match p.strip_prefix("task:") {
                    Some(t) => Node::Task(t.to_string()),
                    None => Node::Conversation(pk.clone()),
                })
            })
        };
        let by_spawn = || {
            self.child_names.iter().find_map(|(pk, item, c)| {
                (pk != key && self.defined_by.get(c).is_some_and(|k| k == key)).then(
                    || match item {
                        Some(it) => Node::Item(pk.clone(), it.clone()),
                        None => Node::Conversation(pk.clone()),
                    },
                )
            })
        };
        let by_task = || {
            self.item_tasks.iter().find_map(|(pk, item, t)| {
                (pk != key && self.tasks.get(t).is_some_and(|task| task.key == key))
                    .then(|| Node::Item(pk.clone(), item.clone()))
            })
        };
        by_run.or_else(by_name).or_else(by_spawn).or_else(by_task)
    }

    /// Where each node hangs (parent -> children, in the order found): every key but the root
    /// under its parent, each task under the turn or run carrying its id, else under its
    /// conversation. A key holding nothing but one task is shown as that task.
    fn placement(&self, keys: &[KeyEvents<'_>], root_key: &str) -> HashMap<Node, Vec<Node>> {
        let mut below: HashMap<Node, Vec<Node>> = HashMap::new();
        let mut placed: HashSet<Node> = HashSet::from([Node::Conversation(root_key.to_string())]);
        let mut hang = |below: &mut HashMap<Node, Vec<Node>>, parent: Node, child: Node| {
            if placed.insert(child.clone()) {
                below.entry(parent).or_default().push(child);
            }
        };
        for k in keys.iter().skip(1) {
            if let Some(p) = self.parent_of(&k.key) {
                hang(&mut below, self.shown(p), Node::Conversation(k.key.clone()));
            }
        }
        for t in &self.task_order {
            let Some(task) = self.tasks.get(t) else {
                continue;
            };
            let owner = self
                .item_tasks
                .iter()
                .find(|(_, _, id)| id == t)
                .map(|(k, item, _)| Node::Item(k.clone(), item.clone()));
            let only_task = self
                .threads
                .get(&task.key)
                .is_some_and(|v| v.runs.is_empty() && v.turns.is_empty())
                && self.tasks.values().filter(|x| x.key == task.key).count() == 1;
            let conv = Node::Conversation(task.key.clone());
            if only_task && task.key != root_key {
                // In place of its conversation: where the conversation hangs.
                let parent = below
                    .iter()
                    .find(|(_, c)| c.contains(&conv))
                    .map(|(p, _)| p.clone())
                    .or(owner)
                    .map(|p| self.shown(p));
                if let Some(p) = parent {
                    if let Some(list) = below.get_mut(&p) {
                        list.retain(|n| n != &conv);
                    }
                    hang(&mut below, p, Node::Task(t.clone()));
                }
                continue;
            }
            hang(
                &mut below,
                self.shown(owner.unwrap_or(conv)),
                Node::Task(t.clone()),
            );
        }
        below
    }

    /// `n` when the tree shows it, else its conversation: an event may name a turn or run that
    /// has no send, response or run events of its own (an `a2a.spawn` outside any turn).
    fn shown(&self, n: Node) -> Node {
        let Node::Item(key, item) = &n else {
            return n;
        };
        let exists = self.threads.get(key).is_some_and(|v| match item {
            ItemRef::Run(r) => v.runs.iter().any(|x| &x.run_id == r),
            ItemRef::Turn(t) => v.turns.iter().any(|x| &x.turn_id == t),
        });
        if exists {
            n
        } else {
            Node::Conversation(key.clone())
        }
    }
}

/// The tree below `root` (a key, or a run or turn of it) over the events of the keys read
/// (`keys[0]` is the root's). `None` when the item is not in the root key.
pub fn build(keys: &[KeyEvents<'_>], item: Option<&ItemRef>, prices: &Prices) -> Option<Built> {
    let root_key = keys.first()?.key.clone();
    let g = gather(keys, prices);
    let below = g.placement(keys, &root_key);
    let root = match item {
        None => Node::Conversation(root_key.clone()),
        Some(it) => {
            let view = g.threads.get(&root_key)?;
            let found = match it {
                ItemRef::Run(r) => view.runs.iter().any(|x| &x.run_id == r),
                ItemRef::Turn(t) => view.turns.iter().any(|x| &x.turn_id == t),
            };
            if !found {
                return None;
            }
            Node::Item(root_key.clone(), it.clone())
        }
    };
    let ctx = Ctx {
        threads: &g.threads,
        tasks: &g.tasks,
        below: &below,
        prices,
        budget: Cell::new(MAX_NODES),
        cut: Cell::new(false),
    };
    let mut seen = HashSet::new();
    let node = ctx.node(&root, 0, &mut seen)?;
    Some(Built {
        root: node,
        cut: ctx.cut.get(),
    })
}

/// A tree, and whether [`MAX_NODES`] cut nodes off it.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub root: TreeNode,
    pub cut: bool,
}

impl Task {
    fn new(key: &str, at: &str) -> Task {
        Task {
            key: key.to_string(),
            title: None,
            agent: None,
            started_at: Some(at.to_string()),
            ended_at: None,
            outcome: NodeOutcome::Running,
            usage: None,
        }
    }

    fn observe(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        if self.title.is_none() {
            self.title = ptext(p, "title").or_else(|| ptext(p, "name"));
        }
        if self.agent.is_none() {
            self.agent = slot(&env.agent_id).or_else(|| env.publishing_agent());
        }
        if let Some(u) = usage::read(env) {
            self.usage.get_or_insert_with(Usage::default).add(&u);
        }
        self.settle(env, at);
    }

    /// The outcome an event's type, `status` or `state` gives the task.
    fn settle(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        let status = ptext(p, "status")
            .or_else(|| ptext(p, "state"))
            .unwrap_or_default()
            .to_ascii_lowercase();
        let t = env.event_type.as_str();
        let outcome = if t.ends_with(".completed")
            || matches!(
                status.as_str(),
                "completed" | "done" | "task_state_completed"
            ) {
            Some(NodeOutcome::Completed)
        } else if t.ends_with(".failed")
            || t.ends_with(".canceled")
            || t.ends_with(".cancelled")
            || matches!(
                status.as_str(),
                "failed"
                    | "error"
                    | "rejected"
                    | "canceled"
                    | "cancelled"
                    | "not_found"
                    | "task_state_failed"
                    | "task_state_rejected"
                    | "task_state_canceled"
            )
        {
            Some(NodeOutcome::Failed)
        } else if matches!(
            status.as_str(),
            "input-required"
                | "auth-required"
                | "task_state_input_required"
                | "task_state_auth_required"
        ) {
            Some(NodeOutcome::Waiting)
        } else {
            None
        };
        match outcome {
            Some(o) => {
                self.outcome = o;
                if o != NodeOutcome::Waiting {
                    self.ended_at = Some(at.to_string());
                }
            }
            None => {
                if self.ended_at.is_none() {
                    self.outcome = NodeOutcome::Running;
                }
            }
        }
    }
}

struct Ctx<'a> {
    threads: &'a HashMap<String, threads::ThreadView>,
    tasks: &'a HashMap<String, Task>,
    below: &'a HashMap<Node, Vec<Node>>,
    prices: &'a Prices,
    /// Nodes still allowed ([`MAX_NODES`] in all).
    budget: Cell<usize>,
    /// Whether the budget cut nodes off.
    cut: Cell<bool>,
}

fn ms(at: &Option<String>) -> Option<i64> {
    at.as_deref()
        .and_then(|a| chrono::DateTime::parse_from_rfc3339(a).ok())
        .map(|t| t.timestamp_millis())
}

fn shorten(s: &str) -> String {
    let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= LABEL_CHARS {
        return one_line;
    }
    let mut out: String = one_line.chars().take(LABEL_CHARS - 1).collect();
    out.push('…');
    out
}

fn run_outcome(o: RunOutcome) -> NodeOutcome {
    match o {
        RunOutcome::Running => NodeOutcome::Running,
        RunOutcome::Finished => NodeOutcome::Finished,
        RunOutcome::Waiting => NodeOutcome::Waiting,
        RunOutcome::Failed => NodeOutcome::Failed,
        RunOutcome::TimedOut => NodeOutcome::TimedOut,
    }
}

fn turn_outcome(o: TurnOutcome) -> NodeOutcome {
    match o {
        TurnOutcome::AwaitingReply => NodeOutcome::AwaitingReply,
        TurnOutcome::Answered => NodeOutcome::Answered,
        TurnOutcome::Waiting => NodeOutcome::Waiting,
        TurnOutcome::Blocked => NodeOutcome::Blocked,
    }
}

fn tool_outcome(s: ToolStatus) -> NodeOutcome {
    match s {
        ToolStatus::Running => NodeOutcome::Running,
        ToolStatus::Completed => NodeOutcome::Completed,
        ToolStatus::Failed => NodeOutcome::Failed,
        ToolStatus::Unfinished => NodeOutcome::Unfinished,
    }
}

/// A conversation's outcome from its items'.
fn overall(items: &[NodeOutcome]) -> NodeOutcome {
    use NodeOutcome as O;
    if items.is_empty() {
        return O::Unknown;
    }
    if items.contains(&O::Waiting) {
        O::Waiting
    } else if items
        .iter()
        .any(|o| matches!(o, O::Running | O::AwaitingReply))
    {
        O::Running
    } else if items
        .iter()
        .any(|o| matches!(o, O::Failed | O::Blocked | O::TimedOut))
    {
        O::Failed
    } else {
        O::Finished
    }
}

impl Ctx<'_> {
    /// Take one node from the budget; `false` (and the tree marked cut) when it is spent.
    fn take(&self) -> bool {
        match self.budget.get() {
            0 => {
                self.cut.set(true);
                false
            }
            n => {
                self.budget.set(n - 1);
                true
            }
        }
    }

    fn node(&self, n: &Node, depth: usize, seen: &mut HashSet<Node>) -> Option<TreeNode> {
        if !seen.insert(n.clone()) || !self.take() {
            return None;
        }
        let mut node = match n {
            Node::Conversation(key) => self.conversation(key, depth, seen)?,
            Node::Item(key, ItemRef::Run(r)) => {
                let view = self.threads.get(key)?;
                let run = view.runs.iter().find(|x| &x.run_id == r)?;
                self.run(key, run, view, depth, seen)
            }
            Node::Item(key, ItemRef::Turn(t)) => {
                let view = self.threads.get(key)?;
                let turn = view.turns.iter().find(|x| &x.turn_id == t)?;
                self.turn(key, turn)
            }
            Node::Task(t) => self.task(t)?,
        };
        if depth < MAX_DEPTH {
            for c in self.below.get(n).into_iter().flatten() {
                if let Some(child) = self.node(c, depth + 1, seen) {
                    node.children.push(child);
                }
            }
        }
        Some(finish(node))
    }

    fn conversation(&self, key: &str, depth: usize, seen: &mut HashSet<Node>) -> Option<TreeNode> {
        let view = self.threads.get(key)?;
        let ids: HashSet<&str> = view.runs.iter().map(|r| r.run_id.as_str()).collect();
        let mut children = Vec::new();
        if depth < MAX_DEPTH {
            for r in view.runs.iter().filter(|r| {
                !r.parent_run_id
                    .as_deref()
                    .is_some_and(|p| ids.contains(p) && p != r.run_id)
            }) {
                if let Some(c) = self.node(
                    &Node::Item(key.to_string(), ItemRef::Run(r.run_id.clone())),
                    depth + 1,
                    seen,
                ) {
                    children.push(c);
                }
            }
            for t in &view.turns {
                if let Some(c) = self.node(
                    &Node::Item(key.to_string(), ItemRef::Turn(t.turn_id.clone())),
                    depth + 1,
                    seen,
                ) {
                    children.push(c);
                }
            }
        }
        let outcomes: Vec<NodeOutcome> = children.iter().map(|c| c.outcome).collect();
        let agents: BTreeSet<&str> = view
            .runs
            .iter()
            .filter_map(|r| r.agent.as_deref())
            .chain(
                view.turns
                    .iter()
                    .flat_map(|t| [t.from_agent.as_deref(), t.to_agent.as_deref()])
                    .flatten(),
            )
            .collect();
        let label = if agents.is_empty() {
            key.to_string()
        } else {
            format!(
                "{key}: {}",
                agents.into_iter().collect::<Vec<_>>().join(", ")
            )
        };
        Some(TreeNode {
            kind: NodeKind::Conversation,
            id: key.to_string(),
            key: key.to_string(),
            item: None,
            label: shorten(&label),
            agent: None,
            started_at: None,
            ended_at: None,
            duration_ms: None,
            outcome: overall(&outcomes),
            usage: None,
            total: UsageRollup::default(),
            children,
        })
    }

    fn run(
        &self,
        key: &str,
        r: &RunView,
        view: &threads::ThreadView,
        depth: usize,
        seen: &mut HashSet<Node>,
    ) -> TreeNode {
        let mut children = Vec::new();
        for c in &r.tool_calls {
            if !self.take() {
                break;
            }
            children.push(TreeNode {
                kind: NodeKind::Tool,
                id: c.tool_call_id.clone(),
                key: key.to_string(),
                item: None,
                label: shorten(c.name.as_deref().unwrap_or("tool")),
                agent: r.agent.clone(),
                started_at: c.started_at.clone(),
                ended_at: c.ended_at.clone(),
                duration_ms: c.duration_ms,
                outcome: tool_outcome(c.status),
                usage: None,
                total: UsageRollup::default(),
                children: Vec::new(),
            });
        }
        if depth < MAX_DEPTH {
            for sub in view.runs.iter().filter(|x| {
                x.parent_run_id.as_deref() == Some(r.run_id.as_str()) && x.run_id != r.run_id
            }) {
                if let Some(c) = self.node(
                    &Node::Item(key.to_string(), ItemRef::Run(sub.run_id.clone())),
                    depth + 1,
                    seen,
                ) {
                    children.push(c);
                }
            }
        }
        let agent = r.agent.as_deref().unwrap_or("agent");
        TreeNode {
            kind: NodeKind::Run,
            id: r.run_id.clone(),
            key: key.to_string(),
            item: Some(format!("run:{}", r.run_id)),
            label: shorten(&format!("{agent} run {}", r.run_id)),
            agent: r.agent.clone(),
            started_at: r.started_at.clone(),
            ended_at: r.ended_at.clone(),
            duration_ms: r.duration_ms,
            outcome: run_outcome(r.outcome),
            usage: r.usage.as_ref().map(UsageRollup::from),
            total: UsageRollup::default(),
            children,
        }
    }

    fn turn(&self, key: &str, t: &TurnView) -> TreeNode {
        let who = format!(
            "{} → {}",
            t.from_agent.as_deref().unwrap_or("?"),
            t.to_agent.as_deref().unwrap_or("?")
        );
        let label = match &t.request {
            Some(r) => format!("{who}: {r}"),
            None => who,
        };
        TreeNode {
            kind: NodeKind::Turn,
            id: t.turn_id.clone(),
            key: key.to_string(),
            item: Some(format!("turn:{}", t.turn_id)),
            label: shorten(&label),
            agent: t.to_agent.clone(),
            started_at: t.sent_at.clone().or_else(|| t.answered_at.clone()),
            ended_at: t.answered_at.clone(),
            duration_ms: t.duration_ms,
            outcome: turn_outcome(t.outcome),
            usage: t.usage.as_ref().map(UsageRollup::from),
            total: UsageRollup::default(),
            children: Vec::new(),
        }
    }

    fn task(&self, id: &str) -> Option<TreeNode> {
        let t = self.tasks.get(id)?;
        let duration_ms = ms(&t.started_at).zip(ms(&t.ended_at)).map(|(s, e)| e - s);
        Some(TreeNode {
            kind: NodeKind::Task,
            id: id.to_string(),
            key: t.key.clone(),
            item: None,
            label: shorten(&t.title.clone().unwrap_or_else(|| format!("task {id}"))),
            agent: t.agent.clone(),
            started_at: t.started_at.clone(),
            ended_at: t.ended_at.clone(),
            duration_ms,
            outcome: t.outcome,
            usage: t.usage.as_ref().map(|u| UsageRollup::of(u, self.prices)),
            total: UsageRollup::default(),
            children: Vec::new(),
        })
    }
}

/// Children earliest first (bounded), the total rolled up, a conversation's times from its items.
fn finish(mut node: TreeNode) -> TreeNode {
    node.children.sort_by_key(|c| ms(&c.started_at));
    node.children.truncate(MAX_CHILDREN);
    let mut total = node.usage.clone().unwrap_or_default();
    for c in &node.children {
        total.add(&c.total);
    }
    node.total = total;
    if node.kind == NodeKind::Conversation {
        let outcomes: Vec<NodeOutcome> = node.children.iter().map(|c| c.outcome).collect();
        node.outcome = overall(&outcomes);
        let start = node
            .children
            .iter()
            .filter_map(|c| c.started_at.clone().zip(ms(&c.started_at)))
            .min_by_key(|(_, m)| *m);
        let end = node
            .children
            .iter()
            .filter_map(|c| c.ended_at.clone().zip(ms(&c.ended_at)))
            .max_by_key(|(_, m)| *m);
        let still = node.children.iter().any(|c| c.ended_at.is_none());
        node.started_at = start.as_ref().map(|(s, _)| s.clone());
        if !still {
            node.ended_at = end.as_ref().map(|(s, _)| s.clone());
            node.duration_ms = start.zip(end).map(|((_, s), (_, e))| e - s);
        }
    }
    node
}

#[cfg(test)]
mod tests;
