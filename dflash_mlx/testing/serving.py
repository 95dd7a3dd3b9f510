"""Requests fed to a `BatchEngine` the way a server feeds them: one joining every few steps while
there is room, each stepped until it ends (`tests/test_batch.py`, `testing.option_fuzz`); and a
`serve.worker.Worker` behind the HTTP app on a free port of this process (`http_server`: the server
tests, `benchmarks/server_exactness.py`)."""

import contextlib
from typing import Dict, List, Optional, Tuple


def serve(engine, requests: List, join_every: int = 1, cancel: Optional[Dict[int, int]] = None,
          max_steps: int = 100_000) -> Tuple[Dict[int, List[int]], Dict[int, list], Dict[int, object]]:
    """Each request's tokens, responses and prompt cache (`Row.state`, which a next turn reuses).
    `cancel`: {request index: after how many responses to cancel it}. A scripted draft that
    tells rows apart (`RowScriptedDrafts`) has each row registered as it joins."""
    waiting = list(range(len(requests)))
    index, tokens, responses, states = {}, {}, {}, {}
    steps = 0
    while waiting or not engine.idle:
        if waiting and engine.room and steps % join_every == 0:
            i = waiting.pop(0)
            row = engine.add(requests[i])
            if hasattr(engine.draft, "register"):
                engine.draft.register(row.state, requests[i].prompt_ids)
            index[row.uid], tokens[i], responses[i], states[i] = i, [], [], row.state
        for row, r in engine.step():
            i = index[row.uid]
            tokens[i] += r.tokens
            responses[i].append(r)
            if cancel and cancel.get(i) == len(responses[i]):
                engine.remove(row)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"the engine did not finish its {len(requests)} requests in {max_steps} steps")
    return tokens, responses, states


@contextlib.contextmanager
def http_server(worker, start_within: float = 20.0):
    """`worker` (`serve.worker.Worker`) behind the server's app on a free loopback port, in a thread of
    this process: yields its URL; on leaving, the server and the worker's engine thread stop."""
    import socket
    import threading
    import time

    import uvicorn

    from dflash_mlx.serve.app import create_app

    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without it each
    # keep-alive response's body waits ~40 ms behind its headers (Nagle against the client's delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(worker), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + start_within
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "server did not stop"
        assert not worker._thread.is_alive(), "engine worker did not stop"
