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

The serving entries (``fused_recurrent_kda_fwd``, and the pooled prefill ``chunk_kda`` routes to when
given ``ssm_state_indices``) live in ``kda.serving``; ``fused_recurrent_kda_fwd`` is importable from
here too.
"""

import torch
import torch.nn.functional as F

from . import _ops
from . import cp as _cp
from ._arguments import (
    RECURRENT_KWARGS,
    check_floating,
    check_lower_bound,
    check_types,
    gate_mode,
    reject_unknown,
    state_v_first_of,
)
from ._call import Call, problem_of
from ._compute import chunk_path, run
from ._family import KDA
from .serving import fused_recurrent_kda_fwd, pooled_prefill

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "fused_kda_gate"]

_CHUNK_KWARGS = frozenset(
    {
        "A_log",
        "dt_bias",
        "chunk_size",
        "transpose_state_layout",
        "ssm_state_indices",
        "has_initial_state",
        "precision",
    }
)


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
    ``use_graph`` and ``max_num_seqs``. Not supported (``NotImplementedError``): a headwise beta
    ``[B, T, HV, V]``, ``return_intermediate_states`` with ``chunk_size=32``.

    ``precision`` (kda's addition, through ``**kwargs``): "exact" (the default) or "bf16", the chunked
    forward's matrix products on bf16 operands summed in fp32 on the CPU's AMX or AVX512-BF16 units
    (``kda.engine.bf16_product_unit()``): within 5e-3 of exact, not exact; the backward stays exact.
    Not with a state pool or ``cp_context`` (``NotImplementedError``).

    ``cp_context`` (context parallelism over ``torch.distributed``, ``kda.cp.build_cp_context``): the
    tensors are this rank's shard of a packed B = 1 batch (the context's ``cu_seqlens`` replace
    ``cu_seqlens``); no ``initial_state`` or ``output_final_state`` (``AssertionError``, as in fla);
    forward and backward exchange data with the other ranks (see ``kda.cp``).

    Returns ``(o, final_state)``: ``o [B, T, HV, V]`` in q's dtype, ``final_state`` or None; with
    ``return_intermediate_states=True`` also ``h``, the state entering every 64-token chunk,
    ``[B, NT, HV, K, V]`` (B = 1 and NT the total chunk count with ``cu_seqlens``) in k's dtype. ``h``
    carries no gradient, so it is refused while gradients are recorded (as fla refuses it outside
    inference mode).
    """
    if cp_context is not None and not isinstance(cp_context, _cp.Call):
        return _cp.Call.run(chunk_kda, locals())  # every rank learns of a bad argument on any rank
    reject_unknown("chunk_kda", kwargs, _CHUNK_KWARGS)
    state_v_first = state_v_first_of(state_v_first, kwargs)
    if cu_seqlens is None and cu_seqlens_cpu is not None and cp_context is None:
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
        and isinstance(initial_state, torch.Tensor)  # (anything else: named by the tensor checks)
        and initial_state.dtype != torch.float32
        and not (isinstance(q, torch.Tensor) and q.dtype == torch.float64)
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
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, "chunk_kda")
    if gate == "log_decay":
        A_log = dt_bias = None
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    if cp_context is not None:
        if pooled or return_intermediate_states:
            raise NotImplementedError(
                "kda: cp_context does not take a state pool (ssm_state_indices) or return_intermediate_states"
            )
        cu_seqlens = cp_context.begin(KDA, tensors, output_final_state, cu_seqlens)
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    problem = problem_of(KDA, q, cu_seqlens, gate, lower_bound, flags)
    path = chunk_path(kwargs, pooled, cp_context)
    keep = return_intermediate_states
    call = Call(KDA, "chunk_kda", path, tensors, problem, output_final_state, "q", keep, cp_context)
    if pooled:
        if return_intermediate_states:
            raise NotImplementedError("kda: return_intermediate_states is not available with a state pool")
        call.indices = kwargs.get("ssm_state_indices")
        call.has_initial_state = kwargs.get("has_initial_state")
        return pooled_prefill(call)

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

    o, final, chunks = run(call)
    if not return_intermediate_states:
        return o, final
    batch = q.shape[0]
    h = chunks.reshape(batch, chunks.shape[0] // batch, *chunks.shape[1:]).to(k.dtype)
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
    reject_unknown("fused_recurrent_kda", kwargs, RECURRENT_KWARGS)
    state_v_first = state_v_first_of(state_v_first, kwargs)
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, False, "fused_recurrent_kda")
    if gate == "log_decay":
        A_log = dt_bias = None
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    problem = problem_of(KDA, q, cu_seqlens, gate, lower_bound, flags)
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    call = Call(KDA, "fused_recurrent_kda", "recurrent", tensors, problem, output_final_state, "v")
    return run(call)[:2]


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    r"""KDA's gate as a differentiable function; fla-core 0.6.0's ``fused_kda_gate``.

    ``g [..., HV, K]`` is the raw gate input, ``A_log [HV]``, ``dt_bias [HV*K]`` (optional). Returns the
    log decay ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None:
    ``lower_bound * sigmoid(g + dt_bias)``), computed in float32 (float64 for float64 input) and
    returned in ``output_dtype``. Softplus is linear above 20, as in torch, fla and kda's fused gate.
    As in the kernels' fused gate, ``exp(A_log)`` is clamped to the compute dtype's largest value and
    so is the log decay's magnitude: a finite input gives a finite gate (fla's gives ``-inf`` or NaN
    past ``A_log = 88``). Bad arguments are errors naming them, as in :func:`chunk_kda`.
    """
    check_types(("g", "A_log", "dt_bias"), (g, A_log, dt_bias), 1)
    check_floating(("g", "A_log", "dt_bias"), (g, A_log, dt_bias))
    if not (isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point):
        raise TypeError(f"kda: output_dtype must be a floating-point torch.dtype, got {output_dtype!r}")
    if lower_bound is not None:
        check_lower_bound(lower_bound)
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
    largest = torch.finfo(compute).max
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda: fused_kda_gate needs A_log for the softplus gate (or a lower_bound)")
        # (clamped: exp(A_log) = inf times a softplus that underflows to 0 would be NaN)
        rate = A_log.to(compute).reshape(HV, 1).exp().clamp(max=largest)
        y = (-rate * F.softplus(x)).clamp(min=-min(largest, torch.finfo(output_dtype).max))
    else:
        if A_log is not None:
            x = A_log.to(compute).reshape(HV, 1).exp().clamp(max=largest) * x
        y = lower_bound * torch.sigmoid(x)
    return y.to(output_dtype)
