"""Serving: KDA and the gated delta rule on state pools updated in place (inference only).

``fused_recurrent_kda_fwd`` is fla-core 0.6.0's batched decode entry (the one vLLM and SGLang call),
on kda's decode kernel, and ``fused_recurrent_gdn_fwd`` the same decode with the gated delta rule's
per-head gate; ``pooled_prefill`` is the prefill that ``kda.chunk_kda`` and
``kda.chunk_gated_delta_rule`` route to when given ``ssm_state_indices`` / ``has_initial_state``: each
sequence starts from a pool slot and its final state goes back to that slot. None records a gradient
(``kda.chunk_kda``, ``kda.fused_recurrent_kda`` and the gated delta rule's functions of the same kind
are the differentiable ones).
"""

import torch

from . import _ops
from ._arguments import (
    DEVICE_CHECKED,
    NAMES,
    RECURRENT_KWARGS,
    SERVING_NAMES,
    check_cpu,
    check_floating,
    check_shapes,
    check_types,
    check_varlen,
    fla_errors,
    gate_mode,
    in_python_names,
    prepare_activations,
    reject_unknown,
    side_f32,
    state_v_first_of,
)
from ._call import Call, problem_of
from ._family import GDN, KDA

__all__ = ["fused_recurrent_gdn_fwd", "fused_recurrent_kda_fwd", "pooled_prefill"]


def _serving_plain(function, tensors):
    """Refuses a call that would record a gradient (serving updates a pool in place); returns whether
    the tensors are plain (see _ops.inspect_inputs)."""
    recorded, plain = _ops.inspect_inputs(tensors)
    if recorded:
        raise RuntimeError(
            f"kda: {function} updates a state pool in place and records no gradient; call it under "
            "torch.no_grad() / inference_mode (kda's chunk_* and fused_recurrent_* functions are "
            "differentiable)"
        )
    return plain


def _serving_checks(call):
    """fla-style checks of a serving call (a ``_call.Call``; run as _arguments.fla_errors runs them:
    after the engine refused the call)."""
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    cu_seqlens = call.problem.cu_seqlens
    tensors = (q, k, v, g, beta, call.initial_state, cu_seqlens, call.A_log, call.dt_bias)
    check_types(DEVICE_CHECKED, tensors, len(NAMES))
    check_types(("out", "has_initial_state"), (call.out, call.has_initial_state), 0)
    check_cpu(DEVICE_CHECKED, tensors)
    check_varlen(q, None, cu_seqlens)
    check_shapes(q, k, v, g, beta, call.family)
    for name, t in (("ssm_state_indices", call.indices), ("num_accepted_tokens", call.num_accepted_tokens)):
        _index_tensor(name, t)
    acts = (q, k, v, g, beta)
    check_floating(NAMES, acts)
    if any(t.dtype == torch.float64 for t in acts):  # checked on the dtypes: no cast is made here
        raise TypeError(f"kda: {call.function} computes in float32 / bfloat16; got float64 inputs")


