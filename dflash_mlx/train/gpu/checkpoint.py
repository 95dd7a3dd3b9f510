"""A run folder that resumes (`--resume`): `<work>/checkpoint.pt` holds the draft's weights,
AdamW's state, the schedule and its position, the data order (generator state and the packs
still to come), the random state and the recipe's choices (taps, mask token, vocabulary,
feature scale); the responses are `<work>/responses.jsonl` beside it."""

from dataclasses import asdict
from pathlib import Path

import torch

from .schedule import Schedule


def save(path, draft, opt, step, schedule, order, recipe, history, loss_impl, supervised):
    state = {
        "draft": {k: v.detach().cpu() for k, v in draft.state_dict().items()},
        "optimizer": opt.state_dict(), "step": step, "schedule": asdict(schedule), "order": order.state(),
        "recipe": recipe, "history": history, "loss": loss_impl, "supervised_tokens": supervised,
        "torch_rng": torch.random.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a run killed while saving keeps its last checkpoint


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(state, draft, opt, order):
    """Weights, moments, data order and random state back in place; returns (step, schedule)."""
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["optimizer"])
    order.load(state["order"])
    torch.random.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], Schedule(**state["schedule"])
