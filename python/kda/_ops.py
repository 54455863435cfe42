"""PyTorch custom ops over kda's engine.

Each path (``chunk``: the chunked WY form, ``recurrent``: the token-by-token form, ``reference``: the
float64 oracle) is a pair of ops registered with ``torch.library``: ``<ns>::<path>_fwd`` and
``<ns>::<path>_bwd``, with fake (meta) implementations for torch.compile and the forward's autograd
formula calling the backward op. The serving ops (``<ns>::decode``, ``<ns>::<path>_pooled_fwd``)
update a state pool in place. The namespace is the package's import name (``kda`` when installed,
another name when the Hugging Face ``kernels`` loader imports a copy), so two copies never collide.

Every op's arguments are defined once, in ``PROBLEM_OPTIONS`` (the problem options all ops share) and
one argument list per op (``_FORWARD``, ``_BACKWARD``, ``_DECODE``, ``_POOLED``): the schemas, the
records the implementations, fakes and autograd formula read their arguments through, and the
engine's problem are built from them.

The ops take tensors the engine can read as they are (last dimension contiguous; ``kda.functional``
and ``kda.serving`` prepare them) and return freshly allocated tensors. An output that is not asked
for comes back as an empty tensor, because an op's outputs are fixed by its schema.

``forward(path, ...)``, ``decode(...)`` and ``pooled_forward(...)`` are how the torch layer runs an
op: through the dispatcher, or, when nothing could tell the difference (eager mode, no gradient
recorded, no dispatch or function mode, profiler, functorch transform or tensor subclass in play),
straight into the op's implementation. The dispatcher round trip of a 17-argument Python op costs
~25 us, more than a one-token decode step's own overhead should be; the result is the same
function's, bit for bit. Whether nothing watches is read from private ``torch._C`` functions; a torch
without one of them turns this fast route off (``FAST_ROUTE``) and every call takes the op.
"""

import functools
import os
from collections import namedtuple
from operator import itemgetter

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _engine

NAMESPACE = (__package__ or "kda").replace(".", "_")

# ---- the arguments, defined once -----------------------------------------------------------------


def default_scale(q, scale):
    """The problem option ``scale``: K ** -0.5 when None."""
    return float(q.shape[-1] ** -0.5 if scale is None else scale)


def default_lower_bound(lower_bound):
    """The problem option ``gate_lower_bound``: kda's default bound (kda::Problem's) when None."""
    # (written out, not read from a module-level constant: torch.compile would trace a module-level
    # float as a dynamic input and restart its analysis)
    return float(-5.0 if lower_bound is None else lower_bound)


# The problem options: what the engine validates as one problem, in the binding's order, with their
# custom-op schema types and defaults. Every op takes all of them: the tensor ones where an op's
# argument list says {option_tensors}, the others where it says {option_values}. A new option is one
# line here (and its parameter in the binding); the functional layer sets it by name.
PROBLEM_OPTIONS = (
    ("cu_seqlens", "Tensor?", None),
    ("scale", "float", None),  # None: K ** -0.5 (default_scale)
    ("state_v_first", "bool", False),
    ("qk_l2norm", "bool", False),
    ("gate", "str", "log_decay"),
    ("gate_lower_bound", "float", default_lower_bound(None)),
    ("beta_mode", "str", "given"),
    ("gate_width", "str", "per_key"),  # the operator family's (kda._family): "per_key" is KDA's
)

Options = namedtuple("Options", [o[0] for o in PROBLEM_OPTIONS], defaults=[o[2] for o in PROBLEM_OPTIONS])

_OPTION_GROUPS = {
    "{option_tensors}": [f"{t} {n}" for n, t, _ in PROBLEM_OPTIONS if t.startswith("Tensor")],
    "{option_values}": [f"{t} {n}" for n, t, _ in PROBLEM_OPTIONS if not t.startswith("Tensor")],
}


def problem_options(q, *, scale=None, gate_lower_bound=None, **given) -> Options:
    """The problem options of a call, as the schemas take them: ``scale`` and the gate's lower bound
    resolved (default_scale, default_lower_bound); an option not given takes its default."""
    return Options(
        scale=default_scale(q, scale), gate_lower_bound=default_lower_bound(gate_lower_bound), **given
    )


