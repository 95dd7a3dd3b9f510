"""Requests fed to a `BatchEngine` the way a server feeds them: one joining every few steps while
there is room, each stepped until it ends (`tests/test_batch.py`, `testing.option_fuzz`)."""

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
