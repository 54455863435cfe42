"""flash-linear-attention's gated delta rule (Gated DeltaNet, GDN) functions, on kda's engine on the CPU.

The gated delta rule is KDA with one log decay per token and value head (``g [B, T, HV]``) instead of
one per key channel: the state decays as a whole. kda computes it as a problem of its own (the
family ``kda._family.GDN``, the problem option ``gate_width="per_head"``), with kernels for the
scalar gate, forward and backward.

``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` take the arguments of fla-core
0.6.0's functions of the same names, with the same defaults, returns and exception types where fla
checks; both are differentiable (fla's recurrent one is forward only), through the same
``torch.library`` custom ops as kda's KDA functions, so they trace under ``torch.compile``.
``chunk_gdn`` and ``fused_recurrent_gdn`` are the short names fla exports too.

``fused_recurrent_gated_delta_rule`` also takes fla's other gates: ``gk [B, T, HV, K]`` (a decay per
key channel) is KDA's gate and runs on kda's KDA path; ``gv`` (a decay per value channel) is
computed by kda's float64 oracle only. dtypes, devices, copies and threads are as for
``kda.functional`` (docs/python.md).
"""

import torch

from . import cp as _cp
from ._arguments import (
    RECURRENT_KWARGS,
    check_key_gate,
    check_types,
    gate_mode,
    positional_beta_hint,
    reject_unknown,
    state_v_first_of,
)
from ._call import Call, problem_of
from ._compute import chunk_path, run
from ._family import GDN, GV
from .functional import fused_recurrent_kda
from .serving import pooled_prefill

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gdn",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gdn",
]

