"""No DFlash draft: `auto` verifies copies of the context where they pay and plain steps
otherwise, in the library, the batch engine, the server and the CLI; `baseline` stays plain."""

import random

import numpy as np
import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx import stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.copies import NO_DRAFT_MAX_COPY, CopyPolicy, copy_policy_for
from dflash_mlx.policy.sizer import BlockSizer, forget_sizers, sizer_for
from dflash_mlx.speculation.copies import ContextIndex
from dflash_mlx.testing.targets import EOS_ID, chain_target, greedy_reference, tiny_target

TEXT = "Quick-brown,fx"  # chain_target's greedy answer repeats these 14 tokens


def decode(model, tok, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, None, tok, prompt, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


@pytest.fixture(scope="module")
def chain():
    return chain_target(TEXT)


# -- the library --------------------------------------------------------------------------


def test_copies_are_used_without_a_draft_and_never_with_baseline(chain, always_copy):
    """The library's wiring (copies forced wherever a match exists: whether measured costs pick
    them is timing, tested below with set costs); `baseline` never copies, even then."""
    model, tok = chain
    prompt = tok.encode("Quick", add_special_tokens=False)
    ref = greedy_reference(model, prompt, 100)
    forget_sizers()
    out, responses = decode(model, tok, prompt, max_tokens=100, stop_token_ids=[])
    assert out == ref
    counts = responses[-1].proposal_counts
    assert set(counts) <= {"plain", "copy"}
    assert counts["copy"][1] >= 50 and responses[-1].tau > 2.0  # most of the answer from copies
    assert sum(r.proposal == "copy" for r in responses) == counts["copy"][0]
    out, responses = decode(model, tok, prompt, max_tokens=100, stop_token_ids=[], baseline=True)
    assert out == ref and responses[-1].proposal_counts == {"plain": [99, 99]}
    assert all(r.proposal is None and r.verify_width in (None, 1) for r in responses)
    # a fixed width without a draft is plain decoding too
    out, responses = decode(model, tok, prompt, max_tokens=30, stop_token_ids=[], block_size=4)
    assert out == ref[:30] and set(responses[-1].proposal_counts) == {"plain"}


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("repeats", [False, True])
def test_no_draft_auto_is_the_targets_greedy_decode(arch, repeats):
    """Random tiny targets (sliding windows, Gated DeltaNet), prompts with and without
    a repeated span: copies where the policy picks them, the target's own greedy tokens."""
    model, tok = tiny_target(arch, seed=1)
    rng = random.Random(arch)
    span = [rng.randrange(0, 256) for _ in range(12)]
    prompt = span * 3 if repeats else [rng.randrange(0, 256) for _ in range(36)]
    ref = greedy_reference(model, prompt, 40, stop_ids=(EOS_ID,))
    forget_sizers()
    out, _ = decode(model, tok, prompt, max_tokens=40)
    assert out == ref


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_forced_copies_without_a_draft_roll_back_exactly(always_copy, arch):
    """Every cycle verifies a copy (mostly rejected on a random target): every rollback path."""
    model, tok = tiny_target(arch, seed=2)
    prompt = random.Random(0).sample(range(256), 256)  # every byte token once: a match every cycle
    ref = greedy_reference(model, prompt, 30, stop_ids=(EOS_ID,))
    out, responses = decode(model, tok, prompt, max_tokens=30)
    assert out == ref
    copies = [r.accept_lengths[-1] for r in responses[1:] if r.proposal == "copy"]
    assert len(copies) >= 3 and min(copies) < 15  # copies, and some rejected part of the way



def test_copies_without_a_draft_keep_the_targets_distribution(always_copy):
    """At temperature > 0 a copy is a one-hot proposal under the rejection step: the first
    three tokens follow the target's own joint distribution (chi-square, vocabulary 4)."""
    from test_sampling import chi_square, encode, exact_first_tokens

    model, tok = tiny_target("llama", seed=1, vocab_size=4)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1]  # the suffix occurred before: copies from the first cycle
    outs, kinds = [], set()
    for seed in range(200):
        rs = list(stream_generate(model, None, tok, prompt, max_tokens=3, seed=seed, temperature=0.8,
                                  stop_token_ids=[]))
        outs.append([t for r in rs for t in r.tokens][:3])
        kinds |= {r.proposal for r in rs[1:]}
    assert "copy" in kinds and kinds <= {"copy", None}  # None: the last token alone, a plain step
    _, pval = chi_square(encode(np.array(outs), 4), exact_first_tokens(model, prompt, 3, temperature=0.8))
    assert pval > 1e-3


# -- the policy -----------------------------------------------------------------------------


