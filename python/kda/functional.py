"""flash-linear-attention's KDA functions, computed by kda's engine on the CPU.

``chunk_kda``, ``fused_recurrent_kda`` and ``fused_kda_gate`` take the arguments of fla-core 0.6.0's
functions of the same names, with the same defaults, returns and validation (the same exception
types), and are differentiable: every gradient (q, k, v, g, beta, A_log, dt_bias, initial_state) comes
from kda's exact backward kernels through ``torch.library`` custom ops, so they also trace under
``torch.compile(fullgraph=True)``.

dtypes: float32 and bfloat16 inputs are read as they are (zero copies when the last dimension is
contiguous); float16 (and other narrow floats) are computed in float32 and returned in the input's
dtype; float64 inputs are computed by kda's float64 oracle (exact, single-threaded: meant for checking,
e.g. with ``torch.autograd.gradcheck``). States, ``A_log`` and ``dt_bias`` are float32 (float64 on the
oracle path).
"""

import math
import warnings

import torch
import torch.nn.functional as F

from . import _engine, _ops

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "fused_kda_gate"]

_CHUNK_KWARGS = frozenset(
    {"A_log", "dt_bias", "chunk_size", "transpose_state_layout", "ssm_state_indices", "has_initial_state"}
)
_RECURRENT_KWARGS = frozenset({"transpose_state_layout"})


# ---- argument handling shared by both functions ---------------------------------------------------


def _reject_unknown(function, kwargs, allowed):
    for name in kwargs:
        if name not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument '{name}'")


def _state_v_first(state_v_first, kwargs):
    """fla's deprecated alias `transpose_state_layout` of `state_v_first`."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn(
        "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
        DeprecationWarning,
        stacklevel=3,
    )
    return bool(kwargs["transpose_state_layout"])


def _check_cpu(names, tensors):
    for name, t in zip(names, tensors, strict=True):
        if t is not None and not t.is_cpu:
            raise NotImplementedError(
                f"kda computes on the CPU (it has no GPU backend yet): '{name}' is on {t.device}; "
                "move the inputs with .cpu()"
            )


_DEVICE_CHECKED = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")


def _check_shapes(q, k, v, g, beta):
    """fla's shape checks (the same exception types), plus what the engine supports."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or g.dim() != 4:
        for name, t in zip(_NAMES[:4], (q, k, v, g), strict=True):
            if t.dim() != 4:
                raise ValueError(f"kda: '{name}' must be a 4-D tensor, got shape {list(t.shape)}")
    B, T, H, K = q.shape
    _, _, HV, V = v.shape
    if beta.dim() == 4:
        raise NotImplementedError(
            "kda: a headwise beta [B, T, HV, V] is not supported; pass one beta per token and head [B, T, HV]"
        )
    if H < 1 or HV < 1:
        raise ValueError(f"kda: q and v need at least one head, got H={H}, HV={HV}")
    if q.shape != k.shape:
        raise AssertionError(f"q and k must have the same shape, got q={q.shape} vs k={k.shape}")
    if K > _engine.MAX_HEAD_DIM:
        raise AssertionError(f"Currently we only support key headdim <=256 for KDA, got {K}.")
    if V > _engine.MAX_HEAD_DIM:
        raise NotImplementedError(f"kda supports value head dims up to {_engine.MAX_HEAD_DIM}, got V={V}")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"kda: v must have shape [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    if HV % H != 0:
        raise AssertionError(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
            f"but got HV % H = {HV % H}"
        )
    if g.shape != (B, T, HV, K):
        raise AssertionError(f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise AssertionError(f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")


def _check_varlen(q, initial_state, cu_seqlens):
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
            f"Please flatten variable-length inputs before processing."
        )
    if cu_seqlens.dim() != 1:
        raise ValueError(
            f"kda: cu_seqlens must be a 1-D tensor of N+1 offsets, got shape {list(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kda: cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"The number of initial states is expected to be equal to the number of input sequences, "
            f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}."
        )


