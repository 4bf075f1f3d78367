#!/usr/bin/env python3
"""Build the seed corpus of every fuzz target from the project's fixtures.

    python3 fuzz/seed_corpus.py [OUT_DIR]        (default: fuzz/corpus)

Reads fixtures/ in the repository and, when present, the shared fixtures beside the
repository (../shared/fixtures: A2A spec samples, AG-UI and Agent UI events, collaboration
events, assay packets), and writes one file per seed to OUT_DIR/<target>/, named by the SHA-1
of its content as libFuzzer names corpus entries. Seeds already there are kept, so a corpus
grown by earlier runs keeps growing. Deterministic; standard library only.
"""

import base64
import hashlib
import json
import os
import sys
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
REPO = FUZZ_DIR.parent
FIXTURE_DIRS = [REPO / "fixtures", REPO.parent / "shared" / "fixtures"]
# Keys that mark a JSON object as an input a producer could publish.
EVENT_KEYS = ("type", "protocol", "event_type", "jsonrpc")
MAX_SEEDS = 80
MAX_SEED_BYTES = 64 * 1024


def compact(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def fixture_files():
    for root in FIXTURE_DIRS:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.json")):
            # JSON Schemas and the adapter's expected outputs are not inputs.
            if "schemas" in path.parts or path.name.endswith(".expected.json"):
                continue
            if "schema" in path.name:
                continue
            yield path


def load(path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None


def event_like(value, out):
    """Every object under `value` (itself included) that looks like a published input."""
    if isinstance(value, dict):
        if any(k in value for k in EVENT_KEYS):
            out.append(value)
        for v in value.values():
            event_like(v, out)
    elif isinstance(value, list):
        for v in value:
            event_like(v, out)
    return out


def fixture_events():
    events = []
    for path in fixture_files():
        doc = load(path)
        if doc is None:
            continue
        found = event_like(doc, [])
        if not found and isinstance(doc, dict):
            found = [doc]
        events.extend(found)
    return events


def cursor(seq):
    return base64.urlsafe_b64encode(f"v1:{seq}".encode()).decode().rstrip("=")


# Secret shapes for the redactor (synthetic: none of these is a real credential).
SECRETS = [
    "Authorization: Bearer abcdefgh12345678",
    "curl -H 'authorization: bearer 0a1b2c3d4e5f=' https://example.invalid",
    "Basic dXNlcjpwYXNzd29yZA== sent",
    "token eyJhbGciOiJub25lIn0.eyJzdWIiOiJmdXp6ZXIifQ.c2lnbmF0dXJl expired",
    "-----BEGIN PRIVATE KEY-----\nMIIBVgIBADANBg\n-----END PRIVATE KEY-----",
    "-----BEGIN EC PRIVATE KEY BLOCK-----\nabc\n-----END EC PRIVATE KEY BLOCK-----",
    "key AKIAABCDEFGHIJKLMNOP in use",
    "aws_secret_access_key = 0123456789abcdefghijABCDEFGHIJ/+0123456=",
    "use ghp_0123456789abcdefghijABCDEFGHIJklmnop now",
    "github_pat_0123456789abcdefghijkl_mnop",
    "glpat-0123456789abcdefghij",
    "xoxb-0123456789-abcdefghij",
    "https://hooks.slack.com/services/T0/B0/abc",
    "sk-ant-api03-0123456789abcdefghij",
    "sk-proj-0123456789abcdefghijklmn",
    "AIza0123456789abcdefghijklmnopqrstuvwxy",
    "db at postgres://admin:pw@db.internal:5432/app",
    '{"password":"hunter2","note":"Bearer abcdefgh12345678"}',
    '[{"api_key":"k"},"sk-0123456789abcdefghijklmn"]',
]

SENSITIVE_EVENTS = [
    {"type": "tool.result", "sessionId": "s-1", "data": {"headers": {"Authorization": "Bearer abcdefgh12345678"}, "output": SECRETS[17]}},
    {"type": "a2a.send", "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c-1", "message": "pw is postgres://u:p@h/db", "api_key": "k"}},
    {"protocol": "a2a", "version": "0.2", "event_type": "task.requested", "agent": {"id": "agent://x", "token": "t"}, "task": {"id": "Bearer abcdefgh12345678", "kind": "delegation"}, "attributes": {"secret": ["a"]}},
]

NON_OBJECTS = ["[]", "1", '"a2a.send"', "null", "{", '{"type":', b"\xff\xfe{", '{"type":1}', '{"type":"RUN_STARTED"}', '{"jsonrpc":"2.0"}', "{}"]

QUERIES = [
    "",
    "role=conversation.main",
    "role=conversation.main,system.observability&type=a2a.send",
    "type=a2a.send&type=a2a.response&type=a2a.send",
    "view=conversations",
    "view=debug&role=delegation.subagent",
    "view=conversations&type=a2a.send",
    "key=agent%3Aeden%3Amain",
    "key=conv-42&key=_x&limit=50",
    "limit=1000",
    "limit=0",
    "limit=1&limit=1",
    f"after={cursor(42)}",
    f"before={cursor(100)}&limit=10",
    f"after={cursor(0)}&before={cursor(9)}",
    "after=not-a-cursor",
    "roles=conversation.main",
    "type=a.*",
    "type=a%20b",
    "type=task.updated&key=%F0%9F%98%80",
    "role=orchestration.task&type=run.started&key=t-1&view=debug",
    "view=nope",
    "role=&type=,&key=",
]

CONFIG_SNIPPETS = [
    "[nats]\nurl = \"nats://127.0.0.1:4222\"\nprefix = \"collab\"\npartitions = 4\n",
    "[nats]\nurll = \"x\"\n",
    "[natz]\n",
    "[turns]\ndefault_timeout = \"90s\"\nenforce_roles = [\"conversation.main\", \"delegation.subagent\"]\n",
    "[turns]\nenforce_roles = [\"conversation.mian\"]\n",
    "[limits]\nmax_depth = 0\n",
    "[limits]\nmax_depth = 128\nmax_string_bytes = 1\n",
    "[redaction]\nkeys = [\"session-pin\"]\npatterns = [{ name = \"ticket\", pattern = \"TKT-[0-9]{6}\" }]\n",
    "[redaction]\npatterns = [{ name = \"broken\", pattern = \"(\" }]\n",
    "[consumer]\npublish_window = 5000\n",
    "[consumer]\nack_wait = \"1s\"\n[turns]\nopen_write_delay = \"1s\"\n",
    "[http]\naddr = \"0.0.0.0:8080\"\n[[http.tokens]]\nname = \"ui\"\ntoken = \"change-me\"\nroles = [\"conversation.main\"]\n",
    "[[http.tokens]]\nname = \"env\"\ntoken_env = \"COLLAB_HOSTILE_UNSET\"\nroles = [\"system.observability\"]\n",
    "[workers]\nlease_ttl = \"500ms\"\n",
    "[adapter]\nmode = \"strict\"\n",
    "[adapter]\nmode = \"loose\"\n",
    "[roles]\nmain_agents = []\n",
    "nats = 1\n",
    "[nats]\npartitions = -1\n",
    "[nats]\npartitions = 70000\n",
    "[turns]\nmax_timeout = \"99999999999999999999h\"\n",
    "= = =\n",
]


def envelopes(events):
    """Envelope-shaped JSON: a projection's fields around fixture events."""
    roles = ["conversation.main", "delegation.subagent", "orchestration.task", "system.observability"]
    out = []
    for i, ev in enumerate(events):
        t = ev.get("type") if isinstance(ev.get("type"), str) else "assay.adapter.a2a.message"
        out.append({
            "type": t,
            "eventRole": roles[i % 4],
            "sequence": i,
            "timestamp": "2026-02-17T12:00:00.000Z",
            "sessionId": ev.get("sessionId", f"s-{i}"),
            "owner": "agent",
            "payload": ev.get("data", ev),
            "refs": {"handoffDigest": "0" * 64},
            "rawEventRef": {"stream": "COLLAB_RAW", "seq": i + 1, "subject": f"collab.raw.k{i}.{t}", "storedAt": "2026-02-17T12:00:00.000Z"},
            "redactions": i % 3 or None,
        })
    out.append({"type": "x", "eventRole": None})
    out.append({"type": "x", "eventRole": "conversation.mian"})
    out.append({"type": "a2a.response", "eventRole": "conversation.main", "payload": {"f": 1.5e300, "n": -0.0, "u": 18446744073709551615}})
    return out


def write(out_dir, target, seeds):
    target_dir = out_dir / target
    target_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    seen = set()
    for seed in seeds:
        data = seed if isinstance(seed, bytes) else seed.encode("utf-8", "surrogateescape")
        if len(data) > MAX_SEED_BYTES:
            continue
        name = hashlib.sha1(data).hexdigest()
        if name in seen:
            continue
        seen.add(name)
        (target_dir / name).write_bytes(data)
        written += 1
        if written >= MAX_SEEDS:
            break
    return written


def spread(items, n):
    """At most n items taken evenly across the list, so every fixture family is represented."""
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def main():
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else FUZZ_DIR / "corpus"
    events = fixture_events()
    event_texts = [compact(e) for e in events]
    packets = [e for e in events if e.get("protocol") == "a2a" or "event_type" in e]
    default_toml = (REPO / "config" / "default.toml").read_text(encoding="utf-8")

    counts = {
        "normalize": write(out_dir, "normalize", [compact(e) for e in SENSITIVE_EVENTS] + NON_OBJECTS + spread(event_texts, 60)),
        "adapter": write(out_dir, "adapter", [compact(p) for p in packets] + [compact(SENSITIVE_EVENTS[2]), "{}", '{"protocol":"a2a"}']),
        "redact": write(out_dir, "redact", SECRETS + [compact(s) for s in SECRETS] + [compact(e) for e in SENSITIVE_EVENTS] + spread(event_texts, 20)),
        "envelope": write(out_dir, "envelope", [compact(e) for e in envelopes(spread(events, 50))]),
        "config": write(out_dir, "config", [default_toml] + CONFIG_SNIPPETS),
        "query": write(out_dir, "query", QUERIES),
    }
    sources = [str(d) for d in FIXTURE_DIRS if d.is_dir()]
    print(f"seed corpus in {out_dir} from {', '.join(sources)}: " + ", ".join(f"{t} {n}" for t, n in counts.items()))


if __name__ == "__main__":
    main()
