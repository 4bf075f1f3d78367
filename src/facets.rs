//! Facets (owner, scope, phase, surface, persistence) derived from the event class.
//!
//! The table is part of the contract (README, "Envelope"); a class it does not know gets no
//! facets rather than guessed ones. Values a producer set itself are never overwritten.

use crate::model::Envelope;

/// Facets for one event class. `None` leaves the field out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facets {
    pub owner: Option<&'static str>,
    pub scope: Option<&'static str>,
    pub phase: Option<&'static str>,
    pub surface: Option<&'static str>,
    pub persistence: Option<&'static str>,
}

fn f(
    owner: &'static str,
    scope: &'static str,
    phase: Option<&'static str>,
    surface: &'static str,
    persistence: Option<&'static str>,
) -> Facets {
    Facets {
        owner: Some(owner),
        scope: Some(scope),
        phase,
        surface: Some(surface),
        persistence,
    }
}

/// Phase of a task from its reported status.
pub fn task_phase(status: &str) -> Option<&'static str> {
    Some(match status.to_ascii_lowercase().as_str() {
        "queued" | "open" | "scheduled" | "submitted" | "requested" | "created" | "pending" => {
            "submitted"
        }
        "accepted" => "accepted",
        "running" | "claimed" | "working" | "started" | "in_progress" | "active" | "waking" => {
            "acting"
        }
        "blocked" | "waiting" | "input_required" | "needs_input" | "auth_required" | "paused"
        | "sleeping" => "waiting",
        "reviewing" => "reviewing",
        "done" | "completed" | "succeeded" | "success" => "completed",
        "failed" | "error" | "rejected" => "failed",
        "cancelled" | "canceled" | "killed" | "removed" => "cancelled",
        _ => return None,
    })
}

fn task_phase_from_type(event_type: &str) -> Option<&'static str> {
    let last = event_type.rsplit('.').next().unwrap_or("");
    task_phase(last)
}

/// Derive facets for a class. `status` is the task or run status the event reports, if any;
/// `failed` says whether the event carries a failure signal.
///
/// A class named in the table exactly takes its row; any other class takes the row of its family
/// (the part before the first dot), or none.
pub fn derive(event_type: &str, status: Option<&str>, failed: bool) -> Facets {
    turn_class(event_type, failed)
        .or_else(|| agent_run_tool_class(event_type, status, failed))
        .or_else(|| content_class(event_type))
        .unwrap_or_else(|| family(event_type, status, failed))
}

/// The turn's own classes (`a2a.*`) and the suppressed terminal events.
fn turn_class(class: &str, failed: bool) -> Option<Facets> {
    Some(match class {
        "a2a.send" => f(
            "agent",
            "turn",
            Some("submitted"),
            "conversation",
            Some("transcript"),
        ),
        "a2a.response" => f(
            "agent",
            "turn",
            Some(if failed { "failed" } else { "completed" }),
            "conversation",
            Some("transcript"),
        ),
        "a2a.response.suppressed" | "run.terminal.suppressed" => f(
            "runtime",
            "turn",
            None,
            "diagnostics",
            Some("diagnostics_log"),
        ),
        "a2a.complete" => f(
            "runtime",
            "turn",
            Some(if failed { "failed" } else { "completed" }),
            "timeline_evidence",
            Some("archive"),
        ),
        "a2a.error" => f(
            "runtime",
            "turn",
            Some("failed"),
            "timeline_evidence",
            Some("archive"),
        ),
        "a2a.spawn" | "a2a.spawn_result" => f(
            "agent",
            "agent",
            Some("acting"),
            "delegation_graph",
            Some("snapshot"),
        ),
        _ => return None,
    })
}