def _gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, function):
    """The engine's gate mode for fla's gate arguments."""
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            warnings.warn(
                f"{function}: A_log and dt_bias are only used with use_gate_in_kernel=True; g is taken as "
                "the log decay and they are not applied",
                UserWarning,
                stacklevel=3,
            )
        if lower_bound is not None and not safe_gate:
            warnings.warn(
                f"{function}: lower_bound is only used with use_gate_in_kernel=True (or to describe bounded "
                "gates with safe_gate=True); it is not applied",
                UserWarning,
                stacklevel=3,
            )
        return "log_decay"
    if A_log is None and lower_bound is None:
        raise ValueError(
            "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set."
        )
    if lower_bound is None:
        return "softplus"
    if not (math.isfinite(lower_bound) and lower_bound < 0):
        raise ValueError(f"kda: lower_bound must be a finite number < 0, got {lower_bound}")
    return "lower_bound"


def _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if not use_beta_sigmoid_in_kernel:
        return "given"
    return "sigmoid_x2" if allow_neg_eigval else "sigmoid"


_NATIVE = (torch.float32, torch.bfloat16)  # what the engine reads as it is
_NAMES = ("q", "k", "v", "g", "beta")


def _engine_ready(t):
    """The engine reads any B / T / head strides but needs a contiguous last dimension (beta, 3-D, has
    none: its heads are its last dimension and may be strided)."""
    return t if t.stride(-1) == 1 or t.dim() < 4 or t.shape[-1] <= 1 else t.contiguous()


def _prepare_activations(q, k, v, g, beta):
    """Casts the activations to what the engine computes in; returns them and the states' dtype."""
    qd = q.dtype
    if (
        qd in _NATIVE
        and k.dtype == qd
        and v.dtype in _NATIVE
        and g.dtype in _NATIVE
        and beta.dtype in _NATIVE
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and g.stride(-1) == 1
    ):
        return (q, k, v, g, beta), torch.float32  # the common case: read as they are
    acts = (q, k, v, g, beta)
    for name, t in zip(_NAMES, acts, strict=True):
        if not t.is_floating_point():
            raise TypeError(f"kda: '{name}' must be a floating-point tensor, got {t.dtype}")
    if any(t.dtype == torch.float64 for t in acts):
        return tuple(_engine_ready(t.double()) for t in acts), torch.float64
    # float16 and other narrow floats are computed in float32; q and k are read in one dtype.
    acts = [t if t.dtype in _NATIVE else t.float() for t in acts]
    if acts[0].dtype != acts[1].dtype:
        acts[0], acts[1] = acts[0].float(), acts[1].float()
    return tuple(_engine_ready(t) for t in acts), torch.float32