class Signature:
    """One op's arguments: ``schema`` (its torch.library schema), ``Args`` (a namedtuple of them, which
    the implementation, the fake and the autograd formula read), ``options(args)`` (the problem
    options among them, in the table's order)."""

    def __init__(self, name, arguments, returns):
        spelled = []
        for argument in arguments.split(", "):
            spelled += _OPTION_GROUPS.get(argument, [argument])
        names = [a.split()[-1] for a in spelled]
        self.schema = f"({', '.join(spelled)}) -> {returns}"
        self.Args = namedtuple(name, names)
        self.fields = self.Args._fields
        # The problem options among an op's arguments, in the table's order (a plain tuple).
        self.options = itemgetter(*(names.index(n) for n in Options._fields))
        self.tensor_positions = tuple(i for i, a in enumerate(spelled) if a.startswith("Tensor"))

    def position(self, name) -> int:
        return self.fields.index(name)


_FORWARD = Signature(
    "ForwardArgs",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, {option_tensors}, {option_values}, bool output_final_state, "
    "bool keep_chunk_states",
    "(Tensor, Tensor, Tensor)",
)
_BACKWARD = Signature(
    "BackwardArgs",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, {option_tensors}, Tensor? chunk_states, Tensor d_o, Tensor? d_final_state, "
    "{option_values}, bool want_d_initial_state",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_DECODE = Signature(
    "DecodeArgs",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) pool, "
    "Tensor state_indices, Tensor? num_accepted_tokens, {option_tensors}, {option_values}, Tensor(b!) out",
    "()",
)
_POOLED = Signature(
    "PooledArgs",
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) pool, "
    "Tensor pool_indices, Tensor? has_initial_state, {option_tensors}, {option_values}",
    "Tensor",
)

# ---- the engine, called in one place --------------------------------------------------------------

# KDA_NUM_THREADS is read once, as the engine reads it (an environment lookup per call would cost a
# tenth of a decode step's Python layer).
_ENV_THREADS = bool(os.environ.get("KDA_NUM_THREADS"))


def num_threads() -> int:
    """Threads for one engine call: torch's intra-op thread count, unless KDA_NUM_THREADS is set (0 lets
    the engine read it), so kda never oversubscribes the cores next to torch."""
    return 0 if _ENV_THREADS else torch.get_num_threads()


def _dl(t):
    """A DLPack capsule of the tensor (no copy). The C-level export costs a tenth of the `__dlpack__`
    method's checks, and it ignores autograd, which the engine never sees."""
    return None if t is None else _to_dlpack(t)


# The engine seam: prepare() is where the problem options meet the binding. It validates a call's
# problem once; every engine function takes its answer first (the calls below hand their tensors over
# as DLPack capsules, a capsule being consumed by the one call it is given to).
_N_OPTION_TENSORS = len(_OPTION_GROUPS["{option_tensors}"])
# The binding takes the options in the table's order, which lists the tensor ones first.
assert all(t.startswith("Tensor") for _, t, _ in PROBLEM_OPTIONS[:_N_OPTION_TENSORS])


def prepare(q, v, options):
    """The problem of one call, validated once (an ``_engine.Problem``), which every engine function
    takes first; it answers ``num_sequences``, ``num_chunks`` and ``state_shape`` ((HV, a, b) in the
    state layout). ``options``: the problem options in the table's order. The gate's width is one of
    them: g is [B, T, HV, K] per key (KDA), [B, T, HV] per head (the gated delta rule), and the
    engine refuses a g of the other rank."""
    values = list(options)
    for i in range(_N_OPTION_TENSORS):
        values[i] = _dl(values[i])
    return _engine.prepare(_to_dlpack(q), _to_dlpack(v), *values)


# ---- the forward and backward ops of each path ------------------------------------------------------


def _new_like(v):
    # (empty_like is the cheapest allocation torch has: ~1 us, against ~3 us with a dtype argument.)
    return torch.empty_like(v) if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)


