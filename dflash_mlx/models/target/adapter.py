"""Target adapter: a DFlash view of an mlx-lm model that runs it while tapping the
layers DFlash reads, and rolls its caches back after a partial accept.

`Target` finds the model's parts (text model, decoder layers, embedding, LM head),
checks that every cache it makes can be rolled back, and runs the forward with
the verify-time swaps of `dflash_mlx/models/target/taps.py` (scoped: nothing
patches mlx-lm classes). The embedding and LM head are `head.TargetHead`; the
rollback of each cache kind is `dflash_mlx/models/target/rollback.py`.
"""

from contextlib import nullcontext
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from dflash_mlx.models.draft.config import validate_for_target
from dflash_mlx.models.target.tree_attention import rope_slots, tree_caches
from dflash_mlx.models.target.head import HEAD_NAMES, HeadInsideTextModel, TargetHead, find_lm_head
from dflash_mlx.models.target import exact_rows, inner_head, rerun
from dflash_mlx.models.target.probe import check_forward
from dflash_mlx.models.target.rollback import (
    UnsupportedTargetError, VerifyRecord, gdn_class, recorded_apart, sub_caches, replay_gdn, replay_layer,
    rollback_cache, rollback_kind,
)
from dflash_mlx.models.target.parts import (EMBEDDING_NAMES, find_text_model, layer_list, takes_mask, text_args,
                                            token_embedding)
from dflash_mlx.models.target.pipeline_carry import Carry, CarryRefused, can_carry, carried
from dflash_mlx.models.target.sharding import (gather_features, on_every_rank, own_layers_caches, sharding_of,
                                               split_stream)
from dflash_mlx.models.target.stand_ins import unswapped
from dflash_mlx.models.target.taps import dense_linears, quantized_linears, submit_layers, taps, use_small_m
from dflash_mlx.models.target.tensor_ride import capacity, ride_slot, riding

NO_LIMIT = 1 << 30  # `verify_room` of a model with no position limit


def _verify_record(target, record: bool, tokens: mx.array, cache) -> Optional[VerifyRecord]:
    """What a verify keeps for its rollback (recurrent state; caches re-run whole: their fields)."""
    if not (record and target.recurrent):
        return None
    rec = VerifyRecord()
    if rerun.takes(target.rollback_kinds()):
        rec.rerun = rerun.before_verify(tokens, cache)
    return rec


def _inner_head(target, model, text_parent, refusal: Exception):
    """(InnerHead, TargetHead) of a text model that applies its LM head itself: its head step, found
    by the logits it gives, and the head that matches them; else its refusal, or mlx-lm's own
    model failing, named."""
    try:
        found = inner_head.head_inside(
            model, target.text_model, target._embedding_name, HEAD_NAMES, target.vocab_size, target.hidden_size,
            lambda inner: TargetHead(model, target.text_model, text_parent, target.embed_tokens,
                                     None if inner.tied else inner.module, target.arch, target.hidden_size, inner=True))
    except UnsupportedTargetError as failed:
        raise UnsupportedTargetError(f"{target.arch}: {failed}") from None
    if found is None:
        raise refusal
    return found


def _check_caches(target: "Target") -> List[Optional[str]]:
    """Each cache entry's rollback ("trim" | "gdn" | "replay" | "rerun"); refuses what has none."""
    kinds, caches = [], target.make_cache()
    for i, c in enumerate(caches):
        kind = rollback_kind(c)
        if kind is None:
            parts = "/".join(type(s).__name__ for s in sub_caches(c))
            raise UnsupportedTargetError(
                f"{target.arch}: cache {i} ({parts}) cannot be rolled back after a partial accept: it has no "
                "trim (attention KV) and is not a recurrent state (mlx-lm's ArraysCache) that can be "
                "restored and replayed; it needs a rollback path in dflash_mlx/models/target/rollback.py"
            )
        if kind == "replay" and i + target.layer_offset in target._gdn_layers and isinstance(c, ArraysCache):
            kind = "gdn"  # the taped Gated DeltaNet: rewound without running the layer again
        kinds.append(kind)
    reason = rerun.refusal(kinds, caches)
    if reason is not None:
        raise UnsupportedTargetError(f"{target.arch}: {reason}")
    return kinds


