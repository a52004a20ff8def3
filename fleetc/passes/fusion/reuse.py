"""Fusion matching planned once per distinct repeated block and applied to its copies (issue 25).

A fusion pass visits the global block's ops in order and asks its matcher about each (fusion/match.py). In a
stack of identical blocks (fleetc.ir.block_copies) the n-th question asked at an op's position in one copy has the
same answer, up to renaming, in every copy, provided the matcher only looked inside the block and the copies'
histories agree so far. So the first copy to reach a question records the answer in the reference block's names;
later copies translate it instead of matching.

What keeps a reused answer equal to the one matching would give:
- copies are verified op by op against the reference before the pass (`correspond`);
- while the matcher runs, `Watch` notes whether it looked outside the block: at an op of another block, at a value
  not made or owned by the block, at a fetched value, or at a value some other block reads. Such answers are not
  reused: every copy asks the matcher itself, and a copy whose answer differs from the recorded one leaves reuse.
  Where an answer rests only on whether a value is still needed (`BlockIndex.needed`, which outside readers can
  decide), that yes/no is recorded and checked in the copy instead, and the copy asks the matcher when it differs;
  a copy whose answer then differs from the record follows a history of its own from there (`paths`): its later
  questions share answers only with copies that gave the same answers where it parted;
- every answer is applied for real (`apply_fusion` checks the copy's own readers), and a copy whose applying
  succeeds where the recorder's failed, or the reverse, leaves reuse;
- a fusion that takes ops of a block from outside it, or renames values other blocks read, puts the blocks it
  touches out of reuse.
A copy out of reuse is matched as if reuse did not exist, so the Program is the same either way (tested).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleetc.ir.block_copies import BlockCopies
from fleetc.ir.program import Op, Ref, map_refs

_UNTRANSLATABLE = ("untranslatable",)


class Watch:
    """Whether a matcher, while it ran on one block's op, looked at anything outside that block."""

    def __init__(self, plans: FusionPlans, instance: str):
        self.plans, self.instance = plans, instance
        self.touched = False
        self.facts: list[tuple[str, bool]] = []  # (reference's name, whether the value is needed)

    def name(self, index: Any, name: str) -> None:
        """A value the matcher asked about: outside the block unless the block makes or owns it, nothing outside
        the block reads it, and no fetch needs it."""
        if (name not in self.plans.copies.own_names[self.instance] or name in index.fetched
                or any(self.plans.block_of.get(r.name) != self.instance for r in index.readers.get(name, ()))):
            self.touched = True

    def fact(self, name: str, value: bool) -> None:
        """A yes/no the answer rests on that may depend on readers outside the block (whether a value is still
        needed): recorded, and checked in each copy before the answer is reused there."""
        reference_name = self.plans.copies.to_reference[self.instance].get(name)
        if reference_name is None:
            self.touched = True
        else:
            self.facts.append((reference_name, value))

    def ops(self, ops: list[Op | None]) -> None:
        """Ops the matcher was handed: outside the block unless each is one of the block's."""
        if any(op is not None and self.plans.block_of.get(op.name) != self.instance for op in ops):
            self.touched = True


@dataclass
class _Answer:
    """A recorded answer in the reference block's names; `outcome` is whether applying it succeeded."""

    form: tuple
    rematch: bool
    facts: tuple[tuple[str, bool], ...] = ()
    outcome: bool | None = None


