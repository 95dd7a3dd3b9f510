"""A model object shared with other threads while the engine decodes on it: a caller's own forward
(mlx-lm's decode, another engine) runs through none of the engine's stand-ins, and the engine's
tapes, taps and records hold its own forward's values alone (`models.target.stand_ins`).

The soak of `benchmarks/server_exactness.py` once decoded mlx-lm's references on the served model in
client threads: a reference's forward, run while a batched Gated DeltaNet verify was being built,
went through its taped mixers and put its tape in the verify's record; the rollback then wrote that
state into the batch's rows, and two answers crossed (`benchmarks/results/20261205-server-exactness`)."""

import sys
import threading
from functools import lru_cache

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import pytest

from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.testing.foreign import foreign_forwards, plain_logits
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import RowScriptedDrafts, byte_tokenizer, clean_case, greedy_reference, tiny_target

FOREIGN_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@lru_cache(maxsize=None)
def model_of(arch: str):
    if arch == "llama":
        return tiny_target("llama", seed=2, layer_types=None, sliding_window=None)[0]
    return tiny_target(arch, seed=1)[0]


def cases(model, n: int):
    return [clean_case(model, 20 + 3 * i, 24, seed=i) for i in range(n)]


def engine_of(model, cs, max_batch: int, block_size=8):
    forget_sizers()
    draft = RowScriptedDrafts(Target(model), cs, lambda c: 3, block_size=8)
    return BatchEngine(model, draft, byte_tokenizer(), max_batch=max_batch, prefill_chunk=64, block_size=block_size)


def requests(cs):
    return [BatchRequest(p, GenerationOptions(max_tokens=len(ref))) for p, ref in cs]


class Intruder:
    """Stands in for the first layer's MLP (the test's own, put back after): whenever the engine's
    thread runs it inside a verify (several tokens a row), another thread runs a plain forward of the
    same model and is waited for, as a caller's thread may run at that very moment."""

    def __init__(self, model):
        self.model, self.layer = model, model.layers[0]
        self.mlp, self.owner, self.foreign = self.layer.mlp, threading.get_ident(), []

    def __call__(self, x):
        if threading.get_ident() == self.owner and x.shape[1] > 1:
            thread = threading.Thread(target=self.foreign_forward)
            thread.start()
            thread.join()
        return self.mlp(x)

    def foreign_forward(self):
        self.foreign.append(plain_logits(self.model, FOREIGN_PROMPT))
        mx.clear_streams()  # (MLX's streams of a thread go before it ends, else the exit may abort)

    def __enter__(self):
        self.layer.mlp = self
        return self

    def __exit__(self, *exc):
        self.layer.mlp = self.mlp


@pytest.mark.parametrize("arch, rows", [("qwen3_5", 2), ("qwen3_5", 1), ("llama", 2), ("llama", 1)])
def test_a_forward_on_another_thread_mid_verify_leaves_both_exact(arch, rows):
    """A Gated DeltaNet hybrid (taped mixers, per-row replays) and an attention target (layer taps),
    batched and alone: every row is mlx-lm's greedy decode, and every foreign forward gives the logits
    it gives with nothing else running."""
    model = model_of(arch)
    cs = cases(model, rows)
    clean = plain_logits(model, FOREIGN_PROMPT)
    with Intruder(model) as intruder:
        tokens, _, _ = serve(engine_of(model, cs, max_batch=rows), requests(cs))
    assert len(intruder.foreign) >= 3
    for i, (_, ref) in enumerate(cs):
        assert tokens[i] == ref, i
    for out in intruder.foreign:
        assert mx.array_equal(out, clean).item()


@pytest.fixture
def switch_often():
    """Python threads switch every 10 us, so two threads' forwards interleave while their graphs are built."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def test_two_engines_and_mlx_lm_on_one_model_in_three_threads(switch_often):
    """Two batched engines on one Gated DeltaNet hybrid, each on a thread of its own, beside mlx-lm's
    greedy decode on a third: every answer of each is mlx-lm's alone."""
    model = model_of("qwen3_5")
    cs = cases(model, 4)
    got, errors = {}, []

    def run(name, work):
        try:
            got[name] = work()
        except Exception as e:  # (a thread's failure is the test's)
            errors.append((name, e))
        finally:
            mx.clear_streams()

    works = {
        "engine a": lambda: serve(engine_of(model, cs[:2], max_batch=2), requests(cs[:2]))[0],
        "engine b": lambda: serve(engine_of(model, cs[2:], max_batch=2), requests(cs[2:]))[0],
        "mlx-lm": lambda: [greedy_reference(model, p, len(ref)) for p, ref in cs],
    }
    threads = [threading.Thread(target=run, args=item) for item in works.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got["engine a"][i] for i in range(2)] == [ref for _, ref in cs[:2]]
    assert [got["engine b"][i] for i in range(2)] == [ref for _, ref in cs[2:]]
    assert got["mlx-lm"] == [ref for _, ref in cs]


def test_the_fuzz_instrument_sees_a_forward_that_goes_wrong():
    """`testing.foreign.foreign_forwards` (the option fuzz's foreign thread) counts forwards whose logits
    differ: a module swapped in for everyone (not a stand-in) while it runs is seen."""
    model = model_of("llama")
    layer = model.layers[0]
    mlp = layer.mlp
    with foreign_forwards(model, FOREIGN_PROMPT) as tally:
        layer.mlp = lambda x: 2 * mlp(x)  # (a plain swap: every thread goes through it)
        swapped_at = tally.forwards
        while tally.forwards < swapped_at + 3:
            threading.Event().wait(0.01)
        layer.mlp = mlp
    assert tally.wrong > 0 and "gave other logits" in tally.fault()
    with foreign_forwards(model, FOREIGN_PROMPT, on=False) as off:
        pass
    assert off.forwards == 0 and not off.fault()


def test_a_target_made_while_another_thread_decodes_on_the_model(switch_often):
    """`Target(model)` reads the model's modules while another thread's engine swaps its stand-ins in and
    out: it waits for them (`stand_ins.unswapped`), and reads by key through any it meets."""
    model = model_of("qwen3_5")
    cs = cases(model, 2)
    stop, errors = threading.Event(), []

    def decode():
        try:
            while not stop.is_set():
                serve(engine_of(model, cs, max_batch=2), requests(cs))
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=decode)
    thread.start()
    try:
        for _ in range(60):
            try:
                assert Target(model).recurrent
            except Exception as e:  # (gathered: the thread is stopped before the test fails)
                errors.append(repr(e))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
