"""kvpipe: stream one LLM request's KV cache from a prefill server to a decode server while
prefill is still running.

A :class:`Sender` (prefill side) and a :class:`Receiver` (decode side) each drive kvpipe's
sans-IO protocol core over a transport: TCP between processes (:meth:`Sender.tcp`,
:meth:`Receiver.tcp`) or memory copies in one process (:func:`mem_pair`).

KV pools are used in place: nothing is copied on the way in, and each pool object is kept
alive while its node exists. A pool is a C-contiguous buffer (a numpy array), a DLPack tensor
(``__dlpack__`` and ``__dlpack_device__``: torch CPU or CUDA tensors, CuPy, JAX) or an object
exposing ``__cuda_array_interface__`` (version 2 or 3, with ``__dlpack_device__`` to name its
GPU). Host memory works on every transport and in every build; CUDA memory is handed to the
node as a device pool, which a wheel built with the ``cuda`` feature serves (device copies in
:func:`mem_pair`, pinned staging or CUDA IPC peer copies over TCP) and a wheel built without it,
or a machine whose CUDA driver does not see the GPU, refuses by name (:class:`TransportError`).
Strides must be C-contiguous, a decode pool must be writable, and a
malformed object raises ``TypeError``, ``ValueError`` or ``BufferError``.

A node made for one rank of a tensor- or pipeline-parallel engine says so with ``tp_size``,
``tp_rank``, ``pp_size`` and ``pp_rank`` (default: the whole model on one rank); each layer
group's ``first_head``/``kv_heads`` must be the heads of its tensor rank, which the
constructor checks. A decode rank registers a request with every prefill rank that writes it
(``writers``); it completes once each has sent its last chunk and its aux data (every prefill
rank calls :meth:`Sender.submit_aux`).

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
    EngineFaultError,
    Event,
    KvpipeError,
    LayerGroup,
    Pool,
    Receiver,
    Sender,
    SessionEndedError,
    TransportError,
    UsageError,
    __version__,
    mem_pair,
    rank_heads,
    tensor_writes_to,
)

__all__ = [
    "MEM_RECEIVER_PEER",
    "MEM_SENDER_PEER",
    "ClosedError",
    "ConfigError",
    "EngineFaultError",
    "Event",
    "KvpipeError",
    "LayerGroup",
    "Pool",
    "Receiver",
    "Sender",
    "SessionEndedError",
    "TransportError",
    "UsageError",
    "__version__",
    "mem_pair",
    "rank_heads",
    "tensor_writes_to",
]
