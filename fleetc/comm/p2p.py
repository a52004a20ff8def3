"""Pipeline point-to-point ops: `fleetc.pipeline_send` / `fleetc.pipeline_recv` between stages, and
`fleetc.pipeline_shared_sum` (the gradient of a parameter several stages hold, e.g. tied embeddings, summed over them).

The ops name peers by pipeline stage and messages by a tag; what carries them is the current `Channel`, set by the
executor around each action (`use_channel`): an in-process mailbox (`LocalChannel`, stages as threads of one
process) or torch.distributed P2P. The channel also knows the micro-batch being run, so one Program serves every
micro-batch. Sends are buffered (the sender never waits), which is the model the schedule simulator checks.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from fleetc.errors import CollectiveError
from fleetc.ir.registry import register_op


class Channel(Protocol):
    """Moves lists of tensors between pipeline stages; `stage` is the caller's, `microbatch` the one running."""

    stage: int
    microbatch: int

    def send(self, peer: int, tag: str, tensors: list[torch.Tensor]) -> None: ...

    def recv(self, peer: int, tag: str, shapes: list, dtypes: list) -> list[torch.Tensor]: ...


class LocalMailbox:
    """The messages of every stage of one process: (sender, receiver, tag, micro-batch) → a queue."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._queues: dict[tuple, queue.Queue] = {}
        self._lock = threading.Lock()

    def queue(self, key: tuple) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault(key, queue.Queue())

    def pending(self) -> list[tuple]:
        """Keys of messages sent and never received."""
        with self._lock:
            return sorted(k for k, q in self._queues.items() if not q.empty())


class LocalChannel:
    """One stage's end of a LocalMailbox (stages run as threads): a send is a hand-off of the tensors themselves."""

    def __init__(self, mailbox: LocalMailbox, stage: int):
        self.mailbox = mailbox
        self.stage = stage
        self.microbatch = -1

    def send(self, peer: int, tag: str, tensors: list[torch.Tensor]) -> None:
        self.mailbox.queue((self.stage, peer, tag, self.microbatch)).put(list(tensors))

    def recv(self, peer: int, tag: str, shapes: list, dtypes: list) -> list[torch.Tensor]:
        try:
            return self.mailbox.queue((peer, self.stage, tag, self.microbatch)).get(timeout=self.mailbox.timeout_s)
        except queue.Empty:
            raise CollectiveError(f"pipeline stage {self.stage} waited {self.mailbox.timeout_s:g}s for {tag!r} of "
                                  f"micro-batch {self.microbatch} from stage {peer}, which never sent it") from None


_CURRENT = threading.local()


def run_local_ranks(ranks: list[int], body: Callable[[int, LocalChannel], None], timeout_s: float,
                    name: str) -> None:
    """Run `body(rank, channel)` for each pipeline rank of this process on its own thread, all sharing one
    mailbox; the first error any of them raised is raised here, once every thread has ended."""
    mailbox = LocalMailbox(timeout_s)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank, LocalChannel(mailbox, rank))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the calling thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"{name}-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def use_channel(channel: Channel) -> Iterator[Channel]:
    """Make `channel` the one the pipeline ops of this thread use."""
    previous = getattr(_CURRENT, "channel", None)
    _CURRENT.channel = channel
    try:
        yield channel
    finally:
        _CURRENT.channel = previous


def current_channel() -> Channel:
    channel = getattr(_CURRENT, "channel", None)
    if channel is None:
        raise CollectiveError("a pipeline send/recv op ran outside a pipeline executor (no channel is set)")
    return channel


@register_op("pipeline_send", "send the listed values to another pipeline stage (buffered: never waits)")
def pipeline_send(tensors: list[torch.Tensor], peer: int, tag: str) -> None:
    current_channel().send(peer, tag, [t.detach() for t in tensors])