# A draft's `target_layer_ids` entry asking for the forward's input tokens as its features, [B, S, 1]:
# an autoregressive draft's context is the tokens themselves (`models.draft.autoregressive`).
INPUT_TOKENS = "input tokens"


class Target:
    """A DFlash view of an mlx-lm model (never modifies it).

    Any mlx-lm text model runs if its decoder layers can be tapped and every cache it
    makes has a rollback path (`rollback_kind`); otherwise construction fails naming the
    layer and the cache kind.
    """

    def __init__(self, model, name: Optional[str] = None):
        with unswapped():  # (another thread's forward may have its stand-ins in the model's modules)
            self._build(model, name)

    def _build(self, model, name: Optional[str]):
        self.model = model
        self.text_model, text_parent = find_text_model(model)
        self.args = text_args(model, self.text_model)
        self.arch = getattr(self.args, "model_type", None) or getattr(model, "model_type", "?")
        self.name = name or f"{self.arch} target"
        self.layers = layer_list(self.text_model)  # the model's own list: taps swap its entries
        self._takes_mask = takes_mask(self.text_model)
        self._embedding_name = next(n for n in EMBEDDING_NAMES if n in self.text_model)
        self.embed_tokens = token_embedding(self.text_model[self._embedding_name])
        # (a quantized embedding's weight is packed: its own output gives the width, not the weight's)
        self.hidden_size = getattr(self.args, "hidden_size", None) or self.embed_tokens(mx.array([0])).shape[-1]
        self.vocab_size = getattr(self.args, "vocab_size", None) or self.embed_tokens.weight.shape[0]
        # split over processes (mlx.launch): pipeline ranks hold a run of the layers, None elsewhere
        self.sharding = sharding_of(model, self.text_model, self.args)
        self.layer_offset = self.sharding.layer_offset if self.sharding is not None else 0
        self.num_layers = (self.sharding.num_layers if self.sharding is not None and self.sharding.num_layers
                           else len(self.layers))
        # a pipeline rank's taps ride on the model's own hops (`pipeline_carry`) until refused
        self._carries = can_carry(self.text_model, self._embedding_name)
        # a tensor split's rider values ride on one of its layer sums (`tensor_ride`) where it has one
        self._ride_slot = (ride_slot(self.layers) if self.sharding is not None and self.sharding.kind == "tensor"
                           else None)
        self.rms_norm_eps = getattr(self.args, "rms_norm_eps", 1e-6)
        self.max_context = getattr(self.args, "max_position_embeddings", None)
        self.context_note = None  # why `max_context` is below the model's own (set by `check_forward`)
        self._lm_head = find_lm_head(model)
        self._gdn_layers = [
            i for i, layer in enumerate(self.layers)  # (qwen3_5 is imported only for a model with linear layers)
            if layer is not None and "linear_attn" in layer and isinstance(layer["linear_attn"], gdn_class())
        ]
        # Affine-quantized projections of the decoder layers, for the small-M verify kernel.
        self._quantized = [x for layer in self.layers if layer is not None for x in quantized_linears(layer)]
        # and the bias-free dense ones, for CUDA's (`kernels.gemv`)
        self._dense = [x for layer in self.layers if layer is not None for x in dense_linears(layer)]
        self._replay_kinds = _check_caches(self)
        # whether a one-token update can overwrite a sliding window's oldest entry (`engine.ahead`)
        self.rotating = any(isinstance(s, RotatingKVCache) for c in self.make_cache() for s in sub_caches(c))
        self._recurrent = any(kind != "trim" for kind in self._replay_kinds)
        if self.sharding is not None:  # a pipeline's ranks hold different layers; the engine's choices
            # made from these (what is launched ahead) must be the same on every rank
            no_recurrent, no_rotating = on_every_rank(self.sharding, [not self._recurrent, not self.rotating])
            self._recurrent, self.rotating = not no_recurrent, not no_rotating
        # The embedding and LM head: `embed`, `head` and `logits` are its.
        self.inner_head = None  # the text model's own head step, passed through in forwards (`inner_head`)
        try:
            self.vocab = TargetHead(model, self.text_model, text_parent, self.embed_tokens, self._lm_head,
                                    self.arch, self.hidden_size)
        except HeadInsideTextModel as refusal:
            self.inner_head, self.vocab = _inner_head(self, model, text_parent, refusal)
            self._lm_head = self._lm_head if self.inner_head.tied else self.inner_head.module
        self._rope_slots = None
        self._deterministic = False  # every row in plain decoding's shapes (`exact_rows`)
        # set by check_forward: a rollback re-runs the modules a layer hands its recurrent state to, not the
        # layer (Kimi K3); taps read a layer the model never calls whole at the next one's input norm (IQuest)
        self.replay_mixers = self.tap_inputs = False
        check_forward(self)  # once per model: what only a forward shows is refused here, in one line

    # -- embedding and head (TargetHead) ------------------------------------------

    @property
    def embed_tokens_dtype(self):
        return self.vocab.embed_tokens_dtype

    def embed(self, ids: mx.array) -> mx.array:
        """The target's input embedding, with its scale (the draft reuses it)."""
        return self.vocab.embed(ids)

    def head(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Raw LM head (no soft-capping) over the whole vocabulary or over `vocab_ids`."""
        return self.vocab.head(h, vocab_ids)

    def logits(self, h: mx.array, own_head: Optional[bool] = None) -> mx.array:
        """The logits mlx-lm's `Model.__call__` produces from final hidden states."""
        if self._deterministic:
            return exact_rows.logits_rows(lambda rows: self.vocab.logits(rows, own_head), h)
        return self.vocab.logits(h, own_head)

    # -- deterministic mode -----------------------------------------------------

    @property
    def deterministic(self) -> bool:
        """Whether every forward and LM head runs in plain decoding's shapes (`exact_rows`)."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, on: bool):
        if on:
            reason = exact_rows.refusal(self)
            if reason is not None:
                raise UnsupportedTargetError(f"deterministic mode: {reason}")
        self._deterministic = bool(on)

    def verify_room(self, position: int) -> int:
        """The most rows a verify whose first row sits at `position` may hold. Past the model's
        position limit (`max_context`) mlx-lm's own forwards are one row wide, and what some
        models compute there depends on the forward's width (dynamic NTK RoPE sizes its base
        from offset + rows; a window's mask outgrows its cache): one row at a time there,
        exactly as mlx-lm runs it, rather than a stop mlx-lm would not make."""
        if not self.max_context:
            return NO_LIMIT
        return max(1, self.max_context - position)

    # -- caches ---------------------------------------------------------------

    def make_cache(self) -> List[Any]:
        """mlx-lm's caches for the model; on a pipeline rank, those of its own layers only."""
        return own_layers_caches(make_prompt_cache(self.model), self.text_model, self.sharding)

    @property
    def recurrent(self) -> bool:
        """Whether some cache holds recurrent state (it cannot be trimmed back to a prefix; on a
        split target, some cache of some rank's)."""
        return self._recurrent

    @property
    def rope_slots(self) -> List[Tuple[Any, Any]]:
        """(parent, key) of every rotary embedding in the decoder layers (for tree verifies)."""
        if self._rope_slots is None:
            self._rope_slots = rope_slots([layer for layer in self.layers if layer is not None])
        return self._rope_slots

    def rollback_kinds(self) -> List[str]:
        """Each cache entry's rollback path: "trim", "gdn" (taped replay), "replay" (re-run the layer) or
        "rerun" (re-run the text model)."""
        return list(self._replay_kinds)

    # -- forward with taps ------------------------------------------------------

    def forward(
        self,
        tokens: mx.array,
        cache: List[Any],
        layer_ids: Sequence[int] = (),
        record: bool = False,
        tree=None,
        fuse: Optional[Callable[[mx.array], mx.array]] = None,
    ) -> Tuple[mx.array, Optional[mx.array], Optional[VerifyRecord]]:
        """tokens: [B, S] -> final hidden [B, S, H], features [B, S, n*H] (None if no taps), record.

        `record=True` marks a verify forward: Gated DeltaNet layers run taped and the
        layers holding other recurrent state are recorded (the VerifyRecord `rollback`
        replays). A verify's projections, or a batched step's (one token a row), go through a
        small-M kernel where one is on and B*S fits its widths (`taps.use_small_m`); a prompt's
        chunks run MLX's own products, as mlx-lm's prefill does. `tree` (a `tree_attention.TokenTree` of S nodes):
        the tokens are its nodes, each seeing its ancestors at the position of its depth
        (the caches' masks and the rotary embeddings are swapped for the call). `fuse` (the
        draft's linear map of the taps, `fused_taps`): a pipeline rank sends its taps' share of
        it instead of the taps, and the features come back through it, [B, S, H]; elsewhere the
        taps are in this process and nothing is sent, so it is not used. A split target runs on
        mlx-lm's generation stream, whatever the caller's (`sharding.split_stream`).
        """
        with split_stream(self.sharding is not None):
            return self._forward(tokens, cache, layer_ids, record, tree, fuse)

    def _forward(self, tokens, cache, layer_ids, record, tree, fuse):
        if INPUT_TOKENS in layer_ids:  # (alone; kept and handed back as taps: the draft's cache follows the target's)
            h, _, rec = self._forward(tokens, cache, (), record, tree, fuse)
            return h, tokens[..., None], rec
        if self.sharding is not None and self.sharding.kind == "pipeline":
            return self._pipeline_forward(tokens, cache, layer_ids, record, tree, fuse)
        if self._deterministic and record and tokens.shape[1] > 1:  # a verify, as plain decode steps
            if tree is not None or tokens.shape[0] != 1:
                raise UnsupportedTargetError("deterministic mode verifies one sequence's chain, not trees or batches")
            return exact_rows.forward_rows(lambda row: self.forward(row, cache, layer_ids), tokens, cache,
                                           len(layer_ids))
        rec = _verify_record(self, record, tokens, cache)
        small_m = use_small_m(self, tokens, record)
        rider = self.sharding.rider if self.sharding is not None and self._ride_slot is not None else None
        ride = rider.outbox[: capacity(self._ride_slot)] if rider is not None else []
        if (not (layer_ids or ride or small_m or (record and submit_layers(self))) and rec is None and tree is None
                and self.inner_head is None):
            return self.run_text_model(tokens, cache), None, None  # nothing to tap, swap or carry: a plain forward
        features = [None] * len(layer_ids)
        with taps(self, layer_ids, features, rec, small_m, cache, tree, tokens.shape[:2]), \
                (riding(self._ride_slot, ride, self.sharding.rank) if ride else nullcontext()) as summed:
            h = self.run_text_model(tokens, cache if tree is None else tree_caches(cache, tree))
        if ride:  # rank 0's values rode on the tensor split's own sum (`tensor_ride`)
            if summed.arrived is None:  # this model's forward skipped it: they wait for their own all_sum
                self._ride_slot = None
            else:
                del rider.outbox[: len(ride)]
                rider.inbox.append(summed.arrived)
        return h, (mx.concatenate(features, axis=-1) if layer_ids else None), rec

    def run_text_model(self, tokens: mx.array, cache) -> mx.array:
        """The text model's forward (inside the swaps `taps` made) -> final hidden states: its
        output, or, where it applies its LM head itself, what its head step was handed."""
        if self._takes_mask:  # (what its Model makes: mlx-lm's mask of the tokens over the first cache)
            out = self.text_model(tokens, create_attention_mask(tokens, cache[0] if cache else None), cache=cache)
        else:
            out = self.text_model(tokens, cache=cache)
        return out if self.inner_head is None else self.inner_head.hidden(out)

    def _pipeline_forward(self, tokens, cache, layer_ids, record, tree, fuse):
        """`forward` on a pipeline rank: the taps, and the rider values rank 0 has waiting, ride
        on the model's own hop and gather (`pipeline_carry`); where the model's pipeline cannot
        carry them (refused before anything ran), an all_sum gathers the taps and the rider
        waits for `engine.distributed` to send it."""
        rider = self.sharding.rider
        while True:
            features = [None] * len(layer_ids)
            rec = _verify_record(self, record, tokens, cache)
            carrying = self._carries and (layer_ids or rider.outbox)
            ride = rider.outbox[: tokens.shape[1] * self.hidden_size] if carrying else []
            carry = Carry(tokens.shape[0], features, ride, self.sharding.rank, fuse)
            # DeepSeek V4.1's receive adds what it gets to its caches before a held layer refuses the carry
            kept = rerun.before_verify(tokens, cache) if carrying and rerun.takes(self._replay_kinds) else None
            try:
                small_m = use_small_m(self, tokens, record)
                with taps(self, layer_ids, features, rec, small_m, cache, tree, tokens.shape[:2]), \
                        (carried(self.text_model, self._embedding_name, self.layers, carry) if carrying
                         else nullcontext()):
                    h = self.run_text_model(tokens, cache if tree is None else tree_caches(cache, tree))
                break
            except CarryRefused:  # its layers take more than one hidden state: gather the taps
                self._carries = False
                if kept is not None:
                    rerun.rerun(self.run_text_model, cache, kept, 0)
        if carrying:
            feats = carry.tap_features()
            del rider.outbox[: len(ride)]
            if ride:
                rider.inbox.append(carry.rider_values())
        else:
            feats = gather_features(features, h, self.sharding, fuse) if layer_ids else None
        # each rank's graph differs (its own layers, hops and gathers): queued now, every rank runs
        # this forward's collectives in call order, never interleaved with the next
        mx.async_eval([x for x in (h, feats, rider.inbox[-1] if ride else None) if x is not None])
        return h, feats, rec

    # -- rollback ---------------------------------------------------------------

    def rollback(self, cache: List[Any], num_tokens: int, num_rejected: int, record: Optional[VerifyRecord]):
        """Undo the last `num_rejected` of the `num_tokens` tokens the last forward fed.

        One path per cache kind (`rollback_kind`): attention caches trim (`rollback_cache`);
        a Qwen3.5 Gated DeltaNet state is replayed from the pre-verify state over the
        accepted steps of its tape (`replay_gdn`); any other cache that holds recurrent
        state is restored to its pre-verify state and its layer runs again on the kept
        tokens (`replay_layer`); caches whose layers share state (DeepSeek V4.1) are all put back
        and the text model runs again on the kept tokens (`rerun`).
        """
        if num_rejected <= 0:
            return
        keep = num_tokens - num_rejected
        if isinstance(record, exact_rows.RowsRecord):  # a deterministic verify's one-token rows
            record.rollback(num_tokens, keep)
            return
        if record is not None and record.rerun is not None:  # every cache back, the kept tokens again
            with split_stream(self.sharding is not None):  # (a split's collectives: the forwards' stream)
                rerun.rerun(self.run_text_model, cache, record.rerun, keep)
            return
        for idx, (c, kind) in enumerate(zip(cache, self._replay_kinds)):
            if kind == "trim":
                rollback_cache(c, num_rejected)
            elif kind == "gdn":
                replay_gdn(c, record.gdn[idx], keep)
            elif recorded_apart(c, record):
                for sub in sub_caches(c):
                    if isinstance(sub, ArraysCache):
                        replay_layer(record.replay[id(sub)], num_tokens, keep)
                    else:
                        rollback_cache(sub, num_rejected)
            elif id(c) in record.replay:
                replay_layer(record.replay[id(c)], num_tokens, keep)
            else:
                raise RuntimeError(f"cache {idx} ({type(c).__name__}) was not fed by the verify forward")


def target_for(model, draft) -> Target:
    """The `Target` adapter a draft is bound to for `model`; binds (and checks) a draft bound elsewhere."""
    target = getattr(draft, "target", None)
    if target is not None and target.model is model:
        return target
    target = Target(model)
    if draft is not None:
        if hasattr(draft, "check_target"):  # (a draft of its own kind: `models.draft.autoregressive`)
            draft.check_target(target)
        elif hasattr(draft, "config"):
            validate_for_target(draft.config, target)
        draft.bind(target)
    return target
