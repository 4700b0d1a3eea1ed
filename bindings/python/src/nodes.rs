//! The node classes: `Sender` (prefill side) and `Receiver` (decode side), and `mem_pair`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpipe::{mem_pair as embed_mem_pair, EmbedError, Node, NodeConfig, Role, TcpDataPath};
use kvpipe_core::session::{Registration, SendRequest};
use kvpipe_core::wire::AuxData;
use kvpipe_core::{
    AnchoredRun, ChunkSpec, InstanceId, PeerId, Receiver as CoreReceiver, RequestId,
    Sender as CoreSender,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arguments::{self, aux, chunk, ids, layer_range};
use crate::errors::{to_py, EngineFaultError};
use crate::event::Event;
use crate::layout::{deadlines, layout, LayerGroup};
use crate::pools::{pools, Pools};
use crate::source::PySource;
use crate::topology::RankPlace;

/// Longest stretch a blocking wait runs without checking for Ctrl-C.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The TCP data path a ``data_path`` argument names.
fn tcp_data_path(name: &str) -> PyResult<TcpDataPath> {
    match name {
        "socket" => Ok(TcpDataPath::Socket),
        "auto" => Ok(TcpDataPath::Auto),
        "peer_copy" => Ok(TcpDataPath::PeerCopy),
        _ => Err(PyValueError::new_err(format!(
            "data_path must be \"socket\", \"auto\" or \"peer_copy\", got {name:?}"
        ))),
    }
}

/// A node's configuration from its constructor's arguments (`connections` as
/// [`arguments::connections`] converts it: 1 to 255).
fn config(
    groups: &[PyRef<'_, LayerGroup>],
    connections: usize,
    given: Option<&Bound<'_, PyDict>>,
    instance: Option<u64>,
    place: RankPlace,
    layer_order: Option<&Bound<'_, PyAny>>,
) -> PyResult<NodeConfig> {
    let mut c = NodeConfig::new(layout(groups));
    c.topology = place.topology(&c.layout)?;
    c.deadlines = deadlines(given)?;
    c.instance = instance.map(InstanceId);
    c.tcp.connections_per_peer = connections;
    if let Some(order) = layer_order {
        c.layer_order = arguments::layer_order(order)?;
    }
    Ok(c)
}

fn seconds(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout).map_err(|_| {
        PyValueError::new_err(format!(
            "a timeout is a non-negative number of seconds, got {timeout}"
        ))
    })
}

fn next_event<E: Role>(py: Python<'_>, node: &Node<E>, timeout: f64) -> PyResult<Option<Event>> {
    // A timeout too long to add to the clock (``float("inf")`` among them) waits until an
    // event comes.
    let wait = if timeout == f64::INFINITY {
        Duration::MAX
    } else {
        seconds(timeout)?
    };
    let deadline = Instant::now().checked_add(wait);
    loop {
        let left = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        let event = py
            .detach(|| node.next_event(left.min(SIGNAL_SLICE)))
            .map_err(to_py)?;
        if let Some(event) = event {
            return Ok(Some(event.into()));
        }
        py.check_signals()?;
        if left <= SIGNAL_SLICE {
            return Ok(None);
        }
    }
}

/// The node's counters, read with the GIL released: the node's lock may be held by a thread
/// that waits for the GIL (a block source written in Python).
fn counters<E: Role>(py: Python<'_>, node: &Node<E>) -> PyResult<HashMap<&'static str, u64>> {
    let c = run(py, || node.counters())?;
    Ok(HashMap::from([
        ("bytes_planned", c.bytes_planned),
        ("bytes_written", c.bytes_written),
        ("bytes_landed", c.bytes_landed),
        ("slices", c.slices),
        ("write_batches", c.write_batches),
        ("completions", c.completions),
        ("failures", c.failures.total()),
        ("timeouts", c.timeouts),
        ("cancellations", c.cancellations),
        ("quiesced", c.quiesced),
        ("retirements", c.retirements),
        ("protocol_errors", c.protocol_errors),
        ("writes_refused", c.writes_refused),
        ("late_writes", c.late_writes),
        ("blocks_pinned", c.blocks_pinned),
        ("blocks_released", c.blocks_released),
    ]))
}

fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, EmbedError> + Send) -> PyResult<T> {
    py.detach(f).map_err(to_py)
}

/// A prefill-side node: kvpipe's core sender over a transport. Open a request naming its
/// decode peers, submit each prefill chunk as it is computed (its blocks are written to every
/// peer that registered), then the aux data; read events with :meth:`next_event`.
///
/// Made by :meth:`Sender.tcp` or :func:`mem_pair`. Methods release the GIL while they work; a
/// node may be used from several threads.
#[pyclass(frozen, module = "kvpipe")]
pub(crate) struct Sender {
    node: Node<CoreSender>,
    _pools: Arc<Vec<Pools>>,
}

/// A decode-side node: kvpipe's core receiver over a transport. Register each request's
/// destination blocks and writers before its prefill starts; every incoming write is admitted
/// against that registration before a byte lands. Read events with :meth:`next_event`.
///
/// Made by :meth:`Receiver.tcp` or :func:`mem_pair`.
#[pyclass(frozen, module = "kvpipe")]
pub(crate) struct Receiver {
    node: Node<CoreReceiver>,
    _pools: Arc<Vec<Pools>>,
}

#[pymethods]
impl Sender {
    /// A prefill node over TCP. ``layout`` is the KV cache's layer groups; ``pools`` maps each
    /// region id the pools name to its memory, read in place and kept alive while the node
    /// exists: a C-contiguous buffer (a numpy array), a DLPack tensor (a torch tensor) or a
    /// ``__cuda_array_interface__`` array. ``connections``: sockets per peer (this side
    /// connects); ``deadlines``: ``{name: seconds}`` over the core's defaults; ``instance``: the
    /// handshake's instance id (default: from the process id and clock). ``tp_size``,
    /// ``tp_rank``, ``pp_size``, ``pp_rank``: this rank's place in the parallel topology
    /// (default: the whole model on one rank); each layer group's heads must be those of
    /// ``tp_rank``, or ``ValueError`` says which. ``data_path``: how KV bytes reach the decode
    /// node's pools: ``"socket"`` (the default; GPU pools through pinned staging),
    /// ``"peer_copy"`` (CUDA IPC: this node offers its exported GPU pools in its handshake and
    /// the decode process copies device to device straight from them into its own, control
    /// frames still over TCP; both sides' pools on GPUs of one host, a wheel built with the
    /// ``cuda`` feature, this side connecting; ``connect`` raises with the reason otherwise) or
    /// ``"auto"`` (peer copies where the decode node accepts them, else the socket); with
    /// either, ``connect`` returns once the decode node answered the offer (within the
    /// preamble deadline, else it raises). ``layer_order``: the group index of each of the
    /// rank's layers in the order the engine computes them, which the ``layers`` of
    /// :meth:`submit_chunk` index (default ``None``: the groups one after the other); a model
    /// whose groups interleave lists it. An empty order is not the default: it raises
    /// ``ValueError``, as does an index that is negative or past 65535 (``TypeError``: not a
    /// sequence of integers); one that does not fit the layout raises :class:`ConfigError`.
    #[staticmethod]
    #[pyo3(signature = (
        layout, pools, *, connections = 2, deadlines = None, instance = None, tp_size = 1,
        tp_rank = 0, pp_size = 1, pp_rank = 0, data_path = "socket", layer_order = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn tcp(
        layout: Vec<PyRef<'_, LayerGroup>>,
        pools: &Bound<'_, PyDict>,
        #[pyo3(from_py_with = arguments::connections)] connections: usize,
        deadlines: Option<&Bound<'_, PyDict>>,
        #[pyo3(from_py_with = ids::instance)] instance: Option<u64>,
        tp_size: i64,
        tp_rank: i64,
        pp_size: i64,
        pp_rank: i64,
        data_path: &str,
        layer_order: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let place = RankPlace {
            tp_size,
            tp_rank,
            pp_size,
            pp_rank,
        };
        let mut c = config(
            &layout,
            connections,
            deadlines,
            instance,
            place,
            layer_order,
        )?;
        c.tcp.data_path = tcp_data_path(data_path)?;
        let (regions, held) = self::pools(pools, false)?;
        // SAFETY: the buffers stay exported (held) as long as the node: `_pools` is declared
        // after `node`, so the node and its threads are gone before a buffer is released.
        let node = unsafe { Node::<CoreSender>::tcp(&c, &regions) }.map_err(to_py)?;
        Ok(Sender {
            node,
            _pools: Arc::new(vec![held]),
        })
    }

    /// The transport: ``"tcp"`` or ``"mem"``.
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<&'static str> {
        run(py, || self.node.transport())
    }

    /// Accepts peers on ``addr`` (``"127.0.0.1:0"`` picks a free port); returns the port.
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<u16> {
        run(py, || self.node.listen(addr)).map(|a| a.port())
    }

    /// Connects to a decode node listening at ``addr`` (``"host:port"``); returns the peer id
    /// this node gives it. A ``"peer_ready"`` (or ``"peer_rejected"``) event follows.
    fn connect(&self, py: Python<'_>, addr: &str) -> PyResult<u32> {
        run(py, || self.node.connect(addr)).map(|p| p.0)
    }

    /// The next event, waiting up to ``timeout`` seconds; ``None`` if none came.
    #[pyo3(signature = (timeout = 0.0))]
    fn next_event(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Event>> {
        next_event(py, &self.node, timeout)
    }

    /// Whether the handshake with ``peer`` completed.
    fn is_peer_ready(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::peer)] peer: u32,
    ) -> PyResult<bool> {
        run(py, || self.node.is_peer_ready(PeerId(peer)))
    }

    /// The core's counters (``bytes_written``, ``completions``, ``failures``, …).
    fn counters(&self, py: Python<'_>) -> PyResult<HashMap<&'static str, u64>> {
        counters(py, &self.node)
    }

    /// Requests held: opened and not retired yet.
    fn session_count(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, || self.node.session_count())
    }

    /// Opens ``request`` before its first chunk, naming the decode peers it is written to.
    fn open_request(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
        #[pyo3(from_py_with = ids::receivers)] receivers: Vec<u32>,
    ) -> PyResult<()> {
        let req = SendRequest::new(RequestId(request), receivers.into_iter().map(PeerId));
        run(py, || self.node.open_request(req))
    }

    /// Submits the prefill chunk ``[start, end)`` of ``request`` just computed; its blocks go
    /// to every decode peer that registered. ``blocks`` answers the core's bounded queries:
    /// either a sequence of per-group block tables (entry ``o`` is the slot of block ordinal
    /// ``o``; negative or ``None``: not resident) or a callable
    /// ``blocks(request, group, begin, end) -> (first_ordinal, ids)`` returning the run of
    /// resident blocks ending at ``end`` (called with the node unlocked; the chunk is checked
    /// again when its answers are applied). ``is_last`` defaults to ``end == prompt_len``.
    /// ``start``, ``end``, ``prompt_len`` and ``prepopulated_len`` are integers from 0 to
    /// 2**32 - 1; another value raises ``ValueError`` (``TypeError``: not an integer) naming it.
    ///
    /// ``layers=(begin, end)`` submits only those layers of the chunk, as soon as the engine
    /// has computed them (vLLM's ``save_kv_layer``): layers count the rank's layers in compute
    /// order (``layer_order``; by default the layer groups one after the other) up to
    /// :meth:`layer_count`. A chunk's ranges come in order with the same chunk arguments, the
    /// first from layer 0, each from where the previous one ended, the last to
    /// :meth:`layer_count`; only the first calls ``blocks``. Each range is a slice of its own.
    /// A ``layers`` that is not a tuple raises ``TypeError``, one not of two integers from 0
    /// to 2**32 - 1 ``TypeError`` or ``ValueError`` naming the item; a range that breaks the
    /// rules above raises :class:`UsageError`. Either way nothing changes.
    ///
    /// ``after=stream`` (a ``torch.cuda.Stream``, or any object with integer ``cuda_stream``
    /// and ``device_index``) hands the chunk (range) over while the GPU may still be computing
    /// it, as vLLM calls ``save_kv_layer``: a fence is recorded behind the work queued on that
    /// stream so far. Over ``mem`` the copies wait for it on the GPU and the call returns at
    /// once; over ``tcp`` and ``verbs`` the call waits for it first (at most 60 s). Another
    /// object raises ``TypeError``; a build without GPU support, a GPU the driver does not
    /// see, or (over ``tcp`` and ``verbs``) work before the fence that failed raises
    /// :class:`TransportError`, with nothing submitted. Over ``mem`` such a failure fails the
    /// range's copies, and the request, as a failed write does.
    ///
    /// Returns the slice id, or ``None`` when the chunk (range) writes nothing. Leave the
    /// blocks unchanged until the request's ``"quiesced"`` event.
    #[pyo3(signature = (
        request, start, end, prompt_len, blocks, *, prepopulated_len = 0, is_last = None,
        prefix_sent_early = false, layers = None, after = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn submit_chunk(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
        #[pyo3(from_py_with = chunk::start)] start: u32,
        #[pyo3(from_py_with = chunk::end)] end: u32,
        #[pyo3(from_py_with = chunk::prompt_len)] prompt_len: u32,
        blocks: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = chunk::prepopulated_len)] prepopulated_len: u32,
        is_last: Option<bool>,
        prefix_sent_early: bool,
        layers: Option<&Bound<'_, PyAny>>,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u32>> {
        let layers = layers.map(layer_range).transpose()?;
        let after = after.map(crate::fence::after).transpose()?;
        let spec = ChunkSpec {
            start,
            end,
            prompt_len,
            prepopulated_len,
            is_last: is_last.unwrap_or(end == prompt_len),
            prefix_sent_early,
        };
        let mut source = PySource::new(blocks);
        let request = RequestId(request);
        let result = py.detach(|| match (layers, after) {
            (Some(layers), None) => {
                self.node
                    .submit_chunk_layers(request, spec, layers, &mut source)
            }
            (None, None) => self.node.submit_chunk(request, spec, &mut source),
            #[cfg(feature = "cuda")]
            (Some(layers), Some(after)) => {
                self.node
                    .submit_chunk_layers_after(request, spec, layers, &mut source, &after)
            }
            #[cfg(feature = "cuda")]
            (None, Some(after)) => self
                .node
                .submit_chunk_after(request, spec, &mut source, &after),
            #[cfg(not(feature = "cuda"))]
            (_, Some(never)) => match never {},
        });
        if let Some(e) = source.error {
            return Err(e);
        }
        submitted(result.map_err(to_py)?)
    }

    /// The rank's layers (every layer group's): a chunk submitted in ``layers`` ranges ends
    /// with the range that reaches it.
    fn layer_count(&self, py: Python<'_>) -> PyResult<u32> {
        run(py, || self.node.layer_count())
    }

    /// Sends the cached prefix (``prepopulated_len`` tokens) of ``request`` before its first
    /// chunk; its chunks then pass ``prefix_sent_early=True``. ``blocks`` as in
    /// :meth:`submit_chunk`. Returns the slice id, or ``None`` when the prefix fills no block.
    fn submit_prefix(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
        #[pyo3(from_py_with = chunk::prompt_len)] prompt_len: u32,
        #[pyo3(from_py_with = chunk::prepopulated_len)] prepopulated_len: u32,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let mut source = PySource::new(blocks);
        let result = py.detach(|| {
            self.node.submit_prefix(
                RequestId(request),
                prompt_len,
                prepopulated_len,
                &mut source,
            )
        });
        if let Some(e) = source.error {
            return Err(e);
        }
        submitted(result.map_err(to_py)?)
    }

    /// Submits the aux data of ``request`` (the first generated token(s), draft tokens and
    /// counts), carried inline after its KV; the transfer completes only with it. Aux data at
    /// or after the request's aux deadline (``aux_wait`` after the last chunk) times the
    /// request out (a ``timed_out`` event waiting for aux) and raises ``UsageError`` (the
    /// request already ended).
    #[pyo3(signature = (request, first_tokens, *, prompt_tokens = 0, cached_tokens = 0, draft_tokens = Vec::new()))]
    fn submit_aux(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
        #[pyo3(from_py_with = aux::first_tokens)] first_tokens: Vec<u32>,
        #[pyo3(from_py_with = aux::prompt_tokens)] prompt_tokens: u32,
        #[pyo3(from_py_with = aux::cached_tokens)] cached_tokens: u32,
        #[pyo3(from_py_with = aux::draft_tokens)] draft_tokens: Vec<u32>,
    ) -> PyResult<()> {
        let aux = AuxData {
            prompt_tokens,
            cached_tokens,
            first_tokens,
            draft_tokens,
        };
        run(py, || self.node.submit_aux(RequestId(request), aux))
    }

    /// Cancels ``request`` in any phase (one not opened yet is cancelled when it is).
    fn cancel(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
    ) -> PyResult<()> {
        run(py, || self.node.cancel(RequestId(request)))
    }

    /// Retires ``request`` after its ``"quiesced"`` event; its id is never used again.
    fn retire(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
    ) -> PyResult<()> {
        run(py, || self.node.retire(RequestId(request)))
    }

    /// Closes the node: over TCP every peer in order (what was queued reaches it first),
    /// waiting at most ``timeout`` seconds. Later calls raise :class:`ClosedError`.
    #[pyo3(signature = (timeout = 10.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let within = seconds(timeout)?;
        run(py, || self.node.close(within))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.node.transport().is_ok() {
            run(py, || self.node.close(Duration::from_secs(10)))?;
        }
        Ok(false)
    }
}

