"""Tiny float32 random-weight targets of every supported architecture, a byte-level
tokenizer, and scripted drafts, for tests and examples that must run in seconds."""

import importlib
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_mlx.models.draft.context_cache import ContextCache
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.tool_calls import tool_calling_kwargs

VOCAB = 300  # 256 byte tokens + specials + spare ids (mask token lives at the top)
EOS_ID = 257

_BASE = dict(vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=4096)

TINY_CONFIGS: Dict[str, dict] = {
    "llama": dict(
        _BASE, model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        # two sliding layers so the rotating cache path runs on llama too
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24,
    ),
    "qwen3": dict(
        _BASE, model_type="qwen3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "gemma3_text": dict(
        _BASE, model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=16, sliding_window_pattern=2,
    ),
    "qwen3_5": dict(
        _BASE, model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
    ),
    "gemma4_text": dict(
        _BASE, model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=16,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        sliding_window=16, sliding_window_pattern=2, use_double_wide_mlp=False,
    ),
}


def byte_tokenizer() -> TokenizerWrapper:
    """Byte-level BPE with no merges: every UTF-8 byte is a token, so multi-byte
    characters are split across tokens (exercises the streaming detokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<bos>"] = 256
    vocab["<eos>"] = EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    return TokenizerWrapper(hf)


def tiny_target(arch: str, seed: int = 0, **overrides):
    """(model, tokenizer): a random float32 mlx-lm model of architecture `arch`."""
    cfg = dict(TINY_CONFIGS[arch], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Spread the logits so greedy choices are far from ties: exactness tests then
    # test the engine, not float rounding.
    params = model.parameters()
    model.update(_scale_embeddings(params))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model, byte_tokenizer()


def _scale_embeddings(params):
    from mlx.utils import tree_map_with_path

    return tree_map_with_path(lambda path, p: p * 4.0 if path.endswith("embed_tokens.weight") else p, params)


def greedy_reference(model, prompt_ids: Sequence[int], max_tokens: int, stop_ids=(), make_cache=None,
                     prefill_step_size: int = 2048, logits_processors=None, **kv_quantization) -> List[int]:
    """Plain mlx-lm greedy decoding: the ground truth DFlash must reproduce (`make_cache`: the
    caches it decodes with, mlx-lm's own for the model where None; `prefill_step_size`: its
    prompt chunks, mlx-lm's default; `logits_processors`: mlx-lm's, on every step;
    `kv_quantization`: its `kv_bits`, `kv_group_size` and `quantized_kv_start`)."""
    from mlx_lm.generate import generate_step

    out = []
    cache = make_cache() if make_cache is not None else None
    for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, prompt_cache=cache,
                                prefill_step_size=prefill_step_size, sampler=lambda x: mx.argmax(x, axis=-1),
                                logits_processors=logits_processors, **kv_quantization):
        tok = int(tok)
        out.append(tok)
        if tok in stop_ids:
            break
    return out


def decoded(model, draft, tokenizer, prompt_ids: Sequence[int], max_tokens: int, width="auto", **kwargs):
    """(DFlash's greedy tokens for `prompt_ids`, each response's `proposal`), `stream_generate`'s `kwargs`
    on top, at `width`, stopping at EOS only (as mlx-lm's decode does)."""
    from dflash_mlx import stream_generate

    out, proposals = [], []
    for r in stream_generate(model, draft, tokenizer, prompt_ids, max_tokens=max_tokens, block_size=width,
                             stop_token_ids=[], **kwargs):
        out += r.tokens
        proposals.append(r.proposal)
    return out, proposals


def clean_case(model, length: int, max_tokens: int, seed: int, make_cache=None):
    """(prompt, greedy reference) for a random byte prompt whose greedy continuation has no
    EOS (the engine stops on EOS, as mlx-lm does), so every case runs to its full length."""
    import random

    for s in range(seed, seed + 50):
        rng = random.Random(s)
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = greedy_reference(model, prompt, max_tokens, make_cache=make_cache)
        if EOS_ID not in ref:
            return prompt, ref
    raise AssertionError("no EOS-free case found")


class ScriptedDraft:
    """A stand-in draft that proposes from a known sequence.

    It proposes `reference[p+1 : p+n+1]` where p is the position of the last
    committed token; from the `wrong_from(cycle)`-th proposal onwards it proposes
    a token that differs from the reference. `wrong_from = lambda c: 10**9` is
    an oracle (every block fully accepted), `lambda c: 0` always wrong.
    """

    def __init__(self, target: Target, reference: Sequence[int], wrong_from, block_size: int = 16, layer_ids=(0,)):
        if layer_ids == "every":  # every layer runs behind the stand-in that keeps its output
            layer_ids = range(target.num_layers)  # (a pipeline rank's list stops at its last layer)
        self.target = target
        self.reference = list(reference)
        self.wrong_from = wrong_from
        self.block_size = block_size
        self.cycle = 0
        self.expected_accepts: List[int] = []

        class _Cfg:
            target_layer_ids = list(layer_ids)

        self.config = _Cfg()

    def bind(self, target):
        self.target = target
        return self

    def make_cache(self):
        return [ContextCache()]

    def inject(self, features, cache):
        if features is not None:
            cache[0].offset += features.shape[1]

    def propose_logits(self, last_token, features, cache, block_size):
        self.inject(features, cache)
        p = cache[0].offset  # index of the last committed token
        n = block_size - 1
        wrong = self.wrong_from(self.cycle)
        self.cycle += 1
        ids = []
        for i in range(n):
            j = p + 1 + i
            ref = self.reference[j] if j < len(self.reference) else 0
            ids.append(ref if i < wrong else (ref + 1) % VOCAB)
        available = max(0, len(self.reference) - p - 1)
        self.expected_accepts.append(min(wrong, n, available))
        logits = np.full((1, n, VOCAB), -1e4, dtype=np.float32)
        logits[0, np.arange(n), ids] = 0.0
        return mx.array(logits)

    def to_target_ids(self, ids):
        return ids


class RankedDraft(ScriptedDraft):
    """A scripted draft for token trees: at drafted position i of its c-th proposal the
    right token (from `reference`) is the `rank_of(c, i)`-th likeliest (0: its argmax;
    >= 4: not among its four likeliest), wrong tokens take the other ranks, with
    log-probabilities falling by one per rank."""

    def __init__(self, target: Target, reference: Sequence[int], rank_of, block_size: int = 16, layer_ids=(0,)):
        super().__init__(target, reference, lambda c: 10**9, block_size, layer_ids)
        self.rank_of = rank_of

    def propose_logits(self, last_token, features, cache, block_size):
        self.inject(features, cache)
        p = cache[0].offset  # index of the last committed token
        n = block_size - 1
        logits = np.full((1, n, VOCAB), -1e4, dtype=np.float32)
        for i in range(n):
            j = p + 1 + i
            right = self.reference[j] if j < len(self.reference) else 0
            wrong = [(right + 1 + k) % VOCAB for k in range(4)]
            rank = self.rank_of(self.cycle, i)
            for r, tok in enumerate((wrong[:rank] + [right] + wrong[rank:])[:4]):
                logits[0, i, tok] = -float(r)
        self.cycle += 1
        return mx.array(logits)


class RowScriptedDrafts(ScriptedDraft):
    """A scripted draft for the batch engine: a row's context cache belongs to the case
    (prompt, reference answer) of the same prompt length (`register` it when the row is
    made; give cases prompts of distinct lengths); it proposes from that case's prompt +
    answer, right for `right(c)` tokens of the row's c-th proposal (then wrong)."""

    def __init__(self, target: Target, cases, right, block_size: int = 16, layer_ids=(0,)):
        super().__init__(target, [], lambda c: 10**9, block_size, layer_ids)
        self.cases: Dict[int, List[int]] = {}
        for prompt, answer in cases:
            self.add_case(prompt, answer)
        self.right = right
        self._rows: Dict[int, Tuple[List[int], int]] = {}  # id(context cache) -> (reference, proposals)
        self._states: List[Tuple[object, List[int]]] = []

    def add_case(self, prompt: Sequence[int], answer: Sequence[int]):
        self.cases[len(prompt)] = list(prompt) + list(answer)

    def register(self, state, prompt: Sequence[int]):
        """`state`: the `PromptCache` of a row answering `prompt` (its draft cache may be
        made anew when the prompt is prefilled)."""
        self._states.append((state, self.cases[len(prompt)]))

    def propose_logits(self, last_token, features, cache, block_size):
        key = id(cache[0])
        if key not in self._rows:
            self._rows[key] = next((ref, 0) for state, ref in self._states if state.draft_cache[0] is cache[0])
        self.reference, cycle = self._rows[key]
        self._rows[key] = (self.reference, cycle + 1)
        self.wrong_from = lambda c: self.right(cycle)
        return super().propose_logits(last_token, features, cache, block_size)


def chain_target(text: str, seed: int = 0):
    """(model, tokenizer) whose greedy continuation spells `text` over and over.

    A `successor_target` over the byte tokens of `text`, the last one followed by
    the first. Lets tests check streamed text (multi-byte UTF-8 split over tokens)
    against a known answer.
    """
    tok = byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    succ = {a: b for a, b in zip(ids, ids[1:] + ids[:1])}
    if len(succ) != len(ids):
        raise ValueError("chain_target needs a text whose byte tokens are all distinct")
    return successor_target(succ, seed=seed)[0], tok


def successor_target(successors: Dict[int, int], seed: int = 0):
    """(model, tokenizer): a tiny llama whose greedy next token after token a is `successors[a]`.

    Its decoder layers are silenced (o_proj/down_proj zero), so the logits depend
    only on the current token; the LM head maps each key's embedding to its
    successor. Token ids up to `VOCAB`; tokens without a successor have flat logits.
    """
    model, tok = tiny_target("llama", seed=seed, layer_types=None, sliding_window=None)
    rng = np.random.default_rng(seed)
    H = model.args.hidden_size
    embed = rng.standard_normal((VOCAB, H)).astype(np.float32)
    head = np.zeros((VOCAB, H), dtype=np.float32)
    for a, b in successors.items():
        head[b] += embed[a] / np.linalg.norm(embed[a]) * 8.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.model.embed_tokens.weight = mx.array(embed)
    model.model.norm.weight = mx.ones((H,))
    model.lm_head.weight = mx.array(head)
    mx.eval(model.parameters())
    return model, tok


# A tool-capable chat template in the form mlx-lm's json_tools parser reads (it infers
# that parser from "<tool_call>" and "tool_call.name"). No generation prompt: the
# answer follows the last message's end marker, which tells the target what to say.
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|system|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' %}<|user|>{{ m.content }}<|end_user|>"
    "{%- elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- else %}{{ raise_exception('unknown role ' + m.role) }}{%- endif %}"
    "{%- endfor %}"
)
# `tool_call_target` emits the first after a user turn and the second after a tool result.
TOOL_CALL_TOKENS = ["<tool_call>", '{"name": "', "get_weather", '", "arguments": ', '{"city": "', "Paris", '"}}',
                    "</tool_call>"]
