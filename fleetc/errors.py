"""Exception types users can catch; every message names the problem and where it is."""


class FleetcError(Exception):
    """Base class of every error fleetc raises on purpose."""


class StrategyError(FleetcError, ValueError):
    """A strategy field, config key or value is unknown, of the wrong type, or out of range."""


class CaptureError(FleetcError):
    """The model's training step could not be captured into a static Program."""


class VerificationError(FleetcError):
    """A Program broke an IR invariant; names the op, shows context and the pass that broke it."""


class PassError(FleetcError):
    """A pass could not run on the Program it was given."""


class UnsupportedOptimizerError(FleetcError, TypeError):
    """The optimizer has no Program lowering; lists the supported ones."""


class CheckpointError(FleetcError, ValueError):
    """A trainer state_dict is malformed or does not fit the compiled Program's fleetc-owned state."""


class GuardError(FleetcError, RuntimeError):
    """Something a compiled step assumed (a module's training flag, a hook, an attribute, an input shape) changed
    while recompiling is switched off (`on_guard_failure="error"`); names what changed."""


class CollectiveError(FleetcError, RuntimeError):
    """A collective failed or timed out, or ranks planned different collectives; names the collective and the ranks."""


class PassStrategyError(StrategyError, PassError):
    """A strategy value only a pass can check against the Program (e.g. a recompute checkpoint naming nothing)."""


class CommandError(FleetcError):
    """A problem with a `fleetc` command's inputs: reported as one line, exit status 2."""


class ProgramParseError(FleetcError, ValueError):
    """Program text (`Program.parse`, a pass fixture) is malformed; names the line and what was expected there."""


class ExportError(FleetcError):
    """A model could not be exported for inference: an unknown input or target name, an unwritable directory, an
    unsupported construct; names the problem and where."""


class ExecutionError(FleetcError, RuntimeError):
    """An op failed while a compiled step ran (on any scheduler thread); names the op, its module path and the
    user's source line. The original exception is its `__cause__`."""