/// Agent, run and tool classes named exactly.
fn agent_run_tool_class(class: &str, status: Option<&str>, failed: bool) -> Option<Facets> {
    Some(match class {
        "agent.handoff" => f(
            "agent",
            "agent",
            Some("acting"),
            "handoff_lane",
            Some("archive"),
        ),
        "agent.completed" => f(
            "agent",
            "agent",
            Some(if failed { "failed" } else { "completed" }),
            "team_roster",
            Some("snapshot"),
        ),
        "run.started" => f(
            "runtime",
            "run",
            Some("submitted"),
            "runtime_status",
            Some("ephemeral_live"),
        ),
        "run.status" => f(
            "runtime",
            "run",
            status.and_then(task_phase).or(Some("accepted")),
            "runtime_status",
            Some("ephemeral_live"),
        ),
        "run.finished" => f(
            "runtime",
            "run",
            Some("completed"),
            "runtime_status",
            Some("archive"),
        ),
        "run.failed" => f(
            "runtime",
            "run",
            Some("failed"),
            "runtime_status",
            Some("archive"),
        ),
        "tool.result" => f(
            "tool",
            "tool_call",
            Some("completed"),
            "tool_ui",
            Some("archive"),
        ),
        "tool.failed" => f(
            "tool",
            "tool_call",
            Some("failed"),
            "tool_ui",
            Some("archive"),
        ),
        _ => return None,
    })
}

/// Message, queue, review, evidence, team, state and diagnostic classes named exactly.
fn content_class(class: &str) -> Option<Facets> {
    Some(match class {
        "text.delta" | "text.final" => f(
            "model",
            "message",
            Some("producing"),
            "conversation",
            Some("transcript"),
        ),
        "queue.changed" => f(
            "runtime",
            "session",
            Some("submitted"),
            "task_capsule",
            Some("snapshot"),
        ),
        "worker.notification" => f(
            "agent",
            "task",
            Some("archived"),
            "worker_notifications",
            Some("archive"),
        ),
        "review.requested" => f(
            "evidence",
            "evidence",
            Some("reviewing"),
            "review_lane",
            Some("evidence_pack"),
        ),
        "review.completed" => f(
            "evidence",
            "evidence",
            Some("completed"),
            "review_lane",
            Some("evidence_pack"),
        ),
        "evidence.changed" => f(
            "evidence",
            "evidence",
            None,
            "timeline_evidence",
            Some("evidence_pack"),
        ),
        "team.changed" => f("agent", "team", None, "team_roster", Some("snapshot")),
        "permission.changed" => f("policy", "workspace", None, "hitl", Some("snapshot")),
        "messages.snapshot" => f(
            "session",
            "thread",
            Some("hydrating"),
            "conversation",
            Some("transcript"),
        ),
        "state.snapshot" | "state.delta" => {
            f("runtime", "session", None, "diagnostics", Some("snapshot"))
        }
        "diagnostic.changed" | "metric.changed" => f(
            "diagnostics",
            "application",
            Some("unknown"),
            "diagnostics",
            Some("diagnostics_log"),
        ),
        _ => return None,
    })
}

/// A class not named exactly: the row of its family, or no facets.
fn family(class: &str, status: Option<&str>, failed: bool) -> Facets {
    let first = class.split('.').next().unwrap_or("");
    match first {
        "task" => f(
            "task",
            "task",
            status
                .and_then(task_phase)
                .or_else(|| task_phase_from_type(class)),
            "task_capsule",
            Some("snapshot"),
        ),
        "agent" => f(
            "agent",
            "agent",
            Some("acting"),
            "team_roster",
            Some("snapshot"),
        ),
        "tool" => f(
            "tool",
            "tool_call",
            Some(if failed { "failed" } else { "acting" }),
            "tool_ui",
            Some("archive"),
        ),
        "plan" => f(
            "model",
            "turn",
            Some("planning"),
            "inline_process",
            Some("archive"),
        ),
        "action" => f(
            "action",
            "action_request",
            Some(if class.ends_with("resolved") {
                "completed"
            } else {
                "waiting"
            }),
            "hitl",
            Some("snapshot"),
        ),
        "artifact" => f(
            "artifact",
            "artifact",
            Some(if class.ends_with("failed") {
                "failed"
            } else {
                "producing"
            }),
            "artifact_workspace",
            Some("artifact_store"),
        ),
        // AG-UI names its reasoning events REASONING_* (THINKING_* before), and seed 003
        // has reasoning.delta and reasoning.summary: the whole family is the model reasoning.
        "reasoning" | "thinking" => f(
            "model",
            "message",
            Some("reasoning"),
            "inline_process",
            Some("archive"),
        ),
        "context" => f(
            "context",
            "session",
            Some("preparing"),
            "inline_process",
            Some("archive"),
        ),
        "session" => f("session", "session", None, "session_tabs", Some("snapshot")),
        "health" | "monitor" | "diagnostics" | "diagnostic" | "heartbeat" | "metric" => f(
            "diagnostics",
            "application",
            Some("unknown"),
            "diagnostics",
            Some("diagnostics_log"),
        ),
        _ => Facets::default(),
    }
}

