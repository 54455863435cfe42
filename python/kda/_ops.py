"""PyTorch custom ops over kda's engine.

Each path (``chunk``: the chunked WY form, ``recurrent``: the token-by-token form, ``reference``: the
float64 oracle) is a pair of ops registered with ``torch.library``: ``<ns>::<path>_fwd`` and
``<ns>::<path>_bwd``, with fake (meta) implementations for torch.compile and the forward's autograd
formula calling the backward op. The namespace is the package's import name (``kda`` when installed,
another name when the Hugging Face ``kernels`` loader imports a copy), so two copies never collide.

The ops take tensors the engine can read as they are (last dimension contiguous; the fla-compatible
functions in ``kda.functional`` prepare them) and return freshly allocated tensors. An output that is
not asked for comes back as an empty tensor, because an op's outputs are fixed by its schema.

``forward(path, ...)`` is how the functional layer calls a forward: through the op, or, when nothing
could tell the difference (eager mode, no gradient recorded, no dispatch or function mode, profiler,
functorch transform or tensor subclass in play), straight into the op's implementation. The dispatcher
round trip of a 17-argument Python op costs ~25 us, more than a one-token decode step's own overhead
should be; the result is the same function's, bit for bit.
"""

import os

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _engine

NAMESPACE = (__package__ or "kda").replace(".", "_")

_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool state_v_first, bool qk_l2norm, "
    "str gate, float gate_lower_bound, str beta_mode, bool output_final_state, bool keep_chunk_states) "
    "-> (Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
    "Tensor? initial_state, Tensor? cu_seqlens, Tensor? chunk_states, Tensor d_o, Tensor? d_final_state, "
    "float scale, bool state_v_first, bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode, "
    "bool want_d_initial_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


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


def _engine_options(
    A_log,
    dt_bias,
    cu_seqlens,
    scale,
    state_v_first,
    qk_l2norm,
    gate,
    gate_lower_bound,
    beta_mode,
    threaded=True,
):
    """The engine keyword arguments every op passes: the problem's options and the side tensors.
    `threaded`: the kernels take num_threads (the single-threaded oracle does not)."""
    options = dict(
        A_log=_dl(A_log),
        dt_bias=_dl(dt_bias),
        cu_seqlens=_dl(cu_seqlens),
        scale=scale,
        state_v_first=state_v_first,
        qk_l2norm=qk_l2norm,
        gate=gate,
        gate_lower_bound=gate_lower_bound,
        beta_mode=beta_mode,
    )
    if threaded:
        options["num_threads"] = num_threads()
    return options


def _state_shape(n, v, k_dim, state_v_first):
    hv, v_dim = v.shape[2], v.shape[3]
    return (n, hv, v_dim, k_dim) if state_v_first else (n, hv, k_dim, v_dim)