_INITIAL_STATE = _FORWARD.position("initial_state")
# What the backward op takes from the forward's arguments (the rest comes from the forward's outputs
# and the incoming gradients).
_FROM_FORWARD = tuple(n for n in _BACKWARD.fields if n in _FORWARD.fields)
_FORWARD_TENSORS = tuple(_FORWARD.fields[i] for i in _FORWARD.tensor_positions)


class _Path:
    """One computation path: the engine functions it calls, the dtype of its states, its ops."""

    def __init__(self, name, engine_forward, engine_backward, state_dtype, threaded):
        self.name = name
        self.engine_forward, self.engine_backward = engine_forward, engine_backward
        self.state_dtype, self.threaded = state_dtype, threaded
        self.forward_op = self.backward_op = None

    def threads(self):
        """The engine keyword arguments of the thread count (none for the single-threaded oracle)."""
        return {"num_threads": num_threads()} if self.threaded else {}

    def compute_forward(self, *args, problem=None):
        """Runs the engine on the forward op's arguments; returns (o, final_state or None, chunk_states
        or None). ``problem``: the arguments' problem when the caller validated it already (prepare())."""
        a = _FORWARD.Args._make(args)
        if problem is None:
            problem = prepare(a.q, a.v, _FORWARD.options(args))
        sd = self.state_dtype
        o = _new_like(a.v)
        final = chunks = None
        if a.output_final_state:
            shape = (problem.num_sequences, *problem.state_shape)
            h0 = a.initial_state
            reuse = h0 is not None and h0.dtype == sd and h0.shape == shape and h0.is_contiguous()
            final = torch.empty_like(h0) if reuse else torch.empty(shape, dtype=sd)
        if a.keep_chunk_states:
            chunks = torch.empty((problem.num_chunks, *problem.state_shape), dtype=sd)
        self.engine_forward(
            problem,
            _to_dlpack(a.q),
            _to_dlpack(a.k),
            _to_dlpack(a.v),
            _to_dlpack(a.g),
            _to_dlpack(a.beta),
            _to_dlpack(o),
            A_log=_dl(a.A_log),
            dt_bias=_dl(a.dt_bias),
            initial_state=_dl(a.initial_state),
            final_state=_dl(final),
            chunk_states=_dl(chunks),
            **self.threads(),
        )
        return o, final, chunks

    def forward(self, *args):
        """The forward op's implementation: compute_forward with empty tensors for what was not asked."""
        o, final, chunks = self.compute_forward(*args)
        if final is None:
            final = torch.empty(0, dtype=self.state_dtype)
        if chunks is None:
            chunks = torch.empty(0, dtype=self.state_dtype)
        return o, final, chunks

    def forward_fake(self, *args):
        a = _FORWARD.Args._make(args)
        sd, v = self.state_dtype, a.v
        hv, v_dim, k_dim = v.shape[2], v.shape[3], a.q.shape[3]
        state = (hv, v_dim, k_dim) if a.state_v_first else (hv, k_dim, v_dim)
        final = chunks = v.new_empty(0, dtype=sd)
        if a.output_final_state:
            n = a.q.shape[0] if a.cu_seqlens is None else a.cu_seqlens.shape[0] - 1
            final = v.new_empty((n, *state), dtype=sd)
        if a.keep_chunk_states:
            if a.cu_seqlens is None:
                nc = a.q.shape[0] * ((a.q.shape[1] + _engine.CHUNK_SIZE - 1) // _engine.CHUNK_SIZE)
            else:  # the chunk count depends on the offsets' values
                nc = torch.library.get_ctx().new_dynamic_size()
            chunks = v.new_empty((nc, *state), dtype=sd)
        return v.new_empty(v.shape), final, chunks

    def backward(self, *args):
        """The backward op's implementation."""
        a = _BACKWARD.Args._make(args)
        sd = self.state_dtype
        dq, dk, dv, dg, dbeta = (torch.empty(t.shape, dtype=t.dtype) for t in (a.q, a.k, a.v, a.g, a.beta))
        fused = a.gate != "log_decay"
        d_h0 = torch.empty(a.initial_state.shape, dtype=sd) if a.want_d_initial_state else None
        dA = torch.empty(a.A_log.shape, dtype=sd) if fused and a.A_log is not None else None
        dbias = torch.empty(a.dt_bias.shape, dtype=sd) if fused and a.dt_bias is not None else None
        extra = self.threads()
        if self.threaded:  # the oracle is single-threaded and recomputes everything from the inputs
            extra["chunk_states"] = _dl(a.chunk_states)
        self.engine_backward(
            prepare(a.q, a.v, _BACKWARD.options(args)),
            *map(_to_dlpack, (a.q, a.k, a.v, a.g, a.beta, a.d_o, dq, dk, dv, dg, dbeta)),
            A_log=_dl(a.A_log),
            dt_bias=_dl(a.dt_bias),
            initial_state=_dl(a.initial_state),
            d_final_state=_dl(a.d_final_state),
            d_initial_state=_dl(d_h0),
            dA_log=_dl(dA),
            ddt_bias=_dl(dbias),
            **extra,
        )
        # (one empty tensor per missing output: an op's outputs may not alias each other)
        return (
            dq,
            dk,
            dv,
            dg,
            dbeta,
            *(torch.empty(0, dtype=sd) if t is None else t for t in (d_h0, dA, dbias)),
        )

    def backward_fake(self, *args):
        a = _BACKWARD.Args._make(args)
        sd, fused = self.state_dtype, a.gate != "log_decay"

        def gradient_of(t, wanted):
            return t.new_empty(t.shape, dtype=sd) if wanted and t is not None else a.q.new_empty(0, dtype=sd)

        return (
            *(t.new_empty(t.shape) for t in (a.q, a.k, a.v, a.g, a.beta)),
            gradient_of(a.initial_state, a.want_d_initial_state),
            gradient_of(a.A_log, fused),
            gradient_of(a.dt_bias, fused),
        )

    # ---- autograd ----

    @staticmethod
    def setup_context(ctx, inputs, output):
        # The forward's tensors are saved (autograd tracks them); the rest of its arguments are kept as
        # they are, and the backward op's arguments are taken from both by name.
        a = _FORWARD.Args._make(inputs)
        chunks = output[2] if a.keep_chunk_states else None
        ctx.save_for_backward(*(inputs[i] for i in _FORWARD.tensor_positions), chunks)
        ctx.inputs = a._replace(**dict.fromkeys(_FORWARD_TENSORS))

    def autograd_backward(self, ctx, d_o, d_final_state, _d_chunk_states):
        *tensors, chunks = ctx.saved_tensors
        a = ctx.inputs._replace(**dict(zip(_FORWARD_TENSORS, tensors, strict=True)))
        if d_o is None:
            d_o = torch.zeros_like(a.v)
        elif d_o.stride(-1) != 1:  # e.g. the expanded gradient of a sum
            d_o = d_o.contiguous()
        if not a.output_final_state or d_final_state is None:
            d_final_state = None
        else:
            d_final_state = d_final_state.contiguous()
        want_d_h0 = a.initial_state is not None and ctx.needs_input_grad[_INITIAL_STATE]
        dq, dk, dv, dg, dbeta, d_h0, dA, dbias = self.backward_op(
            *_BACKWARD.Args(
                **{n: getattr(a, n) for n in _FROM_FORWARD},
                chunk_states=chunks,
                d_o=d_o,
                d_final_state=d_final_state,
                want_d_initial_state=want_d_h0,
            )
        )
        fused = a.gate != "log_decay"
        gradients = dict(
            q=dq,
            k=dk,
            v=dv,
            g=dg,
            beta=dbeta,
            A_log=dA if fused and a.A_log is not None else None,
            dt_bias=dbias if fused and a.dt_bias is not None else None,
            initial_state=d_h0 if want_d_h0 else None,
        )
        return tuple(gradients.get(n) for n in _FORWARD.fields)

    def register(self):
        self.forward_op = torch.library.custom_op(
            f"{NAMESPACE}::{self.name}_fwd", self.forward, mutates_args=(), schema=_FORWARD.schema
        )
        self.forward_op.register_fake(self.forward_fake)
        self.backward_op = torch.library.custom_op(
            f"{NAMESPACE}::{self.name}_bwd", self.backward, mutates_args=(), schema=_BACKWARD.schema
        )
        self.backward_op.register_fake(self.backward_fake)
        self.forward_op.register_autograd(self.autograd_backward, setup_context=self.setup_context)
        return self


PATHS = {
    p.name: p.register()
    for p in (
        _Path("chunk", _engine.chunk_forward, _engine.chunk_backward, torch.float32, threaded=True),
        # precision="bf16" (opt-in): the chunked forward's products on bf16 operands; the backward exact.
        _Path(
            "chunk_bf16",
            functools.partial(_engine.chunk_forward, precision="bf16"),
            _engine.chunk_backward,
            torch.float32,
            threaded=True,
        ),
        _Path(
            "recurrent", _engine.recurrent_forward, _engine.recurrent_backward, torch.float32, threaded=True
        ),
        _Path(
            "reference", _engine.reference_forward, _engine.reference_backward, torch.float64, threaded=False
        ),
    )
}

# ---- plain engine calls by argument name (context parallelism, kda.cp) -----------------------------

CHUNK_SIZE = _engine.CHUNK_SIZE


def engine_forward(path, *, options, problem=None, **named):
    """A path's forward implementation, called directly (not an op: nothing is recorded), with the
    forward op's arguments by name and the problem options as an ``Options``; returns (o, final_state
    or None, chunk_states or None). ``problem``: those options' prepared problem, when the caller has
    it (the call is then validated once)."""
    return PATHS[path].compute_forward(*_FORWARD.Args(**named, **options._asdict()), problem=problem)


def engine_backward(path, *, options, **named):
    """A path's backward implementation, called directly, with the backward op's arguments by name:
    (dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias), an empty tensor for each of the last
    three not computed."""
    return PATHS[path].backward(*_BACKWARD.Args(**named, **options._asdict()))


def segment_transition(problem, q, k, v, g, beta, A_log, dt_bias, sequence, *, readout_length=None):
    """(M [HV, K, K], S_local [*problem.state_shape], R [L, HV, K] or None), fp32: what sequence
    `sequence` of the prepared problem does to the state entering it, S_out = M S_in + S_local
    (K-first terms; docs/math.md, "Segment transitions"), and, given the sequence's length L as
    ``readout_length``, its adjoint R_t = scale M_t^T q_t: the entering state's gradient from the
    sequence's output gradients d_o [L, HV, V] is ``einsum("thk,thv->hkv", R, d_o)`` (K-first). Not
    differentiated."""
    hv, K = problem.state_shape[0], q.shape[3]
    M = torch.empty(hv, K, K, dtype=torch.float32)
    S_local = torch.empty(problem.state_shape, dtype=torch.float32)
    R = None if readout_length is None else torch.empty(readout_length, hv, K, dtype=torch.float32)
    _engine.segment_transition(
        problem,
        *map(_to_dlpack, (q, k, v, g, beta)),
        sequence,
        _to_dlpack(M),
        _to_dlpack(S_local),
        readout=None if R is None else _to_dlpack(R),
        A_log=_dl(A_log),
        dt_bias=_dl(dt_bias),
        num_threads=num_threads(),
    )
    return M, S_local, R


# ---- serving: ops that update a state pool in place ----------------------------------------------


def compute_decode(*args):
    """The decode op's implementation: writes out and updates pool's slots in place."""
    a = _DECODE.Args._make(args)
    _engine.decode(
        prepare(a.q, a.v, _DECODE.options(args)),
        _to_dlpack(a.q),
        _to_dlpack(a.k),
        _to_dlpack(a.v),
        _to_dlpack(a.g),
        _to_dlpack(a.beta),
        _to_dlpack(a.out),
        _to_dlpack(a.pool),
        _to_dlpack(a.state_indices),
        num_accepted_tokens=_dl(a.num_accepted_tokens),
        A_log=_dl(a.A_log),
        dt_bias=_dl(a.dt_bias),
        num_threads=num_threads(),
    )


decode_op = torch.library.custom_op(
    f"{NAMESPACE}::decode", compute_decode, mutates_args=("pool", "out"), schema=_DECODE.schema
)
decode_op.register_fake(lambda *args: None)


def _pooled_forward(engine_forward):
    def compute(*args):
        a = _POOLED.Args._make(args)
        o = _new_like(a.v)
        engine_forward(
            prepare(a.q, a.v, _POOLED.options(args)),
            *map(_to_dlpack, (a.q, a.k, a.v, a.g, a.beta, o)),
            A_log=_dl(a.A_log),
            dt_bias=_dl(a.dt_bias),
            pool=_dl(a.pool),
            pool_indices=_dl(a.pool_indices),
            has_initial_state=_dl(a.has_initial_state),
            num_threads=num_threads(),
        )
        return o

    return compute


def _pooled_fake(*args):
    v = args[_POOLED.position("v")]
    return v.new_empty(v.shape)


POOLED = {}
for _name, _fn in (("chunk", _engine.chunk_forward), ("recurrent", _engine.recurrent_forward)):
    _compute = _pooled_forward(_fn)
    _op = torch.library.custom_op(
        f"{NAMESPACE}::{_name}_pooled_fwd", _compute, mutates_args=("pool",), schema=_POOLED.schema
    )
    _op.register_fake(_pooled_fake)
    POOLED[_name] = (_compute, _op)

# ---- the routes: straight into the implementation, or through the op ------------------------------

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def inspect_inputs(tensors):
    """(gradient recorded, plain): whether autograd records a gradient through these tensors, and
    whether they are plain tensors (no subclass such as FakeTensor, whose computation only the op's
    fake implementation can do)."""
    grad = torch.is_grad_enabled()
    recorded, plain = False, True
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN_TENSORS:
                plain = False
            if grad and t.requires_grad:
                recorded = True
    return recorded, plain


def _resolve_probes():
    """The private torch._C functions that tell whether anything watches or transforms the dispatcher
    (a torch_dispatch mode, a torch_function mode, a functorch transform, the profiler), or None when
    this torch lacks one of them."""
    autograd = getattr(torch._C, "_autograd", None)
    probes = (
        getattr(torch._C, "_len_torch_dispatch_stack", None),
        getattr(torch._C, "_is_torch_function_mode_enabled", None),
        getattr(torch._C, "_are_functorch_transforms_active", None),
        getattr(autograd, "_profiler_enabled", None),
    )
    return probes if all(callable(p) for p in probes) else None


_PROBES = _resolve_probes()
# Whether a call may skip the dispatcher when nothing watches it; off when a probe is missing.
FAST_ROUTE = _PROBES is not None
_is_compiling = torch.compiler.is_compiling


def _unobserved() -> bool:
    """True unless something watches or transforms the dispatcher: tracing, modes, functorch, profiler."""
    dispatch_modes, function_mode, functorch, profiler = _PROBES
    return not (_is_compiling() or dispatch_modes() or function_mode() or functorch() or profiler())


_FINAL, _KEEP = _FORWARD.position("output_final_state"), _FORWARD.position("keep_chunk_states")


def forward(path, direct, *args):
    """Runs a path's forward op on the op's arguments (see the module docstring); returns
    (o, final_state or None, chunk_states or None). `direct`: no gradient is recorded and the tensors
    are plain (inspect_inputs), so the implementation may run without the dispatcher when unobserved."""
    if direct and FAST_ROUTE and _unobserved():
        return PATHS[path].compute_forward(*args)
    o, final, chunks = PATHS[path].forward_op(*args)
    return o, final if args[_FINAL] else None, chunks if args[_KEEP] else None


def decode(direct, *args):
    """Runs the decode op (see forward() for `direct`)."""
    if direct and FAST_ROUTE and _unobserved():
        compute_decode(*args)
    else:
        decode_op(*args)


def pooled_forward(path, direct, *args):
    """Runs a pooled prefill op (path "chunk" or "recurrent"); returns o."""
    compute, op = POOLED[path]
    return compute(*args) if direct and FAST_ROUTE and _unobserved() else op(*args)


__all__ = [
    "FAST_ROUTE",
    "NAMESPACE",
    "PATHS",
    "POOLED",
    "PROBLEM_OPTIONS",
    "Options",
    "decode",
    "engine_backward",
    "engine_forward",
    "forward",
    "inspect_inputs",
    "num_threads",
    "pooled_forward",
    "problem_options",
    "segment_transition",
]
