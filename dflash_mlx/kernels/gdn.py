"""Gated DeltaNet at verify time: the recurrence with a tape, and the replay that rewinds it.

A verify forward runs a block of T steps; after a partial accept the state must
be the one after the accepted prefix. `gdn_tape` runs mlx-lm's recurrence and
also records each step's delta (the tape); `gdn_replay` rebuilds the state
after any prefix from the pre-verify state and the tape, elementwise, without
running the layer again. `gdn_verify` / `gdn_rewind` are what Target's taped
Gated DeltaNet calls: they choose between that pair and mlx-lm's own fused
kernel (see `gdn_verify`).
"""

from typing import Union

import mlx.core as mx

from dflash_mlx.kernels import selection


def _repeat_heads(x, hv):
    r = hv // x.shape[-2]
    return mx.repeat(x, r, -2) if r > 1 else x


def _decay(g_t):
    return g_t[..., None, None] if g_t.ndim == 2 else g_t[..., None, :]


@mx.compile
def _gdn_tape_step(q_t, k_t, v_t, g_t, beta_t, state):
    """One step of mlx-lm's ops recurrence; also returns the delta (the tape entry)."""
    state = state * _decay(g_t)
    kv_mem = (state * k_t[..., None, :]).sum(axis=-1)
    delta = (v_t - kv_mem) * beta_t[..., None]
    state = state + k_t[..., None, :] * delta[..., None]
    y = (state * q_t[..., None, :]).sum(axis=-1)
    return y.astype(q_t.dtype), state, delta.astype(mx.float32)


def gdn_tape_reference(q, k, v, g, beta, state):
    """The mlx-lm ops recurrence (gated_delta_ops) that also returns the tape.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] or [B, T, Hv, Dk];
    beta: [B, T, Hv]; state: [B, Hv, Dv, Dk] float32.
    Returns y [B, T, Hv, Dv], final state, tape [B, T, Hv, Dv] float32 (the deltas).
    """
    Hv = v.shape[2]
    q, k = _repeat_heads(q, Hv), _repeat_heads(k, Hv)
    ys, tape = [], []
    for t in range(k.shape[1]):
        y, state, delta = _gdn_tape_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        tape.append(delta)
    return mx.stack(ys, axis=1), state, mx.stack(tape, axis=1)


def gdn_replay_reference(state, k, g, tape, steps: Union[int, mx.array]):
    """State after the first `steps` steps, from the pre-verify state and the tape.

    `steps` may be an mx.array (the accept length straight from the graph): then
    every step is computed and masked, so no host sync is needed.
    """
    Hv = tape.shape[2]
    k = _repeat_heads(k, Hv)
    if isinstance(steps, int):
        for t in range(steps):
            state = state * _decay(g[:, t])
            state = state + k[:, t, :, None, :] * tape[:, t, :, :, None]
        return state
    for t in range(k.shape[1]):
        new = state * _decay(g[:, t])
        new = new + k[:, t, :, None, :] * tape[:, t, :, :, None]
        state = mx.where(t < steps, new, state)
    return state


def gdn_tape_metal(q, k, v, g, beta, state, factory=None):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return selection.kernel("gdn_tape", factory)(
        inputs=[q, k, v, g, beta, state, T],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                  ("Hk", Hk), ("Hv", Hv), ("GVEC", g.ndim == 4)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv)],
        output_dtypes=[q.dtype, state.dtype, mx.float32],
    )


def gdn_replay_metal(state, k, g, tape, steps, factory=None):
    B, T, Hk, Dk = k.shape
    Hv, Dv = tape.shape[2:]
    # A 0-d input becomes a `constant int&` kernel argument; a device-side accept
    # length works as is (no host sync).
    steps = mx.array(steps, dtype=mx.int32).reshape(())
    return selection.kernel("gdn_replay", factory)(
        inputs=[state, k, g, tape, steps, T],
        template=[("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("GVEC", g.ndim == 4)],
        grid=(Dk, Dv, B * Hv),
        threadgroup=(min(Dk, 32), 8, 1),
        output_shapes=[state.shape],
        output_dtypes=[state.dtype],
    )[0]


def gdn_tape(q, k, v, g, beta, state):
    """Verify-time recurrence: (y, state_out, tape). Same contract as gated_delta_ops."""
    if selection.use_metal("gdn_tape"):
        return tuple(gdn_tape_metal(q, k, v, g, beta, state))
    return gdn_tape_reference(q, k, v, g, beta, state)


def gdn_replay(state, k, g, tape, steps):
    """Pre-verify `state` advanced by the first `steps` verify steps (int or mx.array)."""
    if selection.use_metal("gdn_replay"):
        return gdn_replay_metal(state, k, g, tape, steps)
    return gdn_replay_reference(state, k, g, tape, steps)


def gdn_verify(q, k, v, g, beta, state):
    """The recurrence of a verify forward: (y, state_out, deltas or None).

    With the gdn_tape kernel on, or on the CPU (where the twin costs what
    mlx-lm's own ops loop costs), the deltas come for free and a rollback is an
    elementwise replay. On an Apple GPU whose gdn_tape kernel is not verified,
    mlx-lm's fused kernel beats the twin's per-step loop, so it runs instead and
    the rollback re-runs the recurrence (not the layer) over the kept steps.
    """
    Dk = k.shape[-1]
    mlx_lm_kernel = selection.on_metal() and mx.default_device() == mx.gpu and Dk >= 32 and Dk % 32 == 0
    if selection.use_metal("gdn_tape") or not mlx_lm_kernel:
        return tuple(gdn_tape(q, k, v, g, beta, state))
    from mlx_lm.models.gated_delta import gated_delta_kernel

    y, state_out = gated_delta_kernel(q, k, v, g, beta, state)
    return y, state_out, None


def gdn_rewind(state, q, k, v, g, beta, deltas, steps: int):
    """The pre-verify `state` advanced by the first `steps` verify steps (inputs from gdn_verify)."""
    if deltas is not None:
        return gdn_replay(state, k, g, deltas, steps)
    if steps == 0:
        return state
    from mlx_lm.models.gated_delta import gated_delta_kernel

    return gated_delta_kernel(q[:, :steps], k[:, :steps], v[:, :steps], g[:, :steps], beta[:, :steps], state)[1]