def _num_sequences(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


class _Path:
    """One computation path: the engine functions it calls, the dtype of its states, its ops."""

    def __init__(self, name, engine_forward, engine_backward, state_dtype, threaded):
        self.name = name
        self.engine_forward, self.engine_backward = engine_forward, engine_backward
        self.state_dtype, self.threaded = state_dtype, threaded
        self.forward_op = self.backward_op = None

    def compute_forward(
        self,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        scale,
        state_v_first,
        qk_l2norm,
        gate,
        gate_lower_bound,
        beta_mode,
        output_final_state,
        keep_chunk_states,
    ):
        """Runs the engine; returns (o, final_state or None, chunk_states or None)."""
        k_dim, sd = q.shape[3], self.state_dtype
        # (empty_like is the cheapest allocation torch has: ~1 us, against ~3 us with a dtype argument.)
        o = torch.empty_like(v) if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)
        final = chunks = None
        if output_final_state:
            shape = _state_shape(_num_sequences(q, cu_seqlens), v, k_dim, state_v_first)
            h0 = initial_state
            reuse = h0 is not None and h0.dtype == sd and h0.shape == shape and h0.is_contiguous()
            final = torch.empty_like(h0) if reuse else torch.empty(shape, dtype=sd)
        if keep_chunk_states:
            nc = _engine.num_chunks(q.shape[0], q.shape[1], _dl(cu_seqlens))
            chunks = torch.empty(_state_shape(nc, v, k_dim, state_v_first), dtype=sd)
        kwargs = _engine_options(
            A_log,
            dt_bias,
            cu_seqlens,
            scale,
            state_v_first,
            qk_l2norm,
            gate,
            gate_lower_bound,
            beta_mode,
            self.threaded,
        )
        kwargs.update(initial_state=_dl(initial_state), final_state=_dl(final), chunk_states=_dl(chunks))
        self.engine_forward(_dl(q), _dl(k), _dl(v), _dl(g), _dl(beta), _dl(o), **kwargs)
        return o, final, chunks

    def forward(self, *args):
        """The forward op's implementation: compute_forward with empty tensors for what was not asked."""
        o, final, chunks = self.compute_forward(*args)
        if final is None:
            final = torch.empty(0, dtype=self.state_dtype)
        if chunks is None:
            chunks = torch.empty(0, dtype=self.state_dtype)
        return o, final, chunks

    def forward_fake(
        self,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        scale,
        state_v_first,
        qk_l2norm,
        gate,
        gate_lower_bound,
        beta_mode,
        output_final_state,
        keep_chunk_states,
    ):
        k_dim, sd = q.shape[3], self.state_dtype
        final = chunks = v.new_empty(0, dtype=sd)
        if output_final_state:
            final = v.new_empty(
                _state_shape(_num_sequences(q, cu_seqlens), v, k_dim, state_v_first), dtype=sd
            )
        if keep_chunk_states:
            if cu_seqlens is None:
                nc = q.shape[0] * ((q.shape[1] + _engine.CHUNK_SIZE - 1) // _engine.CHUNK_SIZE)
            else:  # the chunk count depends on the offsets' values
                nc = torch.library.get_ctx().new_dynamic_size()
            chunks = v.new_empty(_state_shape(nc, v, k_dim, state_v_first), dtype=sd)
        return v.new_empty(v.shape), final, chunks

    def backward(
        self,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        chunk_states,
        d_o,
        d_final_state,
        scale,
        state_v_first,
        qk_l2norm,
        gate,
        gate_lower_bound,
        beta_mode,
        want_d_initial_state,
    ):
        """The backward op's implementation."""
        sd = self.state_dtype
        dq, dk, dv, dg, dbeta = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v, g, beta))
        fused = gate != "log_decay"
        d_h0 = torch.empty(initial_state.shape, dtype=sd) if want_d_initial_state else None
        dA = torch.empty(A_log.shape, dtype=sd) if fused and A_log is not None else None
        dbias = torch.empty(dt_bias.shape, dtype=sd) if fused and dt_bias is not None else None
        kwargs = _engine_options(
            A_log,
            dt_bias,
            cu_seqlens,
            scale,
            state_v_first,
            qk_l2norm,
            gate,
            gate_lower_bound,
            beta_mode,
            self.threaded,
        )
        kwargs.update(
            initial_state=_dl(initial_state),
            d_final_state=_dl(d_final_state),
            d_initial_state=_dl(d_h0),
            dA_log=_dl(dA),
            ddt_bias=_dl(dbias),
        )
        if self.threaded:  # the oracle is single-threaded and recomputes everything from the inputs
            kwargs["chunk_states"] = _dl(chunk_states)
        self.engine_backward(
            _dl(q),
            _dl(k),
            _dl(v),
            _dl(g),
            _dl(beta),
            _dl(d_o),
            _dl(dq),
            _dl(dk),
            _dl(dv),
            _dl(dg),
            _dl(dbeta),
            **kwargs,
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

    def backward_fake(
        self,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        chunk_states,
        d_o,
        d_final_state,
        scale,
        state_v_first,
        qk_l2norm,
        gate,
        gate_lower_bound,
        beta_mode,
        want_d_initial_state,
    ):
        sd, fused = self.state_dtype, gate != "log_decay"

        def gradient_of(t, wanted):
            return t.new_empty(t.shape, dtype=sd) if wanted and t is not None else q.new_empty(0, dtype=sd)

        return (
            q.new_empty(q.shape),
            k.new_empty(k.shape),
            v.new_empty(v.shape),
            g.new_empty(g.shape),
            beta.new_empty(beta.shape),
            gradient_of(initial_state, want_d_initial_state),
            gradient_of(A_log, fused),
            gradient_of(dt_bias, fused),
        )

    # ---- autograd ----

    @staticmethod
    def setup_context(ctx, inputs, output):
        (
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            initial_state,
            cu_seqlens,
            scale,
            state_v_first,
            qk_l2norm,
            gate,
            gate_lower_bound,
            beta_mode,
            output_final_state,
            keep_chunk_states,
        ) = inputs
        chunks = output[2] if keep_chunk_states else None
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunks)
        ctx.problem = (scale, state_v_first, qk_l2norm, gate, gate_lower_bound, beta_mode)
        ctx.output_final_state = output_final_state

    def autograd_backward(self, ctx, d_o, d_final_state, _d_chunk_states):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunks = ctx.saved_tensors
        if d_o is None:
            d_o = torch.zeros_like(v)
        elif d_o.stride(-1) != 1:  # e.g. the expanded gradient of a sum
            d_o = d_o.contiguous()
        if not ctx.output_final_state or d_final_state is None:
            d_final_state = None
        else:
            d_final_state = d_final_state.contiguous()
        want_d_h0 = initial_state is not None and ctx.needs_input_grad[7]
        dq, dk, dv, dg, dbeta, d_h0, dA, dbias = self.backward_op(
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            initial_state,
            cu_seqlens,
            chunks,
            d_o,
            d_final_state,
            *ctx.problem,
            want_d_h0,
        )
        fused = ctx.problem[3] != "log_decay"
        return (
            dq,
            dk,
            dv,
            dg,
            dbeta,
            dA if fused and A_log is not None else None,
            dbias if fused and dt_bias is not None else None,
            d_h0 if want_d_h0 else None,
            *([None] * 9),
        )

    def register(self):
        self.forward_op = torch.library.custom_op(
            f"{NAMESPACE}::{self.name}_fwd", self.forward, mutates_args=(), schema=_FORWARD_SCHEMA
        )
        self.forward_op.register_fake(self.forward_fake)
        self.backward_op = torch.library.custom_op(
            f"{NAMESPACE}::{self.name}_bwd", self.backward, mutates_args=(), schema=_BACKWARD_SCHEMA
        )
        self.backward_op.register_fake(self.backward_fake)
        self.forward_op.register_autograd(self.autograd_backward, setup_context=self.setup_context)
        return self


