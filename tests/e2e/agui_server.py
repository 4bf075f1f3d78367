"""An AG-UI agent for the relay's end-to-end test, built from the ag-ui-protocol package's event
types and its EventEncoder (the SSE encoding AG-UI servers use).

POST / takes a RunAgentInput. `forwardedProps.scenario` picks the run:
- "ok" (default): RUN_STARTED, a text message in three deltas, a tool call with its result, a
  state snapshot, RUN_FINISHED.
- "fail": RUN_STARTED, a text message left open, RUN_ERROR (which carries no runId).
- "abandon": RUN_STARTED, a text message and a tool call started, then the stream just ends (no
  end events, no terminal), as when an agent dies mid-run.

Usage: python agui_server.py --port 0   (prints `listening on <port>` when ready)
"""

import argparse
import asyncio
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ag_ui.core import (
    RunAgentInput,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    StateSnapshotEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)
from ag_ui.encoder import EventEncoder

PAUSE = 0.05


def events(run: RunAgentInput, scenario: str):
    thread, run_id = run.thread_id, run.run_id
    yield RunStartedEvent(thread_id=thread, run_id=run_id)
    yield TextMessageStartEvent(message_id="msg-1", role="assistant")
    if scenario == "abandon":
        yield TextMessageContentEvent(message_id="msg-1", delta="Let me check")
        yield ToolCallStartEvent(tool_call_id="call-9", tool_call_name="get_weather")
        return
    if scenario == "fail":
        yield TextMessageContentEvent(message_id="msg-1", delta="Looking that up")
        yield RunErrorEvent(message="the weather service is down", code="upstream")
        return
    for delta in ["It is ", "sunny ", "in Oslo."]:
        yield TextMessageContentEvent(message_id="msg-1", delta=delta)
    yield TextMessageEndEvent(message_id="msg-1")
    yield ToolCallStartEvent(
        tool_call_id="call-1", tool_call_name="get_weather", parent_message_id="msg-1"
    )
    yield ToolCallArgsEvent(tool_call_id="call-1", delta='{"city": "Oslo"}')
    yield ToolCallEndEvent(tool_call_id="call-1")
    yield ToolCallResultEvent(
        message_id="msg-2", tool_call_id="call-1", content='{"sky": "clear"}', role="tool"
    )
    yield StateSnapshotEvent(snapshot={"city": "Oslo", "sky": "clear"})
    # Usage as agents report it in the run's result (CONTRACT section 2c).
    yield RunFinishedEvent(
        thread_id=thread,
        run_id=run_id,
        result={
            "answer": "sunny",
            "model": "gpt-4o",
            "usage": {"inputTokens": 120, "outputTokens": 45},
        },
    )


async def run_agent(request: Request):
    try:
        run = RunAgentInput.model_validate(await request.json())
    except Exception as error:  # noqa: BLE001 - any invalid input is the caller's 422
        return JSONResponse({"error": str(error)}, status_code=422)
    scenario = (run.forwarded_props or {}).get("scenario", "ok")
    encoder = EventEncoder(accept=request.headers.get("accept"))

    async def stream():
        for event in events(run, scenario):
            yield encoder.encode(event)
            await asyncio.sleep(PAUSE)

    return StreamingResponse(stream(), media_type=encoder.get_content_type())


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    app = Starlette(routes=[Route("/", run_agent, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    await serving


if __name__ == "__main__":
    asyncio.run(main())