_CHUNK_KWARGS = frozenset(
    {
        "A_log",
        "dt_bias",
        "use_gate_in_kernel",
        "chunk_size",
        "transpose_state_layout",
        "head_first",
        "ssm_state_indices",
        "has_initial_state",
        "precision",
    }
)


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    r"""The chunked gated delta rule, for prefill and training; fla-core 0.6.0's
    ``chunk_gated_delta_rule`` on the CPU.

    Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (HV a multiple of H: grouped value heads),
    ``g [B, T, HV]``, ``beta [B, T, HV]``; ``initial_state`` / ``final_state`` ``[N, HV, K, V]``
    (``[N, HV, V, K]`` with ``state_v_first``), N = B, or ``len(cu_seqlens) - 1`` with B = 1.

    Through ``**kwargs`` (as in fla): ``use_gate_in_kernel`` (``g`` is the raw gate input of
    ``-exp(A_log) * softplus(g + dt_bias)``), ``A_log [HV]`` (required with it), ``dt_bias [HV]``
    (optional), ``chunk_size`` (16, 32 or 64: accepted, the result does not depend on it beyond
    rounding), ``transpose_state_layout`` (deprecated alias of ``state_v_first``). kda's addition, the
    pooled prefill: with ``ssm_state_indices`` (``[N]``), ``initial_state`` is a state pool; sequence n
    starts from slot ``ssm_state_indices[n]`` (zeros where ``has_initial_state[n]`` is False or the
    index is negative) and its final state goes back there; returns ``(o, pool)`` (inference only).
    ``precision="bf16"`` (kda's addition too): the chunked forward's matrix products on bf16 operands,
    as for ``kda.chunk_kda``. Any other keyword: ``TypeError`` naming it.

    ``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval``: beta given as logits (``sigmoid(beta)`` or
    ``2 sigmoid(beta)``); ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + 1e-6)`` of q and k rows;
    ``scale`` defaults to ``K ** -0.5``. ``cu_seqlens_cpu`` and ``chunk_indices`` are accepted and
    not needed (the offsets are on the CPU already). ``cp_context``: context parallelism over
    ``torch.distributed`` (``kda.cp.build_cp_context``; B = 1, no ``initial_state`` or
    ``output_final_state``), as for ``kda.chunk_kda``.

    Returns ``(o, final_state)``: ``o [B, T, HV, V]`` in q's dtype, ``final_state`` float32 or None.
    Every input gets its exact gradient (q, k, v, g, beta, A_log, dt_bias, initial_state).
    """
    if cp_context is not None and not isinstance(cp_context, _cp.Call):
        return _cp.Call.run(chunk_gated_delta_rule, locals())  # every rank learns of a bad argument
    reject_unknown("chunk_gated_delta_rule", kwargs, _CHUNK_KWARGS)
    state_v_first = state_v_first_of(state_v_first, kwargs)
    if "head_first" in kwargs:
        raise DeprecationWarning("kda: head_first is not supported; pass tensors as [B, T, H, ...]")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"kda: chunk_size must be 16, 32 or 64 for the gated delta rule, got {chunk_size}")
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if use_gate_in_kernel and A_log is None:
        raise AssertionError("kda: use_gate_in_kernel=True needs A_log [HV]")
    # (called here, not through a helper: its UserWarning names the caller's line, as for chunk_kda)
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, None, False, "chunk_gated_delta_rule")
    if gate == "log_decay":
        A_log = dt_bias = None
    pooled = "ssm_state_indices" in kwargs or "has_initial_state" in kwargs
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    if cp_context is not None:
        if pooled:
            raise NotImplementedError("kda: cp_context does not take a state pool (ssm_state_indices)")
        cu_seqlens = cp_context.begin(GDN, tensors, output_final_state, cu_seqlens)
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    problem = problem_of(GDN, q, cu_seqlens, gate, None, flags)
    path = chunk_path(kwargs, pooled, cp_context)
    function = "chunk_gated_delta_rule"
    call = Call(GDN, function, path, tensors, problem, output_final_state, "q", cp=cp_context)
    if pooled:
        call.indices = kwargs.get("ssm_state_indices")
        call.has_initial_state = kwargs.get("has_initial_state")
        return pooled_prefill(call)
    return run(call)[:2]


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    gk=None,
    gv=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    r"""The token-by-token gated delta rule, for decoding from a state; fla-core 0.6.0's
    ``fused_recurrent_gated_delta_rule`` on the CPU, differentiable (fla's is forward only).

    The tensors, options and returns of :func:`chunk_gated_delta_rule` (``A_log [HV]``, ``dt_bias
    [HV]`` and ``use_gate_in_kernel`` as arguments here), computed by kda's recurrent kernel. The gate
    is one of:

    - ``g [B, T, HV]``: one log decay per token and value head (or the raw gate input with
      ``use_gate_in_kernel``);
    - ``gk [B, T, HV, K]``: one log decay per key channel, KDA's gate: the call is
      ``kda.fused_recurrent_kda`` (the fused gate applies to ``g`` only, as in fla: ``gk`` with
      ``use_gate_in_kernel`` needs ``g``, which kda does not take together with ``gk``);
    - ``gv [B, T, HV, V]``: one log decay per value channel (the family ``kda._family.GV``): the
      state's columns decay. float64 inputs run on kda's float64 oracle (forward only); kda's
      kernels do not compute it yet (``NotImplementedError``);
    - none: no decay (the plain delta rule).

    ``gk`` or ``gv`` of another shape or rank: ``ValueError`` naming it. ``g`` and ``gk`` together:
    ``ValueError``; ``gv`` with another gate: ``NotImplementedError``. ``beta`` defaults to ones (no
    ``beta`` means a full update).
    ``initial_state`` of another float dtype is read as float32. Returns ``(o, final_state)``: ``o``
    in v's dtype, ``final_state`` float32 or None. Only ``transpose_state_layout`` is accepted through
    ``**kwargs``.
    """
    reject_unknown("fused_recurrent_gated_delta_rule", kwargs, RECURRENT_KWARGS)
    state_v_first = state_v_first_of(state_v_first, kwargs)
    # beta's and g's defaults are built from v, and gk's checks read q, k and v: their types first
    check_types(("q", "k", "v", "gk", "gv"), (q, k, v, gk, gv), 3)
    if gv is not None and (g is not None or gk is not None):
        raise NotImplementedError(
            "kda: 'gv' (a decay per value channel) together with another gate is not supported; pass one "
            "gate: g [B, T, HV], gk [B, T, HV, K] or gv [B, T, HV, V]"
        )
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("kda: use_gate_in_kernel=True needs A_log [HV]")
        if g is None:
            raise ValueError("kda: use_gate_in_kernel=True needs g, the raw gate input [B, T, HV]")
    if g is not None and gk is not None:
        raise ValueError(
            "kda: pass one gate, 'g' [B, T, HV] (per head) or 'gk' [B, T, HV, K] (per key channel), not both"
            + positional_beta_hint(gk)
        )
    # Before gk's route too: A_log / dt_bias without use_gate_in_kernel warn whichever the gate is.
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, None, False, "fused_recurrent_gated_delta_rule")
    if gate == "log_decay":
        A_log = dt_bias = None
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype)
    if gk is not None:
        # KDA's gate: fla applies A_log / dt_bias only to g (use_gate_in_kernel without g was refused
        # above), so gk is always a log decay here.
        check_key_gate(gk, q, k, v)
        return fused_recurrent_kda(
            q,
            k,
            v,
            gk,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
        )
    family = GDN
    if gv is not None:  # a decay per value channel (fla applies A_log / dt_bias to g only)
        family, g = GV, gv
    elif g is None:  # no decay
        g = torch.zeros(v.shape[:3], dtype=v.dtype if v.dtype.is_floating_point else torch.float32)
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    problem = problem_of(family, q, cu_seqlens, gate, None, flags)
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    function = "fused_recurrent_gated_delta_rule"
    call = Call(family, function, "recurrent", tensors, problem, output_final_state, "v")
    return run(call)[:2]


# fla's short names.
chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