PATHS = {
    p.name: p.register()
    for p in (
        _Path("chunk", _engine.chunk_forward, _engine.chunk_backward, torch.float32, threaded=True),
        _Path(
            "recurrent", _engine.recurrent_forward, _engine.recurrent_backward, torch.float32, threaded=True
        ),
        _Path(
            "reference", _engine.reference_forward, _engine.reference_backward, torch.float64, threaded=False
        ),
    )
}

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


def _unobserved() -> bool:
    """True unless something watches or transforms the dispatcher: tracing, modes, functorch, profiler."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._autograd._profiler_enabled()
    )


def forward(path, direct, *args):
    """Runs a path's forward op on the op's arguments (see the module docstring); returns
    (o, final_state or None, chunk_states or None). `direct`: no gradient is recorded and the tensors
    are plain (inspect_inputs), so the implementation may run without the dispatcher when unobserved."""
    if direct and _unobserved():
        return PATHS[path].compute_forward(*args)
    o, final, chunks = PATHS[path].forward_op(*args)
    return o, final if args[-2] else None, chunks if args[-1] else None


# ---- serving: ops that update a state pool in place ----------------------------------------------

_DECODE_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) pool, "
    "Tensor state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, float scale, bool state_v_first, "
    "bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode, Tensor(b!) out) -> ()"
)
_POOLED_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, Tensor(a!) pool, "
    "Tensor pool_indices, Tensor? has_initial_state, Tensor? cu_seqlens, float scale, bool state_v_first, "
    "bool qk_l2norm, str gate, float gate_lower_bound, str beta_mode) -> Tensor"
)


def compute_decode(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    pool,
    state_indices,
    num_accepted_tokens,
    cu_seqlens,
    scale,
    state_v_first,
    qk_l2norm,
    gate,
    gate_lower_bound,
    beta_mode,
    out,
):
    """The decode op's implementation: writes out and updates pool's slots in place."""
    _engine.decode(
        _dl(q),
        _dl(k),
        _dl(v),
        _dl(g),
        _dl(beta),
        _dl(out),
        _dl(pool),
        _dl(state_indices),
        num_accepted_tokens=_dl(num_accepted_tokens),
        **_engine_options(
            A_log, dt_bias, cu_seqlens, scale, state_v_first, qk_l2norm, gate, gate_lower_bound, beta_mode
        ),
    )


decode_op = torch.library.custom_op(
    f"{NAMESPACE}::decode", compute_decode, mutates_args=("pool", "out"), schema=_DECODE_SCHEMA
)
decode_op.register_fake(lambda *args: None)


def _pooled_forward(engine_forward):
    def compute(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        pool,
        pool_indices,
        has_initial_state,
        cu_seqlens,
        scale,
        state_v_first,
        qk_l2norm,
        gate,
        gate_lower_bound,
        beta_mode,
    ):
        o = torch.empty_like(v) if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)
        engine_forward(
            _dl(q),
            _dl(k),
            _dl(v),
            _dl(g),
            _dl(beta),
            _dl(o),
            pool=_dl(pool),
            pool_indices=_dl(pool_indices),
            has_initial_state=_dl(has_initial_state),
            **_engine_options(
                A_log, dt_bias, cu_seqlens, scale, state_v_first, qk_l2norm, gate, gate_lower_bound, beta_mode
            ),
        )
        return o

    return compute


POOLED = {}
for _name, _fn in (("chunk", _engine.chunk_forward), ("recurrent", _engine.recurrent_forward)):
    _compute = _pooled_forward(_fn)
    _op = torch.library.custom_op(
        f"{NAMESPACE}::{_name}_pooled_fwd", _compute, mutates_args=("pool",), schema=_POOLED_SCHEMA
    )
    _op.register_fake(lambda q, k, v, *rest: v.new_empty(v.shape))
    POOLED[_name] = (_compute, _op)


def decode(direct, *args):
    """Runs the decode op (see forward() for `direct`)."""
    if direct and _unobserved():
        compute_decode(*args)
    else:
        decode_op(*args)


def pooled_forward(path, direct, *args):
    """Runs a pooled prefill op (path "chunk" or "recurrent"); returns o."""
    compute, op = POOLED[path]
    return compute(*args) if direct and _unobserved() else op(*args)


__all__ = [
    "NAMESPACE",
    "PATHS",
    "POOLED",
    "decode",
    "forward",
    "inspect_inputs",
    "num_threads",
    "pooled_forward",
]
