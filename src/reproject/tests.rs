use super::*;

fn out(subject: &str, payload: &str, seq: u64) -> Output {
    Output::new(subject, payload.as_bytes(), Some(seq), seq)
}

fn outputs(items: &[(&str, Output)]) -> Outputs {
    items
        .iter()
        .map(|(id, o)| ((*id).to_string(), o.clone()))
        .collect()
}

#[test]
fn equal_outputs_have_equal_digests_and_no_change() {
    let a = outputs(&[
        ("R:1:0", out("proj.conversation.main.c1.a2a.send", "{}", 1)),
        ("R:2:dlq", out("dlq.bad_json", "x", 2)),
    ]);
    // Stored elsewhere in the version's own streams: the same outputs.
    let mut b = a.clone();
    for o in b.values_mut() {
        o.stream_seq += 1000;
    }
    let d = diff(&a, &b, 1, 2, 5);
    assert!(d.same());
    assert_eq!(d.identical, 2);
    assert!(d.changed.is_empty() && d.examples.is_empty() && d.turns.is_empty());
}

#[test]
fn each_kind_of_change_is_named() {
    let live = outputs(&[
        ("R:1:0", out("proj.conversation.main.c1.a2a.send", "{}", 1)),
        ("R:2:0", out("proj.conversation.main.c1.a2a.note", "{}", 2)),
        (
            "R:3:0",
            out("proj.conversation.main.c1.a2a.send", "{\"a\":1}", 3),
        ),
        ("R:4:0", out("proj.system.observability.h.health", "{}", 4)),
        ("R:5:0", out("proj.conversation.main.c1.a2a.send", "{}", 5)),
    ]);
    let version = outputs(&[
        (
            "R:1:0",
            out("proj.delegation.subagent.c1.a2a.send", "{}", 1),
        ),
        ("R:2:0", out("proj.conversation.main.c1.a2a.other", "{}", 2)),
        (
            "R:3:0",
            out("proj.conversation.main.c1.a2a.send", "{\"a\":2}", 3),
        ),
        ("R:4:dlq", out("dlq.bad_json", "{}", 4)),
        ("R:5:0", out("proj.conversation.main.c2.a2a.send", "{}", 5)),
    ]);
    let d = diff(&live, &version, 1, 5, 10);
    assert!(!d.same());
    let n = |k: &str| d.changed.get(k).copied().unwrap_or(0);
    assert_eq!(n("role"), 1);
    assert_eq!(n("type"), 1);
    assert_eq!(n("payload"), 1);
    assert_eq!(n("subject"), 1);
    assert_eq!(n("only_live"), 1);
    assert_eq!(n("only_version"), 1);
    assert_eq!(d.identical, 0);
    let role = d.examples.iter().find(|c| c.kind == ChangeKind::Role);
    assert_eq!(
        role.and_then(|c| c.version.clone()).as_deref(),
        Some("proj.delegation.subagent.c1.a2a.send")
    );
}

#[test]
fn turns_whose_response_changes_are_listed_with_both_outcomes() {
    let replied = r#"{"type":"a2a.response","turnId":"t1","payload":{"text":"ok"}}"#;
    let blocked = r#"{"type":"a2a.response","turnId":"t1","payload":{"outcome":"blocked","reason":"timeout"}}"#;
    let same = r#"{"type":"a2a.response","turnId":"t2","payload":{"text":"fine"}}"#;
    let live = outputs(&[
        (
            "R:7:0",
            out("proj.conversation.main.c1.a2a.response", replied, 7),
        ),
        (
            "R:9:0",
            out("proj.conversation.main.c1.a2a.response", same, 9),
        ),
    ]);
    let version = outputs(&[
        (
            "turn:c1:t1",
            out("proj.conversation.main.c1.a2a.response", blocked, 6),
        ),
        (
            "R:9:0",
            out("proj.conversation.main.c1.a2a.response", same, 9),
        ),
    ]);
    let d = diff(&live, &version, 1, 9, 3);
    assert_eq!(
        d.turns,
        vec![TurnChange {
            key: "c1".into(),
            turn: "t1".into(),
            live: "replied".into(),
            version: "blocked:timeout".into(),
        }]
    );
    let text = render(&d, &Names::new("collab"), &Names::versioned("collab", "v2"));
    assert!(
        text.contains("c1 turn t1: replied -> blocked:timeout"),
        "{text}"
    );
}

#[test]
fn the_digest_covers_ids_subjects_and_bytes() {
    let a = outputs(&[("R:1:0", out("proj.conversation.main.c1.a2a.send", "{}", 1))]);
    let b = outputs(&[("R:1:1", out("proj.conversation.main.c1.a2a.send", "{}", 1))]);
    let c = outputs(&[("R:1:0", out("proj.conversation.main.c2.a2a.send", "{}", 1))]);
    let e = outputs(&[("R:1:0", out("proj.conversation.main.c1.a2a.send", "{ }", 1))]);
    let all = [digest(&a), digest(&b), digest(&c), digest(&e)];
    let distinct: BTreeSet<_> = all.iter().collect();
    assert_eq!(distinct.len(), 4);
}

#[test]
fn a_version_keeps_the_raw_stream_and_moves_everything_else() {
    let n = Names::versioned("collab", "v2");
    assert_eq!(n.raw_stream, "COLLAB_RAW");
    assert_eq!(n.raw_subjects(), "collab.raw.*.>");
    assert_eq!(n.key_filter("c1"), "collab.in.*.*.*.*.*.*.*.*.c1.>");
    assert_eq!(n.proj_stream, "COLLAB_V2_PROJ");
    assert_eq!(n.turns_bucket, "collab_v2_turns");
    assert_eq!(n.consumer_name(3), "collab_v2-proj-3");
    assert_eq!(Names::versioned("collab", ""), Names::new("collab"));
}

#[test]
fn the_fields_of_a_payload_change_are_named_with_both_values() {
    let a = br#"{"type":"a2a.response","payload":{"evidence":[{"at":"x","timeoutMs":10000}],"text":"same"}}"#;
    let b = br#"{"type":"a2a.response","payload":{"evidence":[{"at":"y","timeoutMs":300000}],"text":"same","extra":1}}"#;
    assert_eq!(
        payload_fields(a, b),
        vec![
            "payload.evidence[0].at: \"x\" -> \"y\"".to_string(),
            "payload.evidence[0].timeoutMs: 10000 -> 300000".to_string(),
            "payload.extra: only after".to_string(),
        ]
    );
    assert!(payload_fields(b"not json", a).is_empty());
    assert!(payload_fields(a, a).is_empty());
}
