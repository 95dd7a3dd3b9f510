"""Stand-ins: what a `Target.forward` swaps into the model's own module tree for one forward.

A stand-in wraps a module (a decoder layer, a token mixer, a rotary embedding, a head) and changes
what it does for the forward that put it there (taps, tapes, tree positions; `taps`). The model
object is shared with whoever holds it: a caller's `mlx_lm.generate` on another thread, a second
engine on the same weights. So a stand-in is the forward's own, on two counts:

- it acts for the thread that made it: a call from any other thread goes to the wrapped module, as
  if nothing were swapped (else that thread's forward would write its tapes into this forward's
  record, and a rollback would put its states into the batch's rows, or read hidden states for logits);
- `swaps` holds one process-wide lock while its stand-ins are in place, so two forwards that swap
  (two engines' threads) never interleave their puts and put-backs. Only the graph's building runs
  under it; the device runs the graphs after. Code that reads a model's modules (`Target`'s
  construction) takes the same lock (`unswapped`), so it never meets another thread's stand-ins.
"""

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Any

_SWAPPING = threading.RLock()  # (re-entrant: a forward inside a forward's swaps, as probes and heads run)
_thread = threading.get_ident


class StandIn:
    """Base of the wrappers swapped into a model for one forward: attribute reads pass
    through to the wrapped module, and `isinstance` sees its class (some models pick a
    layer's mask by the layer's class, e.g. OLMo hybrid), through stand-ins nested in one
    another (a tapped layer whose calls are also recorded). Its public methods and `__call__`
    act for the thread that made it alone (see the module's docstring)."""

    _wrapped: Any
    _owner: int  # threading.get_ident() of the thread that made it

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._owner = _thread()
        return self

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, method in list(vars(cls).items()):
            if inspect.isfunction(method) and (name == "__call__" or not name.startswith("_")):
                setattr(cls, name, _owned(name, method))

    @property
    def __class__(self):
        return self._wrapped.__class__  # not type(): a nested stand-in's type is its own class

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    # (looked up on the type, not through __getattr__: a module's children read by key, as code that
    # inspects the model reads them)
    def __contains__(self, key):
        return key in self._wrapped

    def __getitem__(self, key):
        return self._wrapped[key]


def _owned(name: str, method):
    """`method` for the stand-in's own thread; the wrapped module's `name` for any other."""

    @functools.wraps(method)
    def owned(self, *args, **kwargs):
        if _thread() == self._owner:
            return method(self, *args, **kwargs)
        return getattr(self._wrapped, name)(*args, **kwargs)

    return owned


@contextmanager
def unswapped():
    """Inside: no other thread's stand-ins are in any model (their forwards wait), for code that reads a
    model's modules (`Target`'s construction)."""
    with _SWAPPING:
        yield


@contextmanager
def swaps():
    """`put(container, key, stand_in)` for one forward: `container[key]` (a module's child or a
    layer list's entry) becomes `stand_in`; everything put is put back, last first, on exit."""
    replaced = []

    def put(container, key, stand_in):
        replaced.append((container, key, container[key]))
        container[key] = stand_in

    with unswapped():
        try:
            yield put
        finally:
            for container, key, original in reversed(replaced):
                container[key] = original