@register_op("pipeline_recv", "receive the values another pipeline stage sent under the same tag")
def pipeline_recv(peer: int, tag: str, shapes: list, dtypes: list) -> torch.Tensor | tuple | None:
    """The values in the order sent: one tensor, a tuple of them, or None for an empty message."""
    received = current_channel().recv(peer, tag, shapes, dtypes)
    if [tuple(t.shape) for t in received] != [tuple(s) for s in shapes]:
        raise CollectiveError(f"pipeline message {tag!r} from stage {peer} has shapes "
                              f"{[tuple(t.shape) for t in received]}, expected {[tuple(s) for s in shapes]}")
    return None if not received else received[0] if len(received) == 1 else tuple(received)


@register_op("pipeline_shared_sum", "sum a parameter's gradient over the pipeline stages that hold the parameter")
def pipeline_shared_sum(partial: torch.Tensor, stages: list, tag: str) -> torch.Tensor:
    """Every stage in `stages` sends its part to the others, then adds all parts in stage order, so every copy of
    the parameter gets the same gradient, bit for bit."""
    channel = current_channel()
    for peer in stages:
        if peer != channel.stage:
            channel.send(peer, tag, [partial])
    total = None
    for peer in stages:
        part = partial if peer == channel.stage else channel.recv(peer, tag, [list(partial.shape)],
                                                                   [str(partial.dtype).removeprefix("torch.")])[0]
        total = part.clone() if total is None else total + part
    return total


class DistributedChannel:
    """Pipeline messages over torch.distributed P2P (gloo on CPU, NCCL on GPU), one process per pipeline rank.

    Stage (chunk) s lives on the process `rank_of(s)`. Each tensor of a message travels under its own integer tag,
    derived from the sender and receiver chunks, the message name, the micro-batch and the tensor's index, so
    messages match by tag whatever order the ranks issue them in. Sends are isend (buffered); `finish()` waits for
    them at the end of the step. A receive waits at most `timeout_s`, then raises CollectiveError naming the peer.
    """

    def __init__(self, rank_of, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.rank_of = rank_of
        self.timeout_s = timeout_s
        self.stage = -1
        self.microbatch = -1
        self.waited_s = 0.0  # wall time spent waiting for messages and send completions (the rank's idle time)
        self._pending: list = []

    def _tag(self, sender: int, receiver: int, tag: str, index: int) -> int:
        return zlib.crc32(f"{sender}>{receiver}:{tag}:{self.microbatch}:{index}".encode()) & 0x3FFFFFFF

    def send(self, peer: int, tag: str, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            self._pending.append((peer, self.dist.isend(t.contiguous(), self.rank_of(peer),
                                                        tag=self._tag(self.stage, peer, tag, i))))

    def recv(self, peer: int, tag: str, shapes: list, dtypes: list) -> list[torch.Tensor]:
        out = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            buffer = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
            work = self.dist.irecv(buffer, self.rank_of(peer), tag=self._tag(peer, self.stage, tag, i))
            self._wait(work, f"receiving {tag!r} of micro-batch {self.microbatch} from stage {peer} (rank "
                             f"{self.rank_of(peer)})")
            out.append(buffer)
        return out

    def finish(self) -> None:
        """Wait for every send of the step."""
        pending, self._pending = self._pending, []
        for peer, work in pending:
            self._wait(work, f"sending to stage {peer} (rank {self.rank_of(peer)})")

    def _wait(self, work, what: str) -> None:
        import datetime
        import time

        start = time.perf_counter()
        try:
            finished = work.wait(datetime.timedelta(seconds=self.timeout_s))
            self.waited_s += time.perf_counter() - start
        except RuntimeError as exc:
            raise CollectiveError(f"pipeline stage {self.stage} failed {what} within {self.timeout_s:g} s: the peer "
                                  f"died or hangs ({' '.join(str(exc).split())[:200]})") from None
        if finished is False:
            raise CollectiveError(f"pipeline stage {self.stage} timed out ({self.timeout_s:g} s) {what}")
