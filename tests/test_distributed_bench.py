"""What benchmarks/distributed_bench.py's numbers rest on, without a launch: its scripted draft
commits the target's own greedy tokens and accepts exactly the run it drew each cycle; the
collective counter's bytes; the delaying relay keeps order and holds chunks back."""

import socket
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import distributed_bench as bench  # noqa: E402

from dflash_mlx import stream_generate  # noqa: E402
from dflash_mlx.models.draft.checkpoints import random_draft  # noqa: E402
from dflash_mlx.testing.targets import VOCAB, clean_case, tiny_target  # noqa: E402


def test_scripted_draft_is_exact_and_accepts_what_it_drew():
    model, tok = tiny_target("llama", seed=1)
    prompt, ref = clean_case(model, 9, 30, seed=5)
    draft = bench.MeasuredDraft(random_draft(model, num_layers=1, block_size=8, seed=3), [0, 1, 2, 5, 9], VOCAB)
    draft.start(prompt + ref, seed=4)
    tokens, accepts = [], []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=30, block_size=8, stop_token_ids=[],
                             copy_proposals=False, token_trees=False):
        tokens += r.tokens
        accepts = list(r.accept_lengths)
    assert tokens == ref
    assert len(set(draft.drawn)) > 2 and len(accepts) == len(draft.drawn)
    # every cycle but the last (cut by the token budget) accepts min(drawn, width - 1)
    assert accepts[:-1] == [min(k, 7) for k in draft.drawn[:-1]]


def test_collectives_are_counted_with_the_ring_backends_bytes():
    counter = bench.Collectives(2).install()
    try:
        x = mx.ones((3, 576), mx.float32)
        mx.eval(mx.distributed.all_sum(x), mx.distributed.all_gather(x), mx.distributed.all_sum(mx.array(1.0)))
    finally:
        counter.remove()
    assert counter.calls == {"all_sum": 2, "all_gather": 1}
    # all_sum over 2 ranks sends half the array twice (reduce, gather), a scalar padded to 2 elements
    assert counter.sent["all_sum"] == 3 * 576 * 4 + 2 * 4 and counter.sent["all_gather"] == 3 * 576 * 4
    mx.eval(mx.distributed.all_sum(x))  # removed: nothing counted any more
    assert counter.calls["all_sum"] == 2


def test_relay_keeps_order_and_holds_chunks_back():
    relay = bench.DelayRelay()
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(1)
    port = relay.relay(upstream.getsockname()[1])
    bench.set_delay(relay.control, 40)
    client = socket.create_connection(("127.0.0.1", port))
    server, _ = upstream.accept()
    t = time.perf_counter()
    for part in (b"one ", b"two ", b"three"):
        client.sendall(part)
    got = b""
    while len(got) < 13:
        got += server.recv(64)
    assert got == b"one two three" and time.perf_counter() - t >= 0.04
    server.sendall(b"back")  # and the other way
    assert client.recv(64) == b"back"
    for s in (client, server, upstream):
        s.close()
