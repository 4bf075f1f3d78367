"""Three A2A agents built with the a2a-sdk, served by one process for the relay's end-to-end test.

Each agent lives under its own path prefix with its own agent card, JSON-RPC endpoint (v1.0, and
v0.3 on the same endpoint) and HTTP+JSON routes:

- /complete: answers every message with a task that completes, with one artifact.
- /stream:   works through several artifact chunks, a short pause between each, then completes;
             a streaming client sees every update as its own SSE frame.
- /ask:      the first message of a task gets `input-required`; the next one on that task
             completes it.
- /hang:     accepts a message (its task is announced, submitted) and never answers.

Every card advertises the address it is reached at (`--public NAME=URL`), which is the relay's:
a client that follows the card keeps going through the relay.

Usage: python a2a_agents.py --port 0 --public complete=http://127.0.0.1:9001 ...
Prints `listening on <port>` once the server accepts connections.
"""

import argparse
import asyncio
import socket
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from a2a.server.agent_execution.agent_executor import AgentExecutor
from a2a.server.agent_execution.context import RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.server.tasks.task_updater import TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Part,
    Task,
    TaskState,
    TaskStatus,
)

# Pause between the streaming agent's updates: long enough that each leaves the server as a frame
# of its own, short enough for a test.
STREAM_PAUSE = 0.15
STREAM_CHUNKS = ["The relay ", "forwards ", "every ", "frame."]


async def open_task(context: RequestContext, queue: EventQueue) -> TaskUpdater:
    """Announce the task if it is new, and return an updater for it."""
    if context.current_task is None:
        await queue.enqueue_event(
            Task(
                id=context.task_id,
                context_id=context.context_id,
                status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
                history=[context.message],
            )
        )
    return TaskUpdater(
        event_queue=queue, task_id=context.task_id, context_id=context.context_id
    )


class CompletingAgent(AgentExecutor):
    async def execute(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        text = context.get_user_input()
        await updater.add_artifact(parts=[Part(text=f"done: {text}")], name="answer")
        # Usage as agents report it on their answer's metadata (CONTRACT section 2c).
        usage = {"usage": {"inputTokens": 30, "outputTokens": 12}, "model": "gpt-4o"}
        await updater.complete(
            message=updater.new_agent_message(parts=[Part(text="completed")], metadata=usage)
        )

    async def cancel(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        await updater.cancel()


class StreamingAgent(AgentExecutor):
    async def execute(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        await updater.start_work(
            message=updater.new_agent_message(parts=[Part(text="writing")])
        )
        for i, chunk in enumerate(STREAM_CHUNKS):
            await asyncio.sleep(STREAM_PAUSE)
            await updater.add_artifact(
                parts=[Part(text=chunk)],
                artifact_id="report",
                name="report",
                append=i > 0,
                last_chunk=i == len(STREAM_CHUNKS) - 1,
            )
        await updater.complete()

    async def cancel(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        await updater.cancel()


class AskingAgent(AgentExecutor):
    async def execute(self, context: RequestContext, queue: EventQueue) -> None:
        first = context.current_task is None
        updater = await open_task(context, queue)
        if first:
            await updater.requires_input(
                message=updater.new_agent_message(
                    parts=[Part(text="Which city?")]
                )
            )
            return
        city = context.get_user_input()
        await updater.add_artifact(parts=[Part(text=f"booked: {city}")], name="booking")
        await updater.complete()

    async def cancel(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        await updater.cancel()


class HangingAgent(AgentExecutor):
    """Accepts a message (announces its task, submitted) and never answers (the test kills the
    process meanwhile)."""

    async def execute(self, context: RequestContext, queue: EventQueue) -> None:
        await open_task(context, queue)
        await asyncio.sleep(3600)

    async def cancel(self, context: RequestContext, queue: EventQueue) -> None:
        updater = await open_task(context, queue)
        await updater.cancel()


AGENTS = {
    "complete": (CompletingAgent, "Completes every task"),
    "hang": (HangingAgent, "Never answers"),
    "stream": (StreamingAgent, "Streams its answer in chunks"),
    "ask": (AskingAgent, "Asks for input before it completes"),
}


def card(name: str, description: str, public: str) -> AgentCard:
    public = public.rstrip("/")
    interfaces = [
        AgentInterface(
            protocol_binding="JSONRPC", protocol_version="1.0", url=f"{public}/a2a/jsonrpc"
        ),
        AgentInterface(
            protocol_binding="HTTP+JSON", protocol_version="1.0", url=f"{public}/a2a/rest"
        ),
        AgentInterface(
            protocol_binding="JSONRPC", protocol_version="0.3", url=f"{public}/a2a/jsonrpc"
        ),
    ]
    return AgentCard(
        name=f"{name} agent",
        description=description,
        version="1.0.0",
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text"],
        default_output_modes=["text"],
        skills=[
            AgentSkill(id=name, name=name, description=description, tags=["e2e"])
        ],
        supported_interfaces=interfaces,
    )


def app(publics: dict[str, str]) -> Starlette:
    mounts = []
    for name, (executor, description) in AGENTS.items():
        agent_card = card(name, description, publics[name])
        handler = DefaultRequestHandler(
            agent_executor=executor(),
            task_store=InMemoryTaskStore(),
            agent_card=agent_card,
        )
        routes = [
            *create_agent_card_routes(agent_card=agent_card),
            *create_jsonrpc_routes(
                request_handler=handler, rpc_url="/a2a/jsonrpc", enable_v0_3_compat=True
            ),
            *create_rest_routes(request_handler=handler, path_prefix="/a2a/rest"),
        ]
        mounts.append(Mount(f"/{name}", routes=routes))
    return Starlette(routes=mounts)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--public", action="append", default=[], help="NAME=URL the agent's card advertises"
    )
    args = parser.parse_args()
    publics = dict(p.split("=", 1) for p in args.public)
    # Agents without a public address advertise the port they are served on.
    for name in AGENTS:
        publics.setdefault(name, f"http://127.0.0.1:{args.port}/{name}")
    missing = set(AGENTS) - set(publics)
    if missing:
        sys.exit(f"--public missing for {sorted(missing)}")

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    server = uvicorn.Server(
        uvicorn.Config(app(publics), log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    await serving


if __name__ == "__main__":
    asyncio.run(main())
