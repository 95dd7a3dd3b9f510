"""A property-based fuzz of the running server from its own /openapi.json (schemathesis +
hypothesis), bounded in count and time, on loopback: no response is a 5xx (the catch-all for
unexpected errors answers 500 and would be counted), and the server serves after."""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

import time

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import tiny_target
from test_server import MODEL, serving

CASES_PER_OPERATION = 40
MIN_CASES_PER_OPERATION = 4  # sent whatever the time: a loaded machine draws cases slowly
SECONDS_PER_OPERATION = 0.75  # drawing a chat or messages body takes ~0.1-0.3 s on this CPU


class TimeIsUp(Exception):
    pass


def test_fuzz_from_openapi_gets_no_5xx_and_the_server_serves_after():
    # a 48-token context window bounds every generation, whatever max_tokens a case asks for
    model, tok = tiny_target("llama", seed=4, layer_types=None, sliding_window=None, max_position_embeddings=48)
    with serving(model, random_draft(model, block_size=4), tok) as s:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions",
                                                  "POST /v1/messages", "POST /v1/messages/count_tokens"}
        statuses = []
        http = httpx.Client(timeout=30)
        t0 = time.monotonic()
        for op in operations:
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
            strategy = st.one_of(*(op.as_strategy(m) for m in modes))  # valid bodies and broken ones
            deadline = time.monotonic() + SECONDS_PER_OPERATION

            @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def send(case):
                kwargs = case.as_transport_kwargs(base_url=s.url)
                r = http.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                 params=kwargs.get("params"), json=kwargs.get("json"),
                                 content=kwargs.get("data") if "json" not in kwargs else None)
                statuses.append((op.label, r.status_code, r.text[:300] if r.status_code >= 500 else ""))
                sent = sum(1 for label, _, _ in statuses if label == op.label)
                if time.monotonic() > deadline and sent >= MIN_CASES_PER_OPERATION:
                    raise TimeIsUp  # hypothesis would go on drawing (and paying for) cases it does not send

            try:
                send()
            except TimeIsUp:
                pass
        seconds = time.monotonic() - t0
        server_errors = [x for x in statuses if x[1] >= 500]
        codes = sorted({code for _, code, _ in statuses})
        print(f"fuzz: {len(statuses)} cases over {len(operations)} operations in {seconds:.1f} s, "
              f"{len(server_errors)} with a 5xx; statuses {codes}")
        assert len(statuses) >= MIN_CASES_PER_OPERATION * len(operations), "too few cases to mean anything"
        assert not server_errors, server_errors[:5]
        assert 200 in codes and 400 in codes
        r = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                             max_tokens=3)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(s.url + "/health").json()["failed"] == 0
