"""Depth in the training recipe: sliding-window drafts from the CLI, deep records labelled by
the target's own argmax (chunked target pass), anchors inside answers, starting from an export."""

import json
from types import SimpleNamespace

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.models.draft.checkpoints import load_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train import cli, options
from dflash_mlx.train.depth_data import chain
from dflash_mlx.train.depth_labels import agreement, label, label_shared
from dflash_mlx.train.features import FeatureSource, labels_file, target_pass
from dflash_mlx.train.batch import make_batch


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama")


def _flags(**kw):
    return SimpleNamespace(**({"sliding_window": None, "layer_types": None, "block_causal": False} | kw))


def test_attention_flags_pin_is_causal_and_check_their_values():
    assert options.attention_overrides(_flags(), 2) == {}
    o = options.attention_overrides(_flags(sliding_window=64), 2)
    assert o == {"layer_types": ["sliding_attention"] * 2, "sliding_window": 64, "is_causal": False}
    o = options.attention_overrides(_flags(sliding_window=64, layer_types="full,sliding", block_causal=True), 2)
    assert o["layer_types"] == ["full_attention", "sliding_attention"] and o["is_causal"] is True
    with pytest.raises(SystemExit, match="give --sliding-window"):
        options.attention_overrides(_flags(layer_types="sliding"), 2)
    with pytest.raises(SystemExit, match="names 3 layers but the draft has 2"):
        options.attention_overrides(_flags(sliding_window=8, layer_types="full,sliding,full"), 2)
    with pytest.raises(SystemExit, match="full or sliding"):
        options.attention_overrides(_flags(sliding_window=8, layer_types="local"), 2)