def _side(t, dtype):
    """A_log, dt_bias, initial_state: packed, in the path's state dtype (a differentiable cast)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _run(
    path,
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    scale,
    initial_state,
    output_final_state,
    qk_l2norm,
    gate,
    lower_bound,
    beta_mode,
    state_v_first,
    cu_seqlens,
    want_chunk_states=False,
):
    """One engine call through the custom ops: returns (o, final_state, chunk_states) in the engine's
    dtypes (o in v's compute dtype); final_state / chunk_states are None when not asked for."""
    (q, k, v, g, beta), state_dtype = _prepare_activations(q, k, v, g, beta)
    if state_dtype == torch.float64:
        path = "reference"
    if gate == "lower_bound" and A_log is None:
        # fla's gate without A_log is lower_bound * sigmoid(g + dt_bias): exp(A_log) = 1.
        A_log = torch.zeros(v.shape[2], dtype=state_dtype)
    if A_log is not None:
        A_log = _side(A_log, state_dtype)
    if dt_bias is not None:
        dt_bias = _side(dt_bias, state_dtype)
        if dt_bias.dim() != 1:
            dt_bias = dt_bias.reshape(-1)
    if initial_state is not None:
        initial_state = _side(initial_state, state_dtype)
    grad, plain = _ops.inspect_inputs((q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens))
    o, final, chunks = _ops.forward(
        path,
        plain and not grad,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        float(q.shape[-1] ** -0.5 if scale is None else scale),
        bool(state_v_first),
        bool(qk_l2norm),
        gate,
        float(-5.0 if lower_bound is None else lower_bound),
        beta_mode,
        bool(output_final_state),
        grad or want_chunk_states,
    )
    return o, final, chunks if want_chunk_states else None


def _check_tensors(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
    """fla's tensor checks (device, shapes, varlen): the engine makes the same checks, with its own
    messages and exception types."""
    _check_cpu(_DEVICE_CHECKED, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias))
    _check_varlen(q, initial_state, cu_seqlens)
    _check_shapes(q, k, v, g, beta)


def _checked(check, run):
    """Runs `run()`; `check()` raises fla's error for a call fla refuses. Every such call is one the
    engine refuses too, so on the eager path `check` runs only after the engine failed (it would cost
    as much as a one-token decode step's whole Python overhead otherwise); when torch.compile traces,
    it runs first and costs nothing at run time."""
    if torch.compiler.is_compiling():
        check()
        return run()
    try:
        return run()
    except Exception as engine_error:  # re-raised below when the checks pass
        error = engine_error
    check()
    raise error


# ---- the public functions -------------------------------------------------------------------------


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    lower_bound=None,
    disable_recompute=False,
    return_intermediate_states=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
    use_graph=False,
    max_num_seqs=None,
    **kwargs,
):
    r"""Chunked (WY) KDA, the prefill and training path; fla-core 0.6.0's ``chunk_kda`` on the CPU.

    Serving (kda's addition, through ``**kwargs``): with ``ssm_state_indices`` (``[N]`` int32/int64),
    ``initial_state`` is a state pool ``[num_slots, HV, K, V]`` (or V-first; float32 or bfloat16):
    sequence n starts from slot ``ssm_state_indices[n]`` (zeros where ``has_initial_state[n]`` is
    False, or the index is negative) and its final state is written back to that slot in place (not for
    a negative index). Returns ``(o, pool)``. Inference only.

    Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (HV a multiple of H), ``g [B, T, HV, K]``,
    ``beta [B, T, HV]``; ``initial_state`` / ``final_state`` ``[N, HV, K, V]`` float32 (``[N, HV, V, K]``
    with ``state_v_first``), N = B or ``len(cu_seqlens) - 1`` (then B = 1).

    Args (as in fla): ``scale`` (default ``K ** -0.5``); ``use_qk_l2norm_in_kernel``;
    ``use_gate_in_kernel`` (``g`` is the raw gate input: ``-exp(A_log) * softplus(g + dt_bias)``, or
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound`` is given; ``A_log [HV]``
    and ``dt_bias [HV*K]`` come through ``**kwargs``); ``use_beta_sigmoid_in_kernel`` and
    ``allow_neg_eigval`` (``beta = sigmoid(b)`` or ``2 sigmoid(b)``); ``state_v_first`` (or its
    deprecated alias ``transpose_state_layout``); ``cu_seqlens`` (int32 or int64 CPU tensor of N+1
    offsets; ``cu_seqlens_cpu`` is accepted and not needed, the offsets already being on the CPU).

    Accepted because the result cannot differ on the CPU: ``chunk_size`` (32 or 64; the engine always
    chunks by 64 and its results do not depend on the chunk size beyond rounding), ``safe_gate`` (the
    engine is exact for any gate, bounded or not; fla's bound checks still apply), ``disable_recompute``,
    ``use_graph`` and ``max_num_seqs``. Not supported (``NotImplementedError``): ``cp_context`` (context
    parallelism), a headwise beta ``[B, T, HV, V]``, ``return_intermediate_states`` with ``chunk_size=32``.

    Returns ``(o, final_state)``: ``o [B, T, HV, V]`` in q's dtype, ``final_state`` or None; with
    ``return_intermediate_states=True`` also ``h``, the state entering every 64-token chunk,
    ``[B, NT, HV, K, V]`` (B = 1 and NT the total chunk count with ``cu_seqlens``) in k's dtype. ``h``
    carries no gradient, so it is refused while gradients are recorded (as fla refuses it outside
    inference mode).
    """
    _reject_unknown("chunk_kda", kwargs, _CHUNK_KWARGS)
    state_v_first = _state_v_first(state_v_first, kwargs)
    if cp_context is not None:
        raise NotImplementedError("kda: context parallelism (cp_context) is not supported on the CPU")
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise ValueError("kda: cu_seqlens_cpu was given without cu_seqlens; pass the offsets as cu_seqlens")
    if (
        use_graph
        and cu_seqlens is not None
        and max_num_seqs is not None
        and cu_seqlens.shape[0] - 1 != max_num_seqs
    ):
        raise AssertionError(
            f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
            f"got {cu_seqlens.shape[0] - 1} sequences with max_num_seqs={max_num_seqs}"
        )
    pooled = "ssm_state_indices" in kwargs or "has_initial_state" in kwargs
    # A state pool may be bf16 (read into fp32, rounded once when written); a dense state is fp32 as in fla.
    if (
        not pooled
        and initial_state is not None
        and initial_state.dtype != torch.float32
        and q.dtype != torch.float64
    ):
        raise AssertionError("initial_state must be in float32.")

    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    elif "A_log" in kwargs or "dt_bias" in kwargs:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")  # only to warn that they are unused
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(
                "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`."
            )
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    gate = _gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, "chunk_kda")
    if gate == "log_decay":
        A_log = dt_bias = None
    beta_mode = _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval)

    if pooled:
        if return_intermediate_states:
            raise NotImplementedError("kda: return_intermediate_states is not available with a state pool")
        return _pooled_prefill(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            kwargs.get("ssm_state_indices"),
            kwargs.get("has_initial_state"),
            A_log=A_log,
            dt_bias=dt_bias,
            scale=scale,
            qk_l2norm=use_qk_l2norm_in_kernel,
            gate=gate,
            lower_bound=lower_bound,
            beta_mode=beta_mode,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
        )

    if return_intermediate_states:
        if chunk_size != 64:
            raise NotImplementedError(
                "kda keeps the per-chunk states every 64 tokens: "
                "return_intermediate_states needs chunk_size=64"
            )
        if _ops.inspect_inputs((q, k, v, g, beta, A_log, dt_bias, initial_state))[0]:
            raise AssertionError(
                "return_intermediate_states is only allowed while no gradient is recorded (inference mode or "
                "torch.no_grad()): the intermediate states carry no gradient"
            )

    out_dtype, h_dtype = q.dtype, k.dtype
    o, final, chunks = _checked(
        lambda: _check_tensors(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias),
        lambda: _run(
            "chunk",
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            qk_l2norm=use_qk_l2norm_in_kernel,
            gate=gate,
            lower_bound=lower_bound,
            beta_mode=beta_mode,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            want_chunk_states=return_intermediate_states,
        ),
    )
    if o.dtype != out_dtype:
        o = o.to(out_dtype)
    if not return_intermediate_states:
        return o, final
    batch = q.shape[0]
    h = chunks.reshape(batch, chunks.shape[0] // batch, *chunks.shape[1:]).to(h_dtype)
    return o, final, h


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    r"""Token-by-token KDA, the decode path; fla-core 0.6.0's ``fused_recurrent_kda`` on the CPU.

    The same tensors, options and returns as :func:`chunk_kda` (``A_log [HV]`` and ``dt_bias [HV*K]``
    as arguments here), computed by the recurrent kernel, and differentiable (fla's version is forward
    only). ``initial_state`` of another float dtype is read as float32. Returns ``(o, final_state)``:
    ``o`` in v's dtype, ``final_state`` float32 or None.
    """
    _reject_unknown("fused_recurrent_kda", kwargs, _RECURRENT_KWARGS)
    state_v_first = _state_v_first(state_v_first, kwargs)
    gate = _gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, False, "fused_recurrent_kda")
    if gate == "log_decay":
        A_log = dt_bias = None
    beta_mode = _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval)

    out_dtype = v.dtype
    o, final, _ = _checked(
        lambda: _check_tensors(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias),
        lambda: _run(
            "recurrent",
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            qk_l2norm=use_qk_l2norm_in_kernel,
            gate=gate,
            lower_bound=lower_bound,
            beta_mode=beta_mode,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
        ),
    )
    return (o if o.dtype == out_dtype else o.to(out_dtype)), final


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    r"""KDA's gate as a differentiable function; fla-core 0.6.0's ``fused_kda_gate``.

    ``g [..., HV, K]`` is the raw gate input, ``A_log [HV]``, ``dt_bias [HV*K]`` (optional). Returns the
    log decay ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None:
    ``lower_bound * sigmoid(g + dt_bias)``), computed in float32 (float64 for float64 input) and
    returned in ``output_dtype``. Softplus is linear above 20, as in torch, fla and kda's fused gate.
    """
    if g.dim() < 2:
        raise ValueError(f"kda: g must have shape [..., HV, K], got {list(g.shape)}")
    HV, K = g.shape[-2:]
    compute = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(compute)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(
                f"kda: dt_bias must have HV*K = {HV * K} elements, got shape {list(dt_bias.shape)}"
            )
        x = x + dt_bias.to(compute).reshape(HV, K)
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"kda: A_log must have HV = {HV} elements, got shape {list(A_log.shape)}")
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda: fused_kda_gate needs A_log for the softplus gate (or a lower_bound)")
        y = -A_log.to(compute).reshape(HV, 1).exp() * F.softplus(x)
    else:
        if A_log is not None:
            x = A_log.to(compute).reshape(HV, 1).exp() * x
        y = lower_bound * torch.sigmoid(x)
    return y.to(output_dtype)


