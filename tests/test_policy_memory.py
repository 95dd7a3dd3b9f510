"""`policy.memory`: what `auto` learned about a target/draft pair is saved after an answer and read back by
the next process's first one (the CLI, the chat app), for that pair on that machine only, and never changes
a token."""

import json
import os
import pickle

import pytest

from dflash_mlx.policy import lookahead, memory, sizer


@pytest.fixture
def pair(tmp_path_factory):
    from gguf_helpers import write_tiny_gguf

    from dflash_mlx.models.draft.checkpoints import random_draft, save_draft

    d = tmp_path_factory.mktemp("memory")
    model = write_tiny_gguf(d / "tiny.gguf", "llama")
    save_draft(random_draft(model, num_layers=1, block_size=4, seed=1), d / "draft")
    save_draft(random_draft(model, num_layers=1, block_size=4, seed=2), d / "other_draft")
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    where = tmp_path / "policies"
    monkeypatch.setenv(memory.ENV_VAR, str(where))
    yield where
    sizer.forget_sizers()
    lookahead.forget_lookaheads()


def _new_process():
    """What a new process starts with: no policy learned."""
    sizer.forget_sizers()
    lookahead.forget_lookaheads()


def _cli(capsys, *argv):
    from dflash_mlx.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if code == 0 else None


def test_the_cli_starts_where_the_last_run_stopped(pair, cache, capsys, monkeypatch):
    args = ("--model", str(pair / "tiny.gguf"), "--draft", str(pair / "draft"), "--max-tokens", "24", "--json",
            "--no-chat-template", "one two three one two three")
    _new_process()
    code, first = _cli(capsys, *args)
    assert code == 0 and len(list(cache.glob("*.pkl"))) == 1
    learned = {}
    real_restore = memory.restore

    def spying(model, draft):
        found = real_restore(model, draft)
        learned["found"] = found
        learned["cycles"] = sizer.sizer_for(model, draft).cycle
        learned["key"] = (model, draft)
        return found

    monkeypatch.setattr(memory, "restore", spying)
    _new_process()
    code, second = _cli(capsys, *args)
    # the second process began with the first one's cycles counted, and gave the same tokens
    assert code == 0 and learned["found"] and learned["cycles"] >= _sized(first) - 1
    assert second["tokens"] == first["tokens"]
    model, draft = learned["key"]
    assert sizer.sizer_for(model, draft).cycle >= learned["cycles"] + _sized(second) - 1


def _sized(answer) -> int:
    """The cycles of a `--json` answer that the width policy counts (a copy's go to the copy policy, and
    whether a cycle copies depends on measured times: it counted all cycles once and failed under load)."""
    return sum(n for kind, (n, _) in answer["proposals"].items() if kind not in ("copy", "global_copy", "copy_tree"))


def test_nothing_is_kept_when_turned_off_or_for_plain_decoding(pair, cache, capsys, monkeypatch):
    base = ("--model", str(pair / "tiny.gguf"), "--draft", str(pair / "draft"), "--max-tokens", "8", "--json", "hi")
    _new_process()
    assert _cli(capsys, *base, "--baseline")[0] == 0
    assert not cache.exists()
    monkeypatch.setenv(memory.ENV_VAR, "0")
    _new_process()
    assert _cli(capsys, *base)[0] == 0
    assert memory.folder() is None and not cache.exists()


def _loaded(pair, draft_name):
    from dflash_mlx import load, load_draft

    model = load(str(pair / "tiny.gguf"), quiet=True)[0]
    return model, load_draft(str(pair / draft_name), model, quiet=True)


def test_another_draft_or_no_draft_is_another_pair(pair, cache):
    model, draft = _loaded(pair, "draft")
    other = _loaded(pair, "other_draft")[1]
    keys = {memory.pair_key(model, draft), memory.pair_key(model, other), memory.pair_key(model, None)}
    assert len(keys) == 3 and memory.pair_key(model, draft) == memory.pair_key(*_loaded(pair, "draft"))
    sizer.sizer_for(model, draft).cycle = 7
    assert memory.save(model, draft)
    _new_process()
    assert not memory.restore(model, other)  # no file of its own
    assert memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle == 7
    # a pair that has learned in this process keeps its own
    sizer.sizer_for(model, draft).cycle = 9
    assert not memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle == 9


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_broken_or_hostile_file_is_ignored_and_replaced(pair, cache, tmp_path):
    model, draft = _loaded(pair, "draft")
    path = cache / f"{memory.pair_key(model, draft)}.pkl"
    cache.mkdir(parents=True)
    for content in (b"", b"not a pickle", pickle.dumps({"a": 1}), pickle.dumps((1, 2))):
        path.write_bytes(content)
        assert not memory.restore(model, draft) and not sizer.has_sizer(model, draft)
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps((_Hostile(marker), lookahead.LookAhead())))
    assert not memory.restore(model, draft) and not marker.exists()
    sizer.sizer_for(model, draft).cycle = 3
    assert memory.save(model, draft)
    _new_process()
    assert memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle == 3
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left