def test_chunked_target_pass_equals_one_forward_and_gives_the_argmax(tiny):
    model, _ = tiny
    target = Target(model)
    seq = np.random.default_rng(0).integers(0, 256, 70).tolist()
    f, lab = target_pass(target, seq, [0, 1], chunk=16)
    h, ref, _ = target.forward(mx.array([seq]), None, [0, 1])
    np.testing.assert_allclose(f.astype(np.float32), np.array(ref[0].astype(mx.float16)).astype(np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(lab, np.array(mx.argmax(target.logits(h[0]), axis=-1)))


def test_deep_records_anchor_inside_spans_and_train_on_the_targets_argmax(tiny):
    model, _ = tiny
    target = Target(model)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 256, 60).tolist()
    rec = {"id": "chat:train:0", "prompt": seq[:5], "response": seq[5:], "spans": [[20, 30], [45, 55]],
           "target_labels": True}
    src = FeatureSource(target, [0, 1])
    argmax = src.labels(rec)
    assert argmax.shape == (59,)
    batch = make_batch([rec], src, np.random.default_rng(2), 4, 8, 300, np.arange(300), 512,
                       target_labels=src.labels)
    anchors = np.array(batch.anchors[0])
    assert all(20 <= a < 30 or 45 <= a < 55 for a in anchors)
    pos = anchors[:, None] + np.arange(1, 4)[None]
    np.testing.assert_array_equal(np.array(batch.labels[0]), argmax[pos - 1])  # not the text's tokens
    hit = agreement(rec, argmax)
    inside = np.concatenate([np.arange(19, 29), np.arange(44, 54)])
    assert hit["inside"] == (int((argmax[inside] == np.array(seq)[inside + 1]).sum()), 20)
    with pytest.raises(ValueError, match="pass target_labels"):
        make_batch([rec], src, np.random.default_rng(2), 4, 8, 300, np.arange(300), 512)


def test_answers_to_one_document_share_its_target_pass_and_match_their_own_passes(tiny, tmp_path):
    model, _ = tiny
    target = Target(model)
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 256, 90).tolist()
    recs = []
    for i, (p, tail) in enumerate([(70, 9), (30, 7), (50, 12)]):  # unsorted on purpose
        ids = doc[:p] + rng.integers(0, 256, 5).tolist()  # the question after the cut
        answer = rng.integers(0, 256, tail).tolist()
        recs.append({"id": f"answer:d:{p}:{i}", "prompt": ids, "response": answer, "spans": [[len(ids), len(ids) + tail]],
                     "target_labels": True, "prefix_group": "d", "prefix_len": p, "split": "train"})
    feats = tmp_path / "run" / "features"
    assert label_shared(target, recs, [0, 1], feats)
    shared = FeatureSource(target, [0, 1], feats)  # reads what label_shared wrote
    for r in recs:
        seq = r["prompt"] + r["response"][:-1]
        f, lab = target_pass(target, seq, [0, 1], chunk=16)
        got = shared(r)
        assert got.shape == f.shape
        np.testing.assert_allclose(got.astype(np.float32), f.astype(np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(shared.labels(r), lab)
    # a record whose prefix is not the document's is refused, not silently mislabelled
    bad = dict(recs[0], id="answer:d:bad", prompt=[(t + 1) % 256 for t in recs[0]["prompt"]])
    with pytest.raises(ValueError, match="not the document prefix"):
        label_shared(target, [recs[2], bad], [0, 1], tmp_path / "bad" / "features")
    # label() takes the shared pass for grouped records and reports their agreement by split
    via = tmp_path / "via-label" / "features"
    stats = label(target, recs, [0, 1], via, log=lambda s: None)
    assert stats["answer:train:inside"]["positions"] == 9 + 7 + 12
    assert all(labels_file(via, r["id"]).exists() for r in recs)


def test_answered_documents_are_the_targets_greedy_answers_and_anchor_in_them(tmp_path):
    from dflash_mlx.bench.documents import TRAIN_DOCUMENTS, document_prompt, read_documents
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing.targets import greedy_reference
    from dflash_mlx.train.depth_data import answer_documents, answer_plan, answered_records

    docs, missing = read_documents(TRAIN_DOCUMENTS)
    if len(docs) < 2:
        pytest.skip(f"training documents not on this machine: {missing}")
    model, tok = tiny_target("qwen3", seed=3)
    draft = random_draft(model, block_size=4)
    plan = answer_plan(docs[:2], tok, [120, 90, 10 ** 6], context=200, max_tokens=7)
    # a cut past the window is clamped to it (the answer must fit); one past the document is dropped
    assert sorted({p["tokens"] for p in plan}) == [90, 120, 200 - 7 - 8]
    assert len({p["id"] for p in plan}) == len(plan) == 6
    assert answer_plan(docs[:1], tok, [10 ** 6], context=10 ** 7, max_tokens=7) == []
    assert {p["question"] for p in plan if p["document"] == docs[0].name} == {0, 1, 2}
    out = tmp_path / "answers.jsonl"
    assert answer_documents(model, draft, tok, plan[:3], 7, out, log=lambda s: None) == 3
    assert answer_documents(model, draft, tok, plan[:4], 7, out, log=lambda s: None) == 1  # resumes
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    for a in answers:
        d = next(x for x in docs if x.name == a["document"])
        ids = document_prompt(tok, d, a["tokens"], a["question"])
        assert a["response"] == greedy_reference(model, ids, 7)  # the target's own greedy answer
    recs = answered_records(answers, tok)["train"]
    assert len(recs) == 4
    for r, a in zip(recs, answers):
        assert len(r["prompt"]) == a["tokens"] and r["response"] == a["response"]
        assert r["spans"] == [[a["tokens"], a["tokens"] + 7]]
        assert r["prefix_len"] < a["tokens"] and r["prefix_group"] == a["document"]
    stats = label(Target(model), recs, [0, 1], tmp_path / "run" / "features", log=lambda s: None)
    assert stats["answer:train:inside"]["rate"] == 1.0  # greedy answers: argmax agrees everywhere


def test_chain_joins_answers_with_the_templates_turn_break():
    head, between, eos = [1, 2], [9, 7, 8], 9  # between starts with the answer's own end token
    recs = [{"id": "a", "prompt": [1, 2, 30, 31], "response": [40, 41, 9]},
            {"id": "b", "prompt": [1, 2, 32], "response": [42, 9]}]
    ids, spans = chain(recs, head, between, eos)
    assert ids == [1, 2, 30, 31, 40, 41, 9, 7, 8, 32, 42, 9]
    assert spans == [[4, 7], [10, 12]]
    with pytest.raises(ValueError, match="does not start with"):
        chain([{"id": "c", "prompt": [5, 30], "response": [9]}], head, between, eos)


def test_train_cli_sliding_window_then_init_from_its_export_with_deep_records(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    base = ["--target", "tiny", "--gsm8k", "4", "--sharegpt", "0", "--max-new-tokens", "10",
            "--max-prompt-tokens", "400", "--gen-batch", "4", "--layers", "2", "--block-size", "4",
            "--draft-vocab", "100", "--steps", "2", "--batch-tokens", "32", "--blocks-per-seq", "4",
            "--eval-every", "2", "--tau-prompts", "0"]
    out = tmp_path / "win"
    assert cli.main(base + ["--out", str(out), "--sliding-window", "8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 8
    assert cfg["is_causal"] is False  # pinned: loaders would make sliding layers block-causal
    assert load_draft(out, model).layers[0].self_attn.window == 8

    # a new run from that export: a mix of full and sliding layers, deep records beside the short ones
    run = tmp_path / "mix.run"
    run.mkdir()
    (run / "responses.jsonl").write_text((tmp_path / "win.run" / "responses.jsonl").read_text())
    rng = np.random.default_rng(3)
    deep = [{"id": f"chat:{s}:{i}", "prompt": [1, 2, 3], "response": rng.integers(0, 256, 90).tolist(),
             "spans": [[10, 40], [60, 90]], "target_labels": True} for s, i in (("train", 0), ("eval", 0))]
    (run / "depth-train.jsonl").write_text(json.dumps(deep[0]) + "\n")
    (run / "depth-eval.jsonl").write_text(json.dumps(deep[1]) + "\n")
    args = base + ["--out", str(tmp_path / "mix"), "--run-dir", str(run), "--skip-gen", "--init-from", str(out),
                   "--layer-types", "full,sliding", "--sliding-window", "16", "--depth-data", str(run),
                   "--depth-repeat", "3", "--max-seq-len", "128", "--lr", "1e-4"]
    assert cli.main(args) == 0
    log = (run / "train.log").read_text()
    assert "starting from exported draft" in log and "depth eval step 2" in log
    cfg = json.loads((tmp_path / "mix" / "config.json").read_text())
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"] and cfg["sliding_window"] == 16
    assert cfg["is_causal"] is False
    assert labels_file(run / "features", "chat:train:0").exists()  # the argmax, cached beside the features
    src, mixed = load_draft(out, model), load_draft(tmp_path / "mix", model)
    np.testing.assert_array_equal(np.array(src.vocab_ids), np.array(mixed.vocab_ids))


def test_overfit_check_from_an_export_on_deep_records(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    base = ["--target", "tiny", "--gsm8k", "4", "--sharegpt", "0", "--max-new-tokens", "10",
            "--max-prompt-tokens", "400", "--gen-batch", "4", "--layers", "1", "--block-size", "4",
            "--draft-vocab", "100", "--batch-tokens", "32", "--blocks-per-seq", "4", "--tau-prompts", "0"]
    assert cli.main(base + ["--out", str(tmp_path / "d"), "--steps", "1"]) == 0
    run = tmp_path / "d.run"
    rng = np.random.default_rng(4)
    deep = {"id": "chat:train:0", "prompt": [1, 2], "response": rng.integers(0, 256, 60).tolist(),
            "spans": [[5, 60]], "target_labels": True}
    (run / "depth-train.jsonl").write_text(json.dumps(deep) + "\n")
    logs = []
    monkeypatch.setattr(cli.sys, "stderr", type("W", (), {"write": lambda self, s: logs.append(s),
                                                          "flush": lambda self: None})())
    assert cli.main(base + ["--out", str(tmp_path / "o"), "--run-dir", str(run), "--skip-gen", "--init-from",
                            str(tmp_path / "d"), "--depth-data", str(run), "--overfit", "1", "--steps", "30",
                            "--lr", "3e-3"]) == 0
    report = "".join(logs)
    assert "overfit check: 1 sequences, 30 steps" in report
    before, after = (float(x) for x in report.split("top-1 ")[1].split()[0:3:2])
    assert after > before + 0.1  # the long-context path learns (0.08 -> 0.25 measured)
