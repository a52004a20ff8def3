"""Guards: what a compiled Program assumed about the model, optimizer and inputs, recorded and checked every step.

`record.py` is the serialisable record (JSON data, no code), `observe.py` builds it from the live objects after a
compile, `check.py` binds it to them for the cheap per-step check and names what changed. New kinds of guard (shape
guards for dynamic shapes) add a kind to the record and a clause to the check.
"""
from fleetc.runtime.guards.check import GuardCheck
from fleetc.runtime.guards.observe import input_key, observe_guards
from fleetc.runtime.guards.record import Guard, GuardRecord

__all__ = ["Guard", "GuardCheck", "GuardRecord", "input_key", "observe_guards"]
