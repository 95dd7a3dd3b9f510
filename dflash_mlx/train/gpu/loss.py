"""speculators' cross-entropy, fused (Triton) where asked, its eager one where that fails.

On an H200 (torch 2.11, triton 3.6, speculators 0.9.0) the fused kernel failed at the first
step under torch.compile (dynamo: `ListVariable ... already tracked for mutation`,
`loss_backward_kernel.configs`). The first step therefore runs as a trial: any exception
there switches to the eager loss with one printed line, resets dynamo, restores the random
state (the anchors are drawn again identically) and runs the same step again, so the run's
losses equal an eager run's.
"""

import torch

from .recipe import log


class Loss:
    def __init__(self, implementation):
        from speculators.losses import resolve_loss_config

        self.resolve = resolve_loss_config
        self.implementation = implementation
        self.config = resolve_loss_config("ce", implementation)
        self.checked = implementation != "fused"

    def run(self, attempt):
        """attempt(loss_config) -> result; the first call with the fused loss is the trial."""
        if self.checked:
            return attempt(self.config)
        cpu = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            out = attempt(self.config)
        except Exception as e:  # noqa: BLE001 - whatever the kernel or its compiler raises
            first = (str(e).strip().splitlines() or [""])[0][:200]
            log(f"fused cross-entropy failed at first use ({type(e).__name__}: {first}); "
                f"using speculators' eager cross-entropy")
            self.fallback()
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            out = attempt(self.config)
        self.checked = True
        return out

    def fallback(self):
        try:
            torch._dynamo.reset()  # drop the half-traced graphs of the failed attempt
        except Exception:  # noqa: BLE001
            pass
        self.implementation = "eager"
        self.config = self.resolve("ce", "eager")
