"""The training loop: one fixed-shape step of several packs (one batched target pass, one
draft forward and backward), the schedule fitted to the time budget, checkpoints, held-out
evaluation. Throughput is counted: supervised tokens are the positions the loss covers."""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import checkpoint
from .data import packs, step_batch
from .recipe import log


@dataclass
class Run:
    args: object
    model: object  # the frozen target
    draft: object
    opt: object
    params: list
    loss: object  # loss.Loss
    order: object  # data.DataOrder
    schedule: object  # schedule.Schedule
    budget: object  # schedule.Budget
    taps: list
    scale_t: torch.Tensor
    anchors: int  # per pack
    device: torch.device
    dtype: torch.dtype
    recipe: dict
    ckpt_path: object
    history: list = field(default_factory=list)
    supervised: int = 0  # supervised tokens trained on, all legs
    phases: dict = field(default_factory=lambda: {"batch": 0.0, "forward_backward": 0.0, "optimizer": 0.0})


def make_optimizer(draft, args, device):
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr,
                            fused=device.type == "cuda")
    return opt, params


def batch_for(run, step_packs):
    a = run.args
    return step_batch(run.model, step_packs, run.taps, run.scale_t, a.seq_len, a.packs_per_step, run.anchors,
                      run.device, run.dtype, a.feature_batch_tokens)


def forward(run, batch, loss_config):
    with torch.autocast(run.device.type, dtype=run.dtype, enabled=run.dtype != torch.float32):
        _, loss, m = run.draft(**batch, loss_config=loss_config, gamma=run.args.gamma)
    return loss, m


def graphs_compiled():
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


def train(run, step):
    """Steps from `step` until the schedule's end (or the budget's); returns the step reached."""
    a, sched, budget = run.args, run.schedule, run.budget
    sync = (lambda: torch.cuda.synchronize()) if run.device.type == "cuda" and a.profile else (lambda: None)
    first = step
    t_first = None  # when the first step (compile included) ended
    graphs_first = sup_first = 0
    t_fit = time.time()
    refit_s = 0.05 * (budget.train_deadline - budget.start) if budget.end is not None else 0.0
    sup = torch.zeros((), device=run.device, dtype=torch.long)
    t_log, sup_log = time.time(), 0
    while sched.total is None or step < sched.total:
        if budget.train_deadline is not None and time.time() > budget.train_deadline:
            log(f"time budget: training stops at step {step} (schedule planned {sched.total})")
            break
        t0 = time.time()
        batch = batch_for(run, run.order.take(a.packs_per_step))
        sync()
        t1 = time.time()
        for g in run.opt.param_groups:
            g["lr"] = sched.at(step)

        def attempt(cfg):
            run.opt.zero_grad(set_to_none=True)
            loss, m = forward(run, batch, cfg)
            loss.backward()
            return loss, m

        loss, m = run.loss.run(attempt)
        sync()
        t2 = time.time()
        torch.nn.utils.clip_grad_norm_(run.params, a.grad_clip)
        run.opt.step()
        sync()
        t3 = time.time()
        step += 1
        sup += m["full_acc_total"].detach().long()
        if step > first + 1:  # the first step compiles: not a phase time
            for k, dt in (("batch", t1 - t0), ("forward_backward", t2 - t1), ("optimizer", t3 - t2)):
                run.phases[k] += dt
        if step == first + 1:
            t_first, graphs_first, sup_first = time.time(), graphs_compiled(), int(sup.item())
            log(f"first step: {t_first - t0:.1f} s (compiling, where CUDA compiles)")
        # refit every --refit-every steps, and every 5% of the training window (a machine that slows)
        if budget.end is not None and step > first + 1 and (
                (sched.total is None and step == first + 1 + a.calib_steps)
                or (sched.total is not None and (step % a.refit_every == 0 or time.time() > t_fit + refit_s))):
            t_fit = time.time()
            per = (time.time() - t_first) / (step - first - 1)
            fit = step + budget.steps_that_fit(per)
            total = min(fit, a.steps) if a.steps else fit
            if sched.total is None:
                if not run.recipe.get("warm_fixed"):
                    sched.warm = max(1, int(a.warmup * total))
                    run.recipe["warm_fixed"] = True
                log(f"budget: {per * 1000:.0f} ms a step measured over {step - first - 1} steps -> {total} steps "
                    f"(cosine fitted to them, warm-up {sched.warm})")
            sched.total = total
        if step % a.log_every == 0 or step == sched.total:
            t_log, sup_log = log_row(run, step, loss, m, int(sup.item()), t_log, sup_log)
        if a.save_every and step % a.save_every == 0:
            save(run, step, int(sup.item()))
    n = int(sup.item())
    if step > first and (not run.history or run.history[-1]["step"] != step):  # stopped by the budget
        log_row(run, step, loss, m, n, t_log, sup_log)
    timed = max(step - first - 1, 0)
    run.recipe["last_leg"] = {
        "steps": step - first, "supervised_tokens": n,
        "seconds_after_first_step": round(time.time() - t_first, 2) if t_first else 0.0,
        "supervised_tok_s_after_first_step": round((n - sup_first) / (time.time() - t_first)) if timed else None,
        "ms_per_phase": {k: round(1000 * v / timed, 2) for k, v in run.phases.items()} if timed else {},
        "graphs_compiled_after_first_step": graphs_compiled() - graphs_first if t_first else 0,
    }
    run.supervised += n
    return step


def log_row(run, step, loss, m, n, t_log, sup_log):
    """One history row (a host sync: only every --log-every steps); returns the new marks."""
    dt = time.time() - t_log
    acc = float(m["full_acc_sum"] / m["full_acc_total"].clamp(min=1))
    row = {"step": step, "loss": float(loss.detach()), "acc": acc, "lr": run.opt.param_groups[0]["lr"],
           "seconds": round(time.time() - run.budget.start, 1), "supervised_tokens": run.supervised + n,
           "supervised_tok_s": round((n - sup_log) / max(dt, 1e-9))}
    run.history.append(row)
    log(f"step {step}/{run.schedule.total or '?'}: loss {row['loss']:.3f}, top-1 {acc:.3f}, lr {row['lr']:.2e}, "
        f"{row['supervised_tok_s']} supervised tok/s, {row['seconds']:.0f} s")
    return time.time(), n


def save(run, step, sup_this_leg=0):
    checkpoint.save(run.ckpt_path, run.draft, run.opt, step, run.schedule, run.order, run.recipe, run.history,
                    run.loss.implementation, run.supervised + sup_this_leg)


def evaluate(run, recs):
    """Held-out loss, top-1 and accepted-length estimate. It runs the training step's forward
    (same shapes, same mode: no recompile) and skips the backward."""
    tot = {"loss": 0.0, "acc": [0.0, 0.0], "eal": [0.0, 0.0], "n": 0}
    pk = packs(recs, run.args.seq_len, np.random.default_rng(0))
    for i in range(0, len(pk), run.args.packs_per_step):
        loss, m = forward(run, batch_for(run, pk[i: i + run.args.packs_per_step]), run.loss.config)
        tot["loss"] += float(loss.detach())
        tot["n"] += 1
        for k, name in (("acc", "full_acc"), ("eal", "eal")):
            tot[k][0] += float(m[f"{name}_sum"])
            tot[k][1] += float(m[f"{name}_total"])
    return {"loss": tot["loss"] / max(tot["n"], 1), "acc": tot["acc"][0] / max(tot["acc"][1], 1),
            "eal": tot["eal"][0] / max(tot["eal"][1], 1)}
