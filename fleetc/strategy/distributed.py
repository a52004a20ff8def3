"""DistributedStrategy: Paddle Fleet's strategy object, with every field checked when it is set."""

from __future__ import annotations

import os

from fleetc.strategy import prototxt
from fleetc.strategy.atomic import write_atomically
from fleetc.strategy.fields import DISTRIBUTED
from fleetc.strategy.schema import Schema
from fleetc.strategy.textformat import read_source
from fleetc.strategy.views import BuildStrategy, ExecutionStrategy, FieldView

DISTRIBUTED_SCHEMA = Schema("DistributedStrategy", DISTRIBUTED)


class DistributedStrategy(FieldView, schema=DISTRIBUTED_SCHEMA,
                          object_views={"build_strategy": BuildStrategy, "execution_strategy": ExecutionStrategy}):
    """Which training optimizations to apply and how, as ``paddle.distributed.fleet.DistributedStrategy``.

    Switches are attributes (``strategy.amp = True``); their settings are ``*_configs`` dicts
    (``strategy.amp_configs = {"init_loss_scaling": 128}``). Assigning a dict merges its keys into
    the current settings; reading one gives a copy. ``build_strategy`` and ``execution_strategy``
    are live objects: ``strategy.build_strategy.fuse_bn_act_ops = True`` takes effect, and assigning
    a BuildStrategy copies all its fields. Every assignment is checked (unknown names, types,
    ranges) and a refused one changes nothing. Field meanings and defaults: fleetc.strategy.fields.
    """

    __slots__ = ()

    def save_to_prototxt(self, output: str | os.PathLike[str]) -> None:
        """Write the fields that were set, in Paddle's protobuf text format; the write is atomic."""
        write_atomically(output, prototxt.render(self._record))

    def load_from_prototxt(self, pb_file: str | os.PathLike[str]) -> None:
        """Merge a prototxt file in: its fields overwrite, others keep their values; a bad file changes nothing.

        Unlike protobuf's merge, a repeated field in the file replaces the current list instead of
        extending it.
        """
        text = read_source(pb_file)
        self._record.apply(prototxt.read(self._schema, text, source=os.fspath(pb_file)))