/// Fill facets the producer did not set itself.
pub fn apply(env: &mut Envelope, facets: &Facets) {
    fn fill(slot: &mut Option<String>, v: Option<&'static str>) {
        if slot.is_none() {
            *slot = v.map(str::to_string);
        }
    }
    fill(&mut env.owner, facets.owner);
    fill(&mut env.scope, facets.scope);
    fill(&mut env.phase, facets.phase);
    fill(&mut env.surface, facets.surface);
    fill(&mut env.persistence, facets.persistence);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_table_rows() {
        let send = derive("a2a.send", None, false);
        assert_eq!(
            (send.owner, send.scope, send.phase, send.surface),
            (
                Some("agent"),
                Some("turn"),
                Some("submitted"),
                Some("conversation")
            )
        );
        assert_eq!(derive("a2a.response", None, false).phase, Some("completed"));
        assert_eq!(derive("a2a.response", None, true).phase, Some("failed"));
        let complete = derive("a2a.complete", None, true);
        assert_eq!(
            (complete.owner, complete.phase, complete.surface),
            (Some("runtime"), Some("failed"), Some("timeline_evidence"))
        );
        assert_eq!(
            derive("a2a.spawn", None, false).surface,
            Some("delegation_graph")
        );
        assert_eq!(
            derive("agent.spawned", None, false).surface,
            Some("team_roster")
        );
        let task = derive("task.updated", Some("blocked"), false);
        assert_eq!(
            (task.owner, task.scope, task.phase),
            (Some("task"), Some("task"), Some("waiting"))
        );
        assert_eq!(
            derive("task.completed", None, false).phase,
            Some("completed")
        );
        assert_eq!(derive("task.changed", None, false).phase, None);
        assert_eq!(derive("run.failed", None, false).phase, Some("failed"));
        assert_eq!(
            derive("run.started", None, false).surface,
            Some("runtime_status")
        );
        assert_eq!(derive("tool.started", None, false).phase, Some("acting"));
        assert_eq!(derive("tool.result", None, false).phase, Some("completed"));
        assert_eq!(derive("tool.failed", None, false).phase, Some("failed"));
        let health = derive("health.ping", None, false);
        assert_eq!(
            (health.owner, health.scope, health.phase, health.surface),
            (
                Some("diagnostics"),
                Some("application"),
                Some("unknown"),
                Some("diagnostics")
            )
        );
    }

    #[test]
    fn every_reasoning_and_thinking_class_is_the_model_reasoning() {
        for class in [
            "reasoning.delta",
            "reasoning.summary",
            "reasoning.message.content",
            "reasoning.encrypted.value",
            "thinking.text.message.start",
        ] {
            let r = derive(class, None, false);
            assert_eq!(
                (r.owner, r.phase, r.surface),
                (Some("model"), Some("reasoning"), Some("inline_process")),
                "{class}"
            );
        }
        assert_eq!(derive("reasoningx", None, false), Facets::default());
    }

    #[test]
    fn unknown_classes_get_no_facets() {
        assert_eq!(derive("custom.thing", None, false), Facets::default());
    }

    #[test]
    fn producer_values_are_kept() {
        let mut env = Envelope {
            owner: Some("team".into()),
            ..Default::default()
        };
        apply(&mut env, &derive("task.created", None, false));
        assert_eq!(env.owner.as_deref(), Some("team"));
        assert_eq!(env.scope.as_deref(), Some("task"));
    }
}