TOOL_ANSWER_TOKENS = ["Sunny", " and 22°C", " in Paris."]
TOOL_MARKERS = ["<|system|>", "<|end|>", "<|user|>", "<|end_user|>", "<tool_response>", "</tool_response>"]


def tool_call_tokenizer() -> TokenizerWrapper:
    """The byte tokenizer with the tool-call pieces and markers as added tokens and
    `TOOL_TEMPLATE`, wrapped with the tool parser mlx-lm infers for it."""
    hf = byte_tokenizer()._tokenizer
    hf.add_tokens(TOOL_CALL_TOKENS + TOOL_ANSWER_TOKENS + TOOL_MARKERS)
    hf.chat_template = TOOL_TEMPLATE
    return TokenizerWrapper(hf, **tool_calling_kwargs(hf))


def tool_call_target(seed: int = 3):
    """(model, tokenizer): a `successor_target` whose greedy answer to a user turn is the tool
    call `"".join(TOOL_CALL_TOKENS)` and to a tool result `"".join(TOOL_ANSWER_TOKENS)`, each
    followed by EOS (every token of both occurs once, so a one-token context suffices)."""
    tok = tool_call_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in TOOL_CALL_TOKENS + TOOL_ANSWER_TOKENS + TOOL_MARKERS}
    succ = {}
    for chain, after in ((TOOL_CALL_TOKENS, "<|end_user|>"), (TOOL_ANSWER_TOKENS, "</tool_response>")):
        seq = [ids[after]] + [ids[t] for t in chain] + [EOS_ID]
        succ.update(zip(seq, seq[1:]))
    model, _ = successor_target(succ, seed=seed)
    return model, tok


def small_draft_model(target, num_draft_tokens: int, seed: int = 5):
    """An autoregressive draft (mlx-lm's `--draft-model`) for `target`: a one-layer random qwen3 of the target's
    vocabulary, so its chains are right now and then and rolled back often."""
    from dflash_mlx.models.draft.autoregressive import AutoregressiveDraft
    from dflash_mlx.models.target.adapter import Target

    small, _ = tiny_target("qwen3", seed=seed, vocab_size=Target(target).vocab_size, tie_word_embeddings=False,
                           num_hidden_layers=1)
    return AutoregressiveDraft(small, num_draft_tokens=num_draft_tokens)