/// The anchored runs of a registration's ``blocks``: one ``(first_ordinal, ids)`` per group.
fn anchored_runs(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<AnchoredRun>> {
    let mut runs = Vec::new();
    for (g, item) in blocks.try_iter()?.enumerate() {
        let (first, ids) = arguments::block_run(
            &item?,
            &format!("blocks[{g}]"),
            "each group's blocks are (first_ordinal, ids): the ordinal of ids[0] is given, never \
             inferred",
        )?;
        runs.push(AnchoredRun::from_ids(first, &ids));
    }
    Ok(runs)
}

#[pymethods]
impl Receiver {
    /// A decode node over TCP. ``pools`` maps region ids to writable memory the received KV
    /// lands in, in place (as in :meth:`Sender.tcp`; a read-only pool is refused); the rest as
    /// :meth:`Sender.tcp` (``connections`` applies when this side connects). ``data_path``
    /// ``"peer_copy"`` or ``"auto"`` takes peer copies (CUDA IPC) from prefill nodes that offer
    /// them in their handshake when they connect here: accepted when this node's pools are GPU
    /// memory that can open the offered ones (one host), each write then copied device to
    /// device from the prefill pools into this node's, else declined with the reason (the
    /// prefill node stays on the socket, unless either side asked for ``"peer_copy"``: the
    /// prefill node's ``connect`` raises, or this node closes the connection); with
    /// ``"peer_copy"``, ``listen`` raises when this node cannot take peer copies at all (host
    /// memory pools, no ``cuda`` feature).
    #[staticmethod]
    #[pyo3(signature = (
        layout, pools, *, connections = 2, deadlines = None, instance = None, tp_size = 1,
        tp_rank = 0, pp_size = 1, pp_rank = 0, data_path = "socket"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn tcp(
        layout: Vec<PyRef<'_, LayerGroup>>,
        pools: &Bound<'_, PyDict>,
        #[pyo3(from_py_with = arguments::connections)] connections: usize,
        deadlines: Option<&Bound<'_, PyDict>>,
        #[pyo3(from_py_with = ids::instance)] instance: Option<u64>,
        tp_size: i64,
        tp_rank: i64,
        pp_size: i64,
        pp_rank: i64,
        data_path: &str,
    ) -> PyResult<Self> {
        let place = RankPlace {
            tp_size,
            tp_rank,
            pp_size,
            pp_rank,
        };
        let mut c = config(&layout, connections, deadlines, instance, place, None)?;
        c.tcp.data_path = tcp_data_path(data_path)?;
        let (regions, held) = self::pools(pools, true)?;
        // SAFETY: as in `Sender::tcp`.
        let node = unsafe { Node::<CoreReceiver>::tcp(&c, &regions) }.map_err(to_py)?;
        Ok(Receiver {
            node,
            _pools: Arc::new(vec![held]),
        })
    }

    /// The transport: ``"tcp"`` or ``"mem"``.
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<&'static str> {
        run(py, || self.node.transport())
    }

    /// Accepts peers on ``addr`` (``"127.0.0.1:0"`` picks a free port); returns the port.
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<u16> {
        run(py, || self.node.listen(addr)).map(|a| a.port())
    }

    /// Connects to a prefill node listening at ``addr``; returns the peer id.
    fn connect(&self, py: Python<'_>, addr: &str) -> PyResult<u32> {
        run(py, || self.node.connect(addr)).map(|p| p.0)
    }

    /// The next event, waiting up to ``timeout`` seconds; ``None`` if none came.
    #[pyo3(signature = (timeout = 0.0))]
    fn next_event(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Event>> {
        next_event(py, &self.node, timeout)
    }

    /// Whether the handshake with ``peer`` completed.
    fn is_peer_ready(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::peer)] peer: u32,
    ) -> PyResult<bool> {
        run(py, || self.node.is_peer_ready(PeerId(peer)))
    }

    /// The core's counters (``bytes_written``, ``bytes_landed``, ``writes_refused``, …).
    fn counters(&self, py: Python<'_>) -> PyResult<HashMap<&'static str, u64>> {
        counters(py, &self.node)
    }

    /// Requests held: registered and not retired yet.
    fn session_count(&self, py: Python<'_>) -> PyResult<usize> {
        run(py, || self.node.session_count())
    }

    /// Registers the destination of ``request`` before its prefill starts: ``blocks`` holds
    /// one ``(first_ordinal, ids)`` per layer group (block ordinal ``first_ordinal + i`` lands
    /// in slot ``ids[i]``; blocks this side holds already are left out), ``writers`` the
    /// prefill peers that write it. Returns the registration's id.
    #[pyo3(signature = (request, prompt_len, blocks, writers, *, aux_capacity = 1024))]
    fn register(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
        #[pyo3(from_py_with = chunk::prompt_len)] prompt_len: u32,
        blocks: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = ids::writers)] writers: Vec<u32>,
        #[pyo3(from_py_with = aux::aux_capacity)] aux_capacity: u32,
    ) -> PyResult<u32> {
        let reg = Registration {
            request: RequestId(request),
            prompt_len,
            groups: anchored_runs(blocks)?,
            writers: writers.into_iter().map(PeerId).collect(),
            aux_capacity,
            expected_part: None,
        };
        run(py, || self.node.register(reg)).map(|s| s.0)
    }

    /// Cancels ``request`` in any phase (one not registered yet is cancelled when it is).
    fn cancel(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
    ) -> PyResult<()> {
        run(py, || self.node.cancel(RequestId(request)))
    }

    /// Retires ``request`` after its ``"quiesced"`` event.
    fn retire(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = ids::request)] request: u64,
    ) -> PyResult<()> {
        run(py, || self.node.retire(RequestId(request)))
    }

    /// Closes the node (see :meth:`Sender.close`).
    #[pyo3(signature = (timeout = 10.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let within = seconds(timeout)?;
        run(py, || self.node.close(within))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.node.transport().is_ok() {
            run(py, || self.node.close(Duration::from_secs(10)))?;
        }
        Ok(false)
    }
}