def test_without_a_draft_copies_are_priced_against_a_plain_step():
    """A width-1 sizer: nothing is copied before plain steps are timed; copy widths are then
    explored by doubling from the widest trusted width, timed in the sizer's own table, and a
    copy runs where its expected tokens per second beat a plain step's, never where it fails."""
    sizer = BlockSizer(1)
    policy = CopyPolicy(sizer, max_length=NO_DRAFT_MAX_COPY)
    good = ContextIndex(list(range(20)) * 2).match(15)
    assert policy.choose(good, 100, sizer.choose(100)) == 0  # no plain step timed yet
    for _ in range(3):
        assert sizer.choose(100) == 1
        sizer.update(1, 0, 1.0)
    cost = lambda n: 1.0 + 0.02 * n  # noqa: E731  (a verify of n more rows, in plain-step units)
    tried = []
    for _ in range(12):
        n = policy.choose(good, 100, sizer.choose(100))
        tried.append(n)
        policy.update(good.length, n, n, cost(n))  # always right
    # first the shortest copy (priced at a plain step's time), then longer ones as times say
    assert tried[0] == 1 and sorted(tried) == tried and tried[-1] == 15, tried
    assert set(sizer.times) >= {1, 2, 16}  # copies timed the sizer's own widths
    bad = ContextIndex([1, 2, 3, 4, 9, 9, 4]).match(15)
    for _ in range(20):
        policy.update(bad.length, 4, 0, cost(4))
    assert policy.choose(bad, 100, 1) == 0
    assert policy.choose(good, 1, 1) == 0  # one token left: nothing to copy into


def test_the_no_draft_policy_belongs_to_the_model():
    model, _ = chain_target(TEXT)
    forget_sizers()
    sizer = sizer_for(model, None)
    assert sizer.max_block == 1 and sizer_for(model, None) is sizer
    assert copy_policy_for(sizer).max_length == NO_DRAFT_MAX_COPY


# -- the batch engine ---------------------------------------------------------------------


def test_batched_rows_without_a_draft_copy_and_stay_exact(chain):
    """Three rows decode together: rows with a match copy, a row without one verifies its last
    token repeated in the same forward; every row is the target's greedy decode."""
    model, tok = chain
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("Quick-brown,fxQuick", "b", "own,")]
    forget_sizers()
    engine = BatchEngine(model, None, tok, max_batch=3)
    rows = [engine.add(BatchRequest(p, GenerationOptions(max_tokens=60))) for p in prompts]
    out = {r.uid: [] for r in rows}
    batched_copies = 0
    while not engine.idle:
        batch = len(engine.rows)
        for row, r in engine.step():
            out[row.uid] += r.tokens
            batched_copies += batch > 1 and r.proposal == "copy"
    for row, p in zip(rows, prompts):
        assert out[row.uid] == greedy_reference(model, p, 60)
    assert batched_copies >= 5
    wide = {w for bucket, ws in engine.stats()["widths"].items() if bucket != "1" for w in ws}
    assert max(int(w) for w in wide) > 1


# -- the server and the CLI ------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 4])
def test_server_without_a_draft_copies_and_baseline_stays_plain(chain, max_batch, always_copy):
    """The server's wiring: without a draft it copies (forced wherever a match exists: whether
    measured costs pick copies is timing, tested above with set costs); `baseline` never does."""
    from test_server import serving

    model, tok = chain
    prompt = tok.encode("Quick", add_special_tokens=False)
    ref = greedy_reference(model, prompt, 60)
    forget_sizers()
    for baseline in (False, True):
        with serving(model, None, tok, max_batch=max_batch, baseline=baseline) as s:
            r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0)
            assert tok.encode(r.choices[0].text, add_special_tokens=False) == ref
            proposals = r.usage.dflash["proposals"]
            if baseline:
                assert set(proposals) == {"plain"} and s.worker.health()["global_copies"] is None
            else:
                assert proposals["copy"][1] >= 30, proposals


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    from gguf_helpers import write_tiny_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    return tmp_path / "tiny.gguf"


def test_cli_without_a_draft_says_so_and_decodes_with_copies(tiny_gguf, capsys):
    import json

    from dflash_mlx.cli.main import main

    assert main(["--model", str(tiny_gguf), "--max-tokens", "12", "--json", "hello hello hello"]) == 0
    out, err = capsys.readouterr()
    assert f"no DFlash draft for '{tiny_gguf}': copies of the context are on" in err
    assert json.loads(out)["draft"] is None
    assert main(["--model", str(tiny_gguf), "--max-tokens", "12", "--json", "--baseline", "hello"]) == 0
    out, err = capsys.readouterr()
    assert "no DFlash draft" not in err and set(json.loads(out)["proposals"]) <= {"plain"}