class FusionPlans:
    """Recorded matcher answers per (reference block, question), and which copies still follow them."""

    def __init__(self, copies: BlockCopies):
        self.copies = copies
        self.block_of = dict(copies.block_of)  # grows with the fused ops made inside a block
        self.relative = {slot: (instance, i) for instance, slots in copies.slots.items()
                         for i, slot in enumerate(slots)}
        self.asked: Counter = Counter()
        self.answers: dict[tuple, _Answer] = {}
        self.diverged: set[str] = set()
        self.reused: Counter = Counter()  # instance → answers taken from the record
        self.matched: Counter = Counter()  # instance → answers the matcher gave
        self.pending: tuple[str, tuple] | None = None
        self.paths: dict[str, tuple] = {}  # instance → the answers where it parted from the first record, in order

    def ask(self, index: Any, slot: int, op: Op, question: str, matcher) -> Any:
        """The matcher's answer for `op` at `slot` (None, a Fusion, or a reason): recorded, reused or matched."""
        self.pending = None
        instance = self.block_of.get(op.name)
        if instance is None or instance in self.diverged:
            return matcher()
        if self.relative.get(slot, (None,))[0] != instance:
            self.diverged.add(instance)  # an op standing in another block's slot: not the reference's history
            return matcher()
        relative = self.relative[slot][1]
        self.asked[(instance, question, relative)] += 1
        question_key = (question, relative, self.asked[(instance, question, relative)])
        path = self.paths.get(instance, ())
        key = (self.copies.reference[instance], path, *question_key)
        recorded = self.answers.get(key)
        if recorded is not None and not recorded.rematch and self._facts_hold(index, recorded.facts, instance):
            answer = self._from_reference(index, recorded.form, instance)
            if answer is not _UNTRANSLATABLE:
                self.reused[instance] += 1
                self.pending = (instance, key)
                return answer
            self.diverged.add(instance)
            return matcher()
        index.watch = Watch(self, instance)
        try:
            answer = matcher()
        finally:
            watch, index.watch = index.watch, None
        self.matched[instance] += 1
        form = self._to_reference(index, answer, instance)
        if recorded is not None and form != recorded.form:
            if form is _UNTRANSLATABLE:
                self.diverged.add(instance)
                return answer
            # another answer than the record's (a yes/no it rested on differs here): from now on this copy follows
            # the history of the copies that gave this same answer here
            path = self.paths[instance] = (*path, (*question_key, repr(form)))
            key = (self.copies.reference[instance], path, *question_key)
            recorded = self.answers.get(key)
        if recorded is None:
            self.answers[key] = _Answer(form, watch.touched or form is _UNTRANSLATABLE, tuple(watch.facts))
        self.pending = (instance, key)
        return answer

    def _facts_hold(self, index: Any, facts: tuple, instance: str) -> bool:
        names = self.copies.from_reference[instance]
        return all(name in names and index.needed(names[name]) == value for name, value in facts)

    def before_apply(self, index: Any, fusion: Any) -> None:
        """Put out of reuse the blocks this fusion reaches into from outside: group members of another block,
        and readers of renamed values in another block."""
        instance = self.pending[0] if self.pending else None
        touched = {self.block_of.get(op.name) for op in fusion.group}
        for old in fusion.rename:
            touched |= {self.block_of.get(r.name) for r in index.readers.get(old, ())}
        touched.discard(None)
        if touched - {instance}:
            self.diverged |= touched | ({instance} if instance else set())

    def after_apply(self, fusion: Any, applied: bool) -> None:
        """Compare the outcome with the recorded one; a fused op made inside a block belongs to it."""
        if self.pending is None:
            return
        instance, key = self.pending
        self.pending = None
        if instance in self.diverged:
            return
        recorded = self.answers[key]
        if recorded.outcome is None:
            recorded.outcome = applied
        elif recorded.outcome != applied:
            self.diverged.add(instance)
        if applied:
            self.block_of[fusion.fused.name] = instance

    def _to_reference(self, index: Any, answer: Any, instance: str) -> Any:
        """The answer in the reference block's names and the block's relative op positions."""
        if answer is None:
            return ("none",)
        names = self.copies.to_reference[instance]
        if isinstance(answer, str):  # why a backward group cannot fuse: reusable unless it names the block's things
            block_ops = (op.name for op in self.copies.ops[instance])
            named = any(n in answer for n in names) or any(n in answer for n in block_ops)
            return _UNTRANSLATABLE if named else ("reason", answer)
        positions = []
        for op in answer.group:
            at = index.position.get(op.name)
            if self.block_of.get(op.name) != instance or self.relative.get(at, (None,))[0] != instance:
                return _UNTRANSLATABLE
            positions.append((self.relative[at][1], op.type))
        if answer.fused.attrs:
            return _UNTRANSLATABLE  # matchers leave attrs to apply_fusion; one that does not is matched each time
        try:
            return ("fusion", tuple(positions), *_op_form(answer.fused, names),
                    tuple(sorted((names[a], names[b]) for a, b in answer.rename.items())))
        except KeyError:
            return _UNTRANSLATABLE

    def _from_reference(self, index: Any, form: tuple, instance: str) -> Any:
        """The recorded answer in `instance`'s names and ops; _UNTRANSLATABLE when the ops are not there."""
        from fleetc.passes.fusion.match import Fusion

        if form[0] == "none":
            return None
        if form[0] == "reason":
            return form[1]
        _, positions, name, op_type, args, kwargs, outputs, rename = form
        slots = self.copies.slots[instance]
        group = []
        for relative, member_type in positions:
            op = index.slots[slots[relative]]
            if op is None or op.type != member_type or self.block_of.get(op.name) != instance:
                return _UNTRANSLATABLE
            group.append(op)
        names = self.copies.from_reference[instance]
        try:
            fused = Op(name, op_type, *_renamed((args, kwargs, list(outputs)), names))
            return Fusion(group, fused, {names[a]: names[b] for a, b in rename})
        except KeyError:
            return _UNTRANSLATABLE

    def lines(self) -> list[str]:
        """`30 of 31 blocks like encoder.layers.1 reused one plan (90 matcher answers matched, 2700 reused)`, one
        line per group of identical blocks, naming the blocks that left reuse and were matched on their own."""
        result = []
        for reference in self.copies.references():
            members = self.copies.members(reference)
            reused = [m for m in members if m != reference and self.reused[m] and m not in self.diverged]
            left = [m for m in members if m in self.diverged]
            answers = (sum(self.matched[m] for m in members), sum(self.reused[m] for m in members))
            line = (f"{len(reused)} of {len(members)} blocks like {reference} reused one plan "
                    f"({answers[0]} matcher answers matched, {answers[1]} reused)")
            if left:
                line += f" ({len(left)} matched on their own: {', '.join(left[:3])}{'…' if len(left) > 3 else ''})"
            parted = [m for m in members if self.paths.get(m) and m not in self.diverged]
            if parted:
                line += (f" ({len(parted)} gave answers of their own at some questions and followed those: "
                         f"{', '.join(parted[:3])}{'…' if len(parted) > 3 else ''})")
            result.append(line)
        return result


def _op_form(op: Op, names: dict[str, str]) -> tuple:
    """(name, type, args, kwargs, outputs) of a matcher's fused op with its values renamed by `names`."""
    args, kwargs, outputs = _renamed((op.args, op.kwargs, list(op.outputs)), names)
    return op.name, op.type, args, kwargs, tuple(outputs)


def _renamed(value: tuple, names: dict[str, str]) -> tuple:
    """`(args, kwargs, outputs)` with Refs and output names mapped through `names` (KeyError when one is missing)."""
    args, kwargs, outputs = value
    rename = lambda ref: Ref(names[ref.name])
    return (map_refs(args, rename), map_refs(kwargs, rename),
            [None if name is None else names[name] for name in outputs])
