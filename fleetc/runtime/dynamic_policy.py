"""Which input dims a step compiles symbolically: `fleetc.compile(..., dynamic=None|True|False, dynamic_dims=...)`.

- `dynamic=False`: every Program is specialised to its input sizes (a new size recompiles).
- `dynamic=True`: dim 0 ("batch") and dim 1 ("seq") of every tensor input are symbolic from the first call.
- `dynamic=None` (the default, as torch.compile): the first call compiles static; when a later call changes a
  dim of an input of the same rank, that dim is marked dynamic and the recompile is symbolic in it.
- `dynamic_dims={"input_ids": {0: "batch", 1: "seq"}}` names dims explicitly (by feed name: forward's parameter
  name, "target" for the loss function's target), symbolic from the first call whatever `dynamic` says.

An int argument (`forward(x, n)`) that changes between calls is marked too, under `dynamic=None` and `True`: from
then on it is fed as a size carrier (fleetc/capture/int_arguments.py) and traced as a symbol named after it, so
the recompile it causes is the last one instead of one per value.

A dim the model forces to one size (a Linear's input features) stays static: the report says so. The marks are
per step kind ("train", "eval"); the cache key replaces a marked dim's size by its name. Dims named "seq" are
bounded by the model config's number of positions (fleetc/capture/dim_bounds.py); a call beyond it is refused.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from fleetc.capture.dynamic import DEFAULT_DIM_NAMES, DynamicDims
from fleetc.capture.int_arguments import is_carrier, is_size, size_carrier
from fleetc.errors import GuardError, StrategyError


def _check_dims(dynamic_dims: Any) -> dict[str, dict[int, str]]:
    if dynamic_dims is None:
        return {}
    if not isinstance(dynamic_dims, dict):
        raise StrategyError(f"dynamic_dims must map a feed name to {{dim: name}}, not {type(dynamic_dims).__name__}")
    for feed, dims in dynamic_dims.items():
        if not isinstance(dims, dict) or not all(isinstance(d, int) and isinstance(n, str) and n.isidentifier()
                                                 for d, n in dims.items()):
            raise StrategyError(f"dynamic_dims[{feed!r}] must map a dim index to a name (an identifier), "
                                f"e.g. {{0: 'batch', 1: 'seq'}}; got {dims!r}")
    return {feed: dict(dims) for feed, dims in dynamic_dims.items()}


class DynamicPolicy:
    """The dims marked dynamic so far, per step kind, and why each was marked."""

    def __init__(self, dynamic: bool | None, dynamic_dims: dict[str, dict[int, str]] | None,
                 bounds: dict[str, tuple[int, str]] | None = None):
        if dynamic not in (None, True, False):
            raise StrategyError(f"dynamic must be None, True or False, not {dynamic!r}")
        self.dynamic = dynamic
        self.named = _check_dims(dynamic_dims)
        self.bounds = dict(bounds or {})  # dim name → (upper bound, where it is from)
        self.feed_names: dict[str, list[str]] = {}  # step kind → its tensor inputs' names
        self.marks: dict[str, DynamicDims] = {}
        self._first: dict[str, list[tuple[int, ...]]] = {}  # step kind → tensor input shapes of its first compile
        self._first_ints: dict[str, list] = {}  # step kind → its first call's carriable int leaves (None elsewhere)
        self.ints: dict[str, set[int]] = {}  # step kind → leaf indices of the int arguments marked dynamic
        self._resolved: set[str] = set()

    def _resolve_names(self, kind: str, shapes: list[tuple[int, ...]], feed_names: list[str]) -> None:
        """Mark the dims `dynamic_dims` names (once per step kind); unknown feeds or dims are an error."""
        names = [name for dims in self.named.values() for name in set(dims.values())]
        shared = frozenset(name for name in names if names.count(name) > 1)  # named for two feeds: one symbol
        # The loss target's default-named dims are tied to the first input's (dynamic_dims names them otherwise).
        target = feed_names.index("target") if "target" in feed_names[1:] and "target" not in self.named else None
        marks = self.marks.setdefault(kind, DynamicDims(bounds=self.bounds, shared=shared, target=target))
        self.feed_names[kind] = feed_names
        if self.dynamic is True:
            for i, shape in enumerate(shapes):
                marks.dims.setdefault(i, {}).update({d: DEFAULT_DIM_NAMES[d] for d in range(min(len(shape), 2))})
        position = {name: i for i, name in enumerate(feed_names)}
        for feed, dims in self.named.items():
            if feed not in position:
                if kind == "train":
                    raise StrategyError(f"dynamic_dims names {feed!r}, which is not a tensor input of the step; "
                                        f"its tensor inputs: {', '.join(feed_names)}")
                continue  # the eval step has no target
            i = position[feed]
            for d in dims:
                if not -len(shapes[i]) <= d < len(shapes[i]):
                    raise StrategyError(f"dynamic_dims[{feed!r}] names dim {d}, but {feed} has {len(shapes[i])} dims")
            marks.dims.setdefault(i, {}).update({d % len(shapes[i]): name for d, name in dims.items()})
        self._resolved.add(kind)

    def carry_ints(self, kind: str, leaves: list) -> list:
        """`leaves` with the int arguments marked dynamic replaced by size carriers (`leaves` itself when there are
        none); an int that differs from the step kind's first call is marked now (not under dynamic=False)."""
        if self.dynamic is False:
            return leaves
        first = self._first_ints.setdefault(kind, [leaf if is_size(leaf) else None for leaf in leaves])
        marked = self.ints.setdefault(kind, set())
        if len(first) == len(leaves):
            marked.update(i for i, (was, now) in enumerate(zip(first, leaves))
                          if was is not None and is_size(now) and was != now)
        if not marked:
            return leaves
        return [size_carrier(leaf) if i in marked and is_size(leaf) else leaf for i, leaf in enumerate(leaves)]

    def check_bounds(self, kind: str, shapes: list[tuple[int, ...]]) -> None:
        """Refuse a call whose marked dims exceed their upper bounds (the model cannot run it; eager would fail
        inside it), naming the dim and the bound."""
        beyond = self.marks[kind].beyond_bounds(shapes, self.feed_names[kind])
        if beyond is not None:
            raise GuardError(f"shape guard failed: {beyond}")

    def give_up(self, kind: str, why: str) -> None:
        """The symbolic trace of automatically marked dims failed: this step kind stays static from now on."""
        marks = self.marks[kind]
        marks.dims.clear()
        marks.gave_up = f"a symbolic trace failed, so this step stays static ({why})"

    def dims(self, kind: str, tensors: list[torch.Tensor], feed_names: Any) -> DynamicDims:
        """The dims this call traces symbolically; under dynamic=None, marks the dims that differ from the first
        compile's. `feed_names` is called only on a step kind's first call and when an int argument is marked."""
        shapes = [tuple(t.shape) for t in tensors]
        if kind not in self._resolved:
            self._resolve_names(kind, shapes, feed_names())
        marks = self.marks[kind]
        carriers = [i for i, t in enumerate(tensors) if is_carrier(t) and i not in marks.dims]
        if carriers:  # an int argument marked since the last call: dim 0 of its carrier, named after it
            names = feed_names()
            marks.dims.update({i: {0: re.sub(r"\W", "_", names[i])} for i in carriers})
        if self.dynamic is None and not marks.gave_up:
            first = self._first.setdefault(kind, shapes)
            if len(first) <= len(shapes):  # carriers come after the tensors of the first call
                for i, (was, now) in enumerate(zip(first, shapes)):
                    if len(was) == len(now) and was != now:
                        marked = marks.dims.setdefault(i, {})
                        for d, (a, b) in enumerate(zip(was, now)):
                            if a != b and d not in marked:
                                marked[d] = DEFAULT_DIM_NAMES.get(d, f"dim{d}")
        return marks
