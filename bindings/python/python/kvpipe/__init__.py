"""kvpipe: stream one LLM request's KV cache from a prefill server to a decode server while
prefill is still running.

A :class:`Sender` (prefill side) and a :class:`Receiver` (decode side) each drive kvpipe's
sans-IO protocol core over a transport: TCP between processes (:meth:`Sender.tcp`,
:meth:`Receiver.tcp`) or memory copies in one process (:func:`mem_pair`). KV pools are any
objects exporting a C-contiguous buffer (numpy arrays; torch CPU tensors through ``.numpy()``),
used in place: nothing is copied on the way in, and each pool object is kept alive while its
node exists.

The decode side registers a request's destination blocks before prefill starts; the prefill
side submits each chunk as it is computed (its blocks go out at once) and the aux data (first
generated tokens) after the last one. Both sides then see ``completed`` and ``quiesced`` events;
only after ``quiesced`` may the blocks be freed or reused. See
``bindings/python/examples/engine_connector.py`` for an engine's hook points.
"""

from ._kvpipe import (
    MEM_RECEIVER_PEER,
    MEM_SENDER_PEER,
    ClosedError,
    ConfigError,
    Event,
    KvpipeError,
    LayerGroup,
    Pool,
    Receiver,
    Sender,
    TransportError,
    UsageError,
    __version__,
    mem_pair,
)

__all__ = [
    "MEM_RECEIVER_PEER",
    "MEM_SENDER_PEER",
    "ClosedError",
    "ConfigError",
    "Event",
    "KvpipeError",
    "LayerGroup",
    "Pool",
    "Receiver",
    "Sender",
    "TransportError",
    "UsageError",
    "__version__",
    "mem_pair",
]
