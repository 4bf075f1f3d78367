"""An A2A client built with the a2a-sdk that calls the e2e agents through their relays.

It resolves each agent's card through the relay, keeps only the interface a scenario tests
(JSON-RPC v1.0, JSON-RPC v0.3, HTTP+JSON v1.0), and sends with the SDK's client. It prints one
JSON line per scenario: what the client received (each event as protobuf JSON), so the test can
compare it with what the relay published.

With `--fresh` every scenario starts a new conversation: its first message carries no context id
and the agent picks one (later messages of the scenario use the one the agent chose).

With `--unknown URL` it also continues a task the agent does not know (the SDK raises the
agent's TaskNotFound error, recorded as the scenario's `error`); with `--hang URL` it only sends
one streamed message to an agent that opens the stream and then never answers, and waits (the test
kills the agent meanwhile).

Usage: python a2a_client.py [--complete URL --stream URL --ask URL] [--unknown URL] [--hang URL]
       [--caller ID] [--fresh]
"""

import argparse
import asyncio
import json
import uuid

import httpx
from google.protobuf.json_format import MessageToDict

from a2a.client import A2ACardResolver, ClientConfig, create_client
from a2a.types import AgentCard, Message, Part, Role, SendMessageRequest

# The header the relays are told to read the caller's agent id from.
CALLER_HEADER = "X-Collab-Agent"


def only_interface(card: AgentCard, binding: str, version: str) -> AgentCard:
    """A copy of `card` offering one interface, so the SDK picks that transport."""
    narrowed = AgentCard()
    narrowed.CopyFrom(card)
    del narrowed.supported_interfaces[:]
    for interface in card.supported_interfaces:
        if (
            interface.protocol_binding == binding
            and interface.protocol_version == version
        ):
            narrowed.supported_interfaces.append(interface)
    if not narrowed.supported_interfaces:
        raise SystemExit(f"the card offers no {binding} {version} interface")
    return narrowed


def message(text: str, context_id: str | None, task_id: str | None = None) -> Message:
    return Message(
        role=Role.ROLE_USER,
        message_id=str(uuid.uuid4()),
        parts=[Part(text=text)],
        context_id=context_id,
        task_id=task_id,
    )


def context_of(event: dict) -> str | None:
    """The context id an answer (a task, a message or an update) carries."""
    for member in ("task", "message", "statusUpdate", "artifactUpdate"):
        context_id = event.get(member, {}).get("contextId")
        if context_id:
            return context_id
    return None


async def send(client, msg: Message) -> list[dict]:
    events = []
    async for event in client.send_message(SendMessageRequest(message=msg)):
        events.append(MessageToDict(event))
    return events


async def scenario(
    http: httpx.AsyncClient,
    name: str,
    base_url: str,
    binding: str,
    version: str,
    streaming: bool,
    texts: list[str],
    fresh: bool,
) -> dict:
    card = await A2ACardResolver(http, base_url).get_agent_card()
    card = only_interface(card, binding, version)
    client = await create_client(
        card,
        client_config=ClientConfig(
            streaming=streaming,
            httpx_client=http,
            supported_protocol_bindings=[binding],
        ),
    )
    context_id = None if fresh else f"e2e-{name}"
    calls = []
    task_id = "no-such-task" if "unknown" in name else None
    for text in texts:
        events = await send(client, message(text, context_id, task_id))
        # Further messages continue the task the first one opened (input-required), in the
        # context the agent chose for a fresh conversation.
        for event in events:
            task_id = task_id or event.get("task", {}).get("id")
            context_id = context_id or context_of(event)
        calls.append(events)
    return {
        "scenario": name,
        "binding": binding,
        "version": version,
        "streaming": streaming,
        "contextId": context_id,
        "calls": calls,
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--complete")
    parser.add_argument("--stream")
    parser.add_argument("--ask")
    parser.add_argument("--unknown")
    parser.add_argument("--hang")
    parser.add_argument("--caller", default="planner")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()

    plan = []
    if args.complete and args.stream and args.ask:
        plan += [
            ("complete-jsonrpc-v1", args.complete, "JSONRPC", "1.0", False, ["hello"]),
            ("complete-jsonrpc-v03", args.complete, "JSONRPC", "0.3", False, ["hello"]),
            ("complete-rest-v1", args.complete, "HTTP+JSON", "1.0", False, ["hello"]),
            ("stream-jsonrpc-v1", args.stream, "JSONRPC", "1.0", True, ["report"]),
            ("stream-rest-v1", args.stream, "HTTP+JSON", "1.0", True, ["report"]),
            ("ask-jsonrpc-v1", args.ask, "JSONRPC", "1.0", False, ["book", "Oslo"]),
        ]
    if args.unknown:
        plan.append(("unknown-jsonrpc-v1", args.unknown, "JSONRPC", "1.0", False, ["status?"]))
    if args.hang:
        plan.append(("hang-jsonrpc-v1", args.hang, "JSONRPC", "1.0", True, ["anyone?"]))
    async with httpx.AsyncClient(
        headers={CALLER_HEADER: args.caller}, timeout=30
    ) as http:
        for name, url, binding, version, streaming, texts in plan:
            try:
                if args.fresh:
                    name = f"fresh-{name}"
                result = await scenario(
                    http, name, url, binding, version, streaming, texts, args.fresh
                )
            except Exception as e:  # the agent's error, as the SDK raised it
                result = {"scenario": name, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