# ---- serving: state pools updated in place ---------------------------------------------------------


def _serving_plain(function, tensors):
    """Refuses a call that would record a gradient (serving updates a pool in place); returns whether
    the tensors are plain (see _ops.inspect_inputs)."""
    recorded, plain = _ops.inspect_inputs(tensors)
    if recorded:
        raise RuntimeError(
            f"kda: {function} updates a state pool in place and records no gradient; call it under "
            "torch.no_grad() / inference_mode (chunk_kda and fused_recurrent_kda are differentiable)"
        )
    return plain


def _serving_checks(
    function, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, indices=(None, None)
):
    """fla-style checks of a serving call (run by _checked: after the engine refused the call)."""
    _check_cpu(_DEVICE_CHECKED, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias))
    _check_varlen(q, None, cu_seqlens)
    _check_shapes(q, k, v, g, beta)
    for name, t in zip(("ssm_state_indices", "num_accepted_tokens"), indices, strict=True):
        _index_tensor(name, t)
    acts = (q, k, v, g, beta)
    for name, t in zip(_NAMES, acts, strict=True):
        if not t.is_floating_point():
            raise TypeError(f"kda: '{name}' must be a floating-point tensor, got {t.dtype}")
    if any(t.dtype == torch.float64 for t in acts):  # checked on the dtypes: no cast is made here
        raise TypeError(f"kda: {function} computes in float32 / bfloat16; got float64 inputs")