_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_tensor(name, t):
    # (is_cpu and a module-level tuple: a decode step calls this twice, t.device costs a quarter us)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kda: '{name}' must be an int32 or int64 tensor or None, got {type(t).__name__}")
    if not t.is_cpu:
        raise NotImplementedError(f"kda computes on the CPU: '{name}' is on {t.device}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"kda: '{name}' must be an int32 or int64 tensor, got {t.dtype}")
    return t


# ---- the pooled prefill (chunk_kda with ssm_state_indices) -----------------------------------------


def pooled_prefill(call):
    """The chunked call of a family (chunk_kda, chunk_gated_delta_rule: a ``_call.Call``) on a state
    pool, ``call.initial_state``: sequence n starts from slot ``call.indices[n]`` (zeros where
    ``call.has_initial_state[n]`` is False or the index is negative) and its final state is written
    back there. Returns (o, pool). fla's checks run as for the decode: only when the engine refused
    the call."""
    pool, indices, has_initial_state = call.initial_state, call.indices, call.has_initial_state
    function = call.function = f"{call.function} (pooled)"
    if pool is None:
        raise ValueError("kda: ssm_state_indices needs the state pool as initial_state")
    if indices is None:
        raise ValueError("kda: has_initial_state needs ssm_state_indices (the pool slot of every sequence)")
    q, k, v, g, beta, A_log, dt_bias = call.q, call.k, call.v, call.g, call.beta, call.A_log, call.dt_bias
    out_dtype = call.out_dtype
    try:
        _serving_plain(function, (q, k, v, g, beta, A_log, dt_bias, pool))
    except AttributeError:  # an argument that is not a tensor: the checks name it
        _serving_checks(call)
        raise
    with fla_errors(_serving_checks, call, names=SERVING_NAMES):
        options = call.problem
        q, k, v, g, beta = prepare_activations(q, k, v, g, beta)[0]
        if options.gate == "lower_bound" and A_log is None:
            A_log = torch.zeros(v.shape[2])
        flags = None
        if has_initial_state is not None:
            flags = (
                has_initial_state
                if has_initial_state.dtype == torch.bool
                else has_initial_state.to(torch.uint8)
            )
        _, plain = _ops.inspect_inputs((q, k, v, g, beta, A_log, dt_bias, pool, indices, options.cu_seqlens))
        o = _ops.pooled_forward(
            call.path,
            plain,
            q,
            k,
            v,
            g,
            beta,
            side_f32(A_log, "A_log"),
            side_f32(dt_bias, "dt_bias"),
            pool,
            _index_tensor("ssm_state_indices", indices),
            flags,
            *options,
        )
    return (o if o.dtype == out_dtype else o.to(out_dtype)), pool


# ---- the decode (fla's fused_recurrent_kda_fwd) ------------------------------------------------------


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
    ``inplace_final_state`` (fla's behaviour), or left alone. No ``initial_state`` (fla asserts
    one with ``inplace_final_state``): every request starts from zeros, and its final state comes back
    only with ``output_final_state``.

    ``out``: an optional ``[B, T, HV, V]`` tensor of v's dtype for the output. Returns ``(o,
    final_state)``: the pool (or the updated ``initial_state``) in place, else the new states or None.
    """
    reject_unknown("fused_recurrent_kda_fwd", kwargs, RECURRENT_KWARGS)
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, False, "fused_recurrent_kda_fwd")
    state_v_first = state_v_first_of(state_v_first, kwargs)
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    tensors = (q, k, v, g, beta, *((None, None) if gate == "log_decay" else (A_log, dt_bias)), initial_state)
    problem = problem_of(KDA, q, cu_seqlens, gate, lower_bound, flags)
    pool = (ssm_state_indices, num_accepted_tokens, inplace_final_state, out)
    call = Call(
        KDA, "fused_recurrent_kda_fwd", "recurrent", tensors, problem, output_final_state, "v", serving=pool
    )
    return decode(call)


def fused_recurrent_gdn_fwd(
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
    out=None,
    **kwargs,
):
    r"""Batched decode of the gated delta rule (GDN) on a state pool, on kda's decode kernel (inference
    only): :func:`fused_recurrent_kda_fwd` with the per-head gate.

    The arguments, pool layouts, slot semantics (``ssm_state_indices`` ``[N]`` or ``[N, C]`` with
    ``num_accepted_tokens``, negative indices as padding rows), ``inplace_final_state``, ``out`` and
    returns are those of :func:`fused_recurrent_kda_fwd`; the differences are the gate's: ``g [B, T,
    HV]`` is the log decay, or with ``use_gate_in_kernel`` the raw input of ``-exp(A_log) * softplus(g +
    dt_bias)`` with ``A_log [HV]`` and ``dt_bias [HV]``; there is no ``lower_bound`` gate.
    """
    reject_unknown("fused_recurrent_gdn_fwd", kwargs, RECURRENT_KWARGS)
    gate = gate_mode(use_gate_in_kernel, A_log, dt_bias, None, False, "fused_recurrent_gdn_fwd")
    state_v_first = state_v_first_of(state_v_first, kwargs)
    flags = (scale, state_v_first, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    tensors = (q, k, v, g, beta, *((None, None) if gate == "log_decay" else (A_log, dt_bias)), initial_state)
    problem = problem_of(GDN, q, cu_seqlens, gate, None, flags)
    pool = (ssm_state_indices, num_accepted_tokens, inplace_final_state, out)
    call = Call(
        GDN, "fused_recurrent_gdn_fwd", "recurrent", tensors, problem, output_final_state, "v", serving=pool
    )
    return decode(call)


def decode(call):
    """The serving decode of every family with a decode kernel (fused_recurrent_kda_fwd,
    fused_recurrent_gdn_fwd): ``call`` is their ``_call.Call``."""
    if call.num_accepted_tokens is not None and call.indices is None:
        raise ValueError("kda: num_accepted_tokens needs ssm_state_indices (speculative decoding on a pool)")
    if call.indices is not None and call.initial_state is None:
        raise ValueError("kda: ssm_state_indices needs the state pool as initial_state")
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    try:
        plain = _serving_plain(
            call.function,
            (
                q,
                k,
                v,
                g,
                beta,
                call.A_log,
                call.dt_bias,
                call.initial_state,
                call.problem.cu_seqlens,
                call.out,
            ),
        )
    except AttributeError:  # an argument that is not a tensor: the checks name it
        _serving_checks(call)
        raise

    # The engine validates every argument before it writes anything; fla's checks run only when it
    # refused the call (they would cost as much as the rest of a decode step's Python layer), or first
    # when torch.compile traces (_arguments.fla_errors, spelled out: this is the decode step).
    if torch.compiler.is_compiling():
        _serving_checks(call)
    try:
        return _decode(plain, call)
    except Exception as engine_error:  # re-raised below when the checks pass
        error = engine_error
    _serving_checks(call)
    raise in_python_names(error)


def _decode(plain, call):
    """The serving decode of ``call`` once it is resolved (its problem options hold the family's gate
    width)."""
    q, k, v, g, beta, A_log, dt_bias = call.q, call.k, call.v, call.g, call.beta, call.A_log, call.dt_bias
    options, initial_state, out = call.problem, call.initial_state, call.out
    ssm_state_indices, inplace_final_state = call.indices, call.inplace_final_state
    out_dtype = v.dtype
    (q, k, v, g, beta), state_dtype = prepare_activations(q, k, v, g, beta)
    if state_dtype == torch.float64:
        raise TypeError("kda: the serving decode computes in float32 / bfloat16; got float64 inputs")
    indices = _index_tensor("ssm_state_indices", ssm_state_indices)
    accepted = _index_tensor("num_accepted_tokens", call.num_accepted_tokens)
    N = None  # the number of requests, needed unless a pool is updated in place (a decode step)
    if indices is None or not inplace_final_state:
        N = v.shape[0] if options.cu_seqlens is None else options.cu_seqlens.shape[0] - 1

    if indices is None:
        if initial_state is None:
            _, _, HV, V = v.shape
            K = q.shape[-1]
            state = (HV, V, K) if options.state_v_first else (HV, K, V)
            # No state to update in place: the final state comes back only when asked for.
            pool, returned = torch.zeros((N, *state)), call.output_final_state
        elif inplace_final_state:
            pool, returned = initial_state, True
        else:
            pool, returned = initial_state.clone(), call.output_final_state
        indices = torch.arange(N)
    elif inplace_final_state:
        pool, returned = initial_state, True
    else:  # the pool stays as it is: the starting states are gathered into a pool of N slots
        pool, indices = _gather_starting_states(initial_state, indices, accepted, N)
        accepted, returned = None, call.output_final_state

    o = None  # the engine's output buffer: out itself when it is of the compute dtype
    if out is not None:
        if out.shape != v.shape or out.dtype != out_dtype:
            raise ValueError(
                f"kda: out must be a [B, T, HV, V] = {list(v.shape)} tensor of v's dtype {out_dtype}, got "
                f"{list(out.shape)} {out.dtype}"
            )
        o = out if out.dtype == v.dtype and out.stride(-1) == 1 else None
    if o is None:
        o = torch.empty_like(v) if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)
    if options.gate == "lower_bound" and A_log is None:
        A_log = torch.zeros(v.shape[2])
    _ops.decode(
        plain,
        q,
        k,
        v,
        g,
        beta,
        side_f32(A_log, "A_log"),
        side_f32(dt_bias, "dt_bias"),
        pool,
        indices,
        accepted,
        *options,
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