def test_an_unwritable_folder_is_not_an_error(pair, tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(memory.ENV_VAR, str(blocker / "policies"))
    model, draft = _loaded(pair, "draft")
    sizer.sizer_for(model, draft)
    try:
        assert not memory.save(model, draft) and not memory.restore(model, draft)
    finally:
        _new_process()


def test_the_chat_app_reads_them_before_its_first_answer_and_saves_after_each(cache):
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing import targets
    from dflash_mlx.tui.session import ChatSession, Settings

    model, tok = targets.tiny_target("qwen3", seed=0)
    draft = random_draft(model, num_layers=1, block_size=4, seed=3)
    _new_process()
    first = ChatSession(model, tok, draft, Settings(max_tokens=12)).turn("hi hi hi", lambda t, n: None, lambda: False)
    saved = sizer.sizer_for(model, draft).cycle
    _new_process()
    assert memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle == saved
    sizer.sizer_for(model, draft).cycle = 1000  # a mark: the next process's session must start from it
    assert memory.save(model, draft)
    _new_process()
    session = ChatSession(model, tok, draft, Settings(max_tokens=12))
    again = session.turn("hi hi hi", lambda t, n: None, lambda: False)
    assert again.tokens == first.tokens and sizer.sizer_for(model, draft).cycle >= 1000
    sizer.sizer_for(model, draft).cycle = 2000
    session.turn("and again", lambda t, n: None, lambda: False)  # saved after each turn
    _new_process()
    assert memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle >= 2000


def test_the_server_starts_from_them_and_saves_them_when_it_stops(pair, cache):
    from dflash_mlx.serve.cli import build_parser, keep_policies, load_worker

    model, draft = _loaded(pair, "draft")
    sizer.sizer_for(model, draft).cycle = 500  # a mark: what an earlier process learned
    assert memory.save(model, draft)
    _new_process()
    args = build_parser().parse_args(["--model", str(pair / "tiny.gguf"), "--draft", str(pair / "draft")])
    worker = load_worker(args, speaks=False)
    try:
        assert sizer.sizer_for(worker.model, worker.draft).cycle == 500  # its engine's policies began there
        sizer.sizer_for(worker.model, worker.draft).cycle = 600
    finally:
        assert keep_policies(worker) and worker.stopped()
    _new_process()
    assert memory.restore(model, draft) and sizer.sizer_for(model, draft).cycle == 600
    sizer.sizer_for(model, None).cycle = 5  # the target alone has a file of its own too
    assert memory.save(model, None)
    _new_process()
    plain = load_worker(build_parser().parse_args(["--model", str(pair / "tiny.gguf"), "--baseline"]), speaks=False)
    plain.stop()
    assert not sizer.has_sizer(plain.model, None)  # plain decoding reads nothing


def test_doctor_says_where_they_are_kept(pair, cache, monkeypatch, capsys):
    from dflash_mlx.cli import doctor

    assert doctor.report()["policies"].startswith(f"{cache} (0 model/draft pairs kept")
    model, draft = _loaded(pair, "draft")
    sizer.sizer_for(model, draft)
    assert memory.save(model, draft)
    assert doctor.main([]) == 0 and f"policies             {cache} (1 model/draft pair kept" in capsys.readouterr().out
    monkeypatch.setenv(memory.ENV_VAR, "0")
    assert doctor.report()["policies"] == "not kept (DFLASH_MLX_POLICY_CACHE=0)"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("draft_blocks", [4, None])
def test_a_restored_policy_changes_no_token(arch, draft_blocks, cache):
    """The first cycles after a restore start wide or copy at once, as no fresh process's do: still the
    target's greedy decode, token for token (full attention, sliding windows, a recurrent hybrid; with a
    draft and with copies alone)."""
    from dflash_mlx import stream_generate
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing.targets import greedy_reference, tiny_target

    model, tok = tiny_target(arch, seed=0)
    draft = random_draft(model, num_layers=1, block_size=draft_blocks, seed=3) if draft_blocks else None
    learn, check = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12]
    _new_process()
    for _ in range(3):
        for _ in stream_generate(model, draft, tok, learn, max_tokens=40, stop_token_ids=[]):
            pass
    learned = sizer.sizer_for(model, draft)
    learned.acceptance.hits = list(learned.acceptance.trials)  # as if the draft were always right: wide at once
    learned.acceptance.slow_hits = list(learned.acceptance.slow_trials)
    assert memory.save(model, draft)
    _new_process()
    assert memory.restore(model, draft)
    got = []
    for r in stream_generate(model, draft, tok, check, max_tokens=48, stop_token_ids=[]):
        got += r.tokens
    assert got == greedy_reference(model, check, 48)
