"""CUDA events as DeepEP passes them (EventHandle, EventOverlap) and _OnComm, the scope in which
every Buffer call runs on the Buffer's communication stream."""

from . import _base
from ._base import _usage


class EventHandle:
    """DeepEP's deep_ep.utils.EventHandle: a CUDA event recorded on the current stream when it is
    created (Megatron's fused_a2a passes EventOverlap(EventHandle()) as previous_event). `event` is
    the torch.cuda.Event."""

    def __init__(self):
        torch = _base._torch()
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self):
        _base._torch().cuda.current_stream().wait_event(self.event)


def _cuda_event(event):
    """The torch.cuda.Event of an EventOverlap's `event` (a torch.cuda.Event or an EventHandle)."""
    return event.event if isinstance(event, EventHandle) else event


class EventOverlap:
    """DeepEP's event wrapper: `event` (a torch.cuda.Event or an EventHandle, or None when the call
    already made the caller's stream wait), `current_stream_wait()`, and use as a context manager
    (`with ev:` runs the block, then makes the current stream wait). extra_tensors are kept alive
    with it."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        """The current stream waits for the event. A None event (the call was not async) needs no
        wait: the caller's stream was already ordered after the work."""
        if self.event is not None:
            _base._torch().cuda.current_stream().wait_event(_cuda_event(self.event))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


class _OnComm:
    """The Buffer's communication stream for one call: it waits for previous_event (or the caller's
    stream) first, so everything the call enqueues, its own input copies (stage()) included, is
    ordered after that; outputs are allocated on the caller's stream unless
    allocate_on_comm_stream; at the end the caller's stream waits (async_finish=False) or an event
    is returned. With previous_event the comm stream does not wait for the caller's stream (as in
    DeepEP): the inputs must be ready when the event is; the adapter's own work on them (making
    them contiguous) therefore runs on the comm stream after the wait, never on the caller's stream
    where the event would not cover it. Inputs and outputs are record_stream'ed only with
    async_finish (as DeepEP): without it the caller's stream waits for the comm stream before the
    call returns, so whatever the caller later does with them on its stream, freeing included, is
    ordered after the comm stream's work."""

    def __init__(self, buf, previous_event, async_finish, allocate_on_comm_stream, inputs=()):
        self.torch = _base._torch()
        self.buf = buf
        self.previous_event = previous_event
        self.async_finish = bool(async_finish)
        self.alloc_on_comm = bool(allocate_on_comm_stream)
        self.inputs = [t for t in inputs if t is not None]
        self.outputs = []
        self.event = None

    def __enter__(self):
        torch = self.torch
        self.compute = torch.cuda.current_stream(self.buf._device)
        self.comm = self.buf._comm_stream
        if self.previous_event is not None and self.previous_event.event is not None:
            self.comm.wait_event(_cuda_event(self.previous_event.event))
        else:
            self.comm.wait_stream(self.compute)
        self._guard = torch.cuda.stream(self.comm)
        self._guard.__enter__()
        return self

    def stage(self, t):
        """`t` as the op reads it (contiguous), enqueued on the comm stream after the wait; the
        caller's tensor is kept for record_stream. None stays None."""
        if t is None:
            return None
        self.inputs.append(t)
        return t.contiguous()

    def empties(self, *specs):
        """Fresh output tensors, one per (shape, dtype) spec (a None spec gives None), allocated
        on the caller's stream (one stream switch for all) unless allocate_on_comm_stream."""
        torch, dev = self.torch, self.buf._device

        def make():
            return [None if s is None else torch.empty(s[0], dtype=s[1], device=dev) for s in specs]

        if self.alloc_on_comm:
            outs = make()
        else:
            with torch.cuda.stream(self.compute):
                outs = make()
        self.outputs.extend(t for t in outs if t is not None)
        return outs

    def empty(self, shape, dtype):
        return self.empties((shape, dtype))[0]

    def __exit__(self, exc_type, exc, tb):
        self._guard.__exit__(exc_type, exc, tb)
        if exc_type is not None or not self.async_finish:
            self.compute.wait_stream(self.comm)
            if exc_type is None:
                self.event = EventOverlap(None)
            return False
        if not self.torch.cuda.is_current_stream_capturing():  # a graph's memory lives with the graph
            for t in self.inputs:  # freed by the caller before the comm stream is done with them
                t.record_stream(self.comm)
            for t in self.outputs:
                t.record_stream(self.compute if self.alloc_on_comm else self.comm)
        ev = self.torch.cuda.Event()
        ev.record(self.comm)
        self.event = EventOverlap(ev, self.inputs + self.outputs)
        return False


def _check_events(previous_event, async_finish, allocate_on_comm_stream, what):
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise _usage(f"{what}: previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise _usage(f"{what}: allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)")