/// A prefill and a decode node connected in this process (memory copies on the transport's
/// copy threads). The handshake completes as the nodes are polled; the prefill node names the
/// decode node :data:`MEM_RECEIVER_PEER`, the decode node names it :data:`MEM_SENDER_PEER`.
/// Each side's pools are kept alive until both nodes are gone. Both nodes hold the whole model
/// (one rank each); tensor- and pipeline-parallel ranks are placed with :meth:`Sender.tcp`'s
/// ``tp_*``/``pp_*`` arguments. ``layer_order`` is the prefill node's (see :meth:`Sender.tcp`).
#[pyfunction]
#[pyo3(signature = (
    sender_layout, sender_pools, receiver_layout, receiver_pools, *, deadlines = None,
    layer_order = None
))]
pub(crate) fn mem_pair(
    sender_layout: Vec<PyRef<'_, LayerGroup>>,
    sender_pools: &Bound<'_, PyDict>,
    receiver_layout: Vec<PyRef<'_, LayerGroup>>,
    receiver_pools: &Bound<'_, PyDict>,
    deadlines: Option<&Bound<'_, PyDict>>,
    layer_order: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Sender, Receiver)> {
    let s = config(
        &sender_layout,
        1,
        deadlines,
        None,
        RankPlace::default(),
        layer_order,
    )?;
    let r = config(
        &receiver_layout,
        1,
        deadlines,
        None,
        RankPlace::default(),
        None,
    )?;
    let (s_regions, s_held) = pools(sender_pools, false)?;
    let (r_regions, r_held) = pools(receiver_pools, true)?;
    // SAFETY: both nodes hold both sides' buffers (`_pools`, dropped after `node`), so no
    // buffer is released while the pair, which lives until both nodes are gone, can use it.
    let (tx, rx) = unsafe { embed_mem_pair(&s, &s_regions, &r, &r_regions) }.map_err(to_py)?;
    let held = Arc::new(vec![s_held, r_held]);
    Ok((
        Sender {
            node: tx,
            _pools: held.clone(),
        },
        Receiver {
            node: rx,
            _pools: held,
        },
    ))
}

/// A submission's outcome as Python sees it: the slice id, `None` when nothing was sent, or
/// [`EngineFaultError`] when the engine's answer failed the request.
fn submitted(outcome: kvpipe::Submitted) -> PyResult<Option<u32>> {
    match outcome {
        kvpipe::Submitted::Slice(slice) => Ok(Some(slice.0)),
        kvpipe::Submitted::Nothing => Ok(None),
        kvpipe::Submitted::EngineFault(fault) => Err(EngineFaultError::new_err(fault.to_string())),
    }
}