def _serving_inputs(function, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
    """Checks and casts shared by the serving entries; returns the prepared activations."""
    _serving_plain(function, (q, k, v, g, beta, A_log, dt_bias, initial_state))
    _serving_checks(function, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    return _prepare_activations(q, k, v, g, beta)[0]


def _index_tensor(name, t):
    if t is None:
        return None
    if t.device.type != "cpu":
        raise NotImplementedError(f"kda computes on the CPU: '{name}' is on {t.device}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kda: '{name}' must be an int32 or int64 tensor, got {t.dtype}")
    return t


def _side_f32(t):
    return None if t is None else _side(t, torch.float32)


def _pooled_prefill(
    q,
    k,
    v,
    g,
    beta,
    pool,
    indices,
    has_initial_state,
    *,
    A_log,
    dt_bias,
    scale,
    qk_l2norm,
    gate,
    lower_bound,
    beta_mode,
    state_v_first,
    cu_seqlens,
    path="chunk",
):
    if pool is None:
        raise ValueError("kda: ssm_state_indices needs the state pool as initial_state")
    if indices is None:
        raise ValueError("kda: has_initial_state needs ssm_state_indices (the pool slot of every sequence)")
    out_dtype = q.dtype
    q, k, v, g, beta = _serving_inputs(
        "chunk_kda (pooled)", q, k, v, g, beta, A_log, dt_bias, pool, cu_seqlens
    )
    if gate == "lower_bound" and A_log is None:
        A_log = torch.zeros(v.shape[2])
    flags = None
    if has_initial_state is not None:
        flags = (
            has_initial_state if has_initial_state.dtype == torch.bool else has_initial_state.to(torch.uint8)
        )
    grad, plain = _ops.inspect_inputs((q, k, v, g, beta, A_log, dt_bias, pool, indices, cu_seqlens))
    o = _ops.pooled_forward(
        path,
        plain,
        q,
        k,
        v,
        g,
        beta,
        _side_f32(A_log),
        _side_f32(dt_bias),
        pool,
        _index_tensor("ssm_state_indices", indices),
        flags,
        cu_seqlens,
        float(q.shape[-1] ** -0.5 if scale is None else scale),
        bool(state_v_first),
        bool(qk_l2norm),
        gate,
        float(-5.0 if lower_bound is None else lower_bound),
        beta_mode,
    )
    return (o if o.dtype == out_dtype else o.to(out_dtype)), pool


def fused_recurrent_kda_fwd(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    initial_state=None,
    scale=None,
    output_final_state=False,
    inplace_final_state=True,
    state_v_first=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    out=None,
    **kwargs,
):
    r"""Batched decode on a state pool: fla-core 0.6.0's ``fused_recurrent_kda_fwd``, the entry vLLM
    and SGLang call, on kda's decode kernel (inference only).

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``: B requests of
    T tokens (one, or a few speculative ones), or ``cu_seqlens`` (N + 1 offsets, zero-length requests
    allowed) with B = 1. The gate, beta and L2-norm options are those of ``fused_recurrent_kda``.

    With ``ssm_state_indices``, ``initial_state`` is the pool ``[num_slots, HV, K, V]`` (``[num_slots,
    HV, V, K]`` with ``state_v_first``; float32 or bfloat16, each slot packed):
      - ``[N]`` indices: request n starts from slot ``ssm_state_indices[n]`` and, with
        ``inplace_final_state`` (the default), its final state is written back there;
      - ``[N, C]`` indices: it starts from slot ``ssm_state_indices[n, num_accepted_tokens[n] - 1]``
        (column 0 without ``num_accepted_tokens``) and the state after its token t is written to slot
        ``ssm_state_indices[n, t]`` (negative: not written);
      - a negative starting index marks a padding row: nothing read or written, output rows zero.
    An index past the pool, a slot written twice, or read by one request and written by another, and an
    accepted count outside 1..C raise ``ValueError`` before anything is written. With
    ``inplace_final_state=False`` the pool is left alone and the state after each request's last
    token comes back as a new ``[N, HV, K, V]`` tensor (when ``output_final_state``).

    Without ``ssm_state_indices``, ``initial_state`` is ``[N, HV, K, V]`` and is updated in place with
    ``inplace_final_state`` (fla's behaviour), or left alone.

    ``out``: an optional ``[B, T, HV, V]`` tensor of v's dtype for the output. Returns ``(o,
    final_state)``: the pool (or the updated ``initial_state``) in place, else the new states or None.
    """
    _reject_unknown("fused_recurrent_kda_fwd", kwargs, _RECURRENT_KWARGS)
    state_v_first = _state_v_first(state_v_first, kwargs)
    gate = _gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, False, "fused_recurrent_kda_fwd")
    if gate == "log_decay":
        A_log = dt_bias = None
    beta_mode = _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if num_accepted_tokens is not None and ssm_state_indices is None:
        raise ValueError("kda: num_accepted_tokens needs ssm_state_indices (speculative decoding on a pool)")
    if ssm_state_indices is not None and initial_state is None:
        raise ValueError("kda: ssm_state_indices needs the state pool as initial_state")
    plain = _serving_plain(
        "fused_recurrent_kda_fwd", (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out)
    )
    # The engine validates every argument before it writes anything; fla's checks run only when it
    # refused the call (they would cost as much as the rest of a decode step's Python layer).
    return _checked(
        lambda: _serving_checks(
            "fused_recurrent_kda_fwd",
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            initial_state,
            cu_seqlens,
            (ssm_state_indices, num_accepted_tokens),
        ),
        lambda: _decode(
            plain,
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            initial_state,
            scale,
            output_final_state,
            inplace_final_state,
            state_v_first,
            cu_seqlens,
            ssm_state_indices,
            num_accepted_tokens,
            use_qk_l2norm_in_kernel,
            gate,
            lower_bound,
            beta_mode,
            out,
        ),
    )


def _decode(
    plain,
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    initial_state,
    scale,
    output_final_state,
    inplace_final_state,
    state_v_first,
    cu_seqlens,
    ssm_state_indices,
    num_accepted_tokens,
    qk_l2norm,
    gate,
    lower_bound,
    beta_mode,
    out,
):
    """fused_recurrent_kda_fwd once its options are resolved."""
    out_dtype = v.dtype
    (q, k, v, g, beta), state_dtype = _prepare_activations(q, k, v, g, beta)
    if state_dtype == torch.float64:
        raise TypeError("kda: fused_recurrent_kda_fwd computes in float32 / bfloat16; got float64 inputs")
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (HV, V, K) if state_v_first else (HV, K, V)
    indices = _index_tensor("ssm_state_indices", ssm_state_indices)
    accepted = _index_tensor("num_accepted_tokens", num_accepted_tokens)

    if indices is None:
        if initial_state is None:
            pool, returned = torch.zeros((N, *state)), True
        elif inplace_final_state:
            pool, returned = initial_state, True
        else:
            pool, returned = initial_state.clone(), output_final_state
        indices = torch.arange(N)
    elif inplace_final_state:
        pool, returned = initial_state, True
    else:  # the pool stays as it is: the starting states are gathered into a pool of N slots
        pool, indices = _gather_starting_states(initial_state, indices, accepted, N)
        accepted, returned = None, output_final_state

    o = None  # the engine's output buffer: out itself when it is of the compute dtype
    if out is not None:
        if tuple(out.shape) != tuple(v.shape) or out.dtype != out_dtype:
            raise ValueError(
                f"kda: out must be a [B, T, HV, V] = {list(v.shape)} tensor of v's dtype {out_dtype}, got "
                f"{list(out.shape)} {out.dtype}"
            )
        o = out if out.dtype == v.dtype and out.stride(-1) == 1 else None
    if o is None:
        o = torch.empty_like(v) if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)
    if gate == "lower_bound" and A_log is None:
        A_log = torch.zeros(HV)
    _ops.decode(
        plain,
        q,
        k,
        v,
        g,
        beta,
        _side_f32(A_log),
        _side_f32(dt_bias),
        pool,
        indices,
        accepted,
        cu_seqlens,
        float(K**-0.5 if scale is None else scale),
        bool(state_v_first),
        bool(qk_l2norm),
        gate,
        float(-5.0 if lower_bound is None else lower_bound),
        beta_mode,
        o,
    )
    if out is not None and o is not out:
        out.copy_(o)
        o = out
    elif o.dtype != out_dtype:
        o = o.to(out_dtype)
    return o, (pool if returned else None)


def _gather_starting_states(pool, indices, accepted, N):
    """The state each request starts from, as a fresh pool of N slots (padding rows zero, index -1)."""
    table = indices.reshape(N, -1).long()
    column = torch.zeros(N, dtype=torch.long) if accepted is None else accepted.long() - 1
    if accepted is not None and ((column < 0) | (column >= table.shape[1])).any():
        raise ValueError(
            f"kda: num_accepted_tokens must lie in 1..{table.shape[1]} (the columns of ssm_state_indices)"
        )
    start = table.gather(1, column.view(N, 1)).view(N)
    if (start >= pool.shape[0]).any():
        raise ValueError(f"kda: ssm_state_indices has an index past the pool's {pool.shape[0]} slots")
    valid = start >= 0
    gathered = torch.zeros((N, *pool.shape[1:]), dtype=pool.dtype)
    gathered[valid] = pool[start[valid]]
    return gathered, torch.where(valid, torch.arange(N), torch.full((N,), -1))
