"""What the drop-ins of both gate widths share (``kda.functional``'s KDA functions and
``kda.gated_delta_rule``'s): the problem options of fla's flags, and one engine call through the
custom ops with fla's checks around it."""

import torch

from . import _ops
from ._arguments import beta_mode_of, check_gdn_tensors, check_tensors, fla_errors, prepare_activations, side

# fla's tensor checks of each gate width (the problem option).
TENSOR_CHECKS = {"per_key": check_tensors, "per_head": check_gdn_tensors}


def problem_of(
    cu_seqlens,
    scale,
    state_v_first,
    qk_l2norm,
    gate,
    lower_bound,
    beta_sigmoid,
    allow_neg_eigval,
    gate_width="per_key",
):
    """The problem options (``_ops.problem_options``' names) of fla's flags; ``gate_width`` is
    "per_head" for the gated delta rule's functions."""
    return dict(
        cu_seqlens=cu_seqlens,
        scale=scale,
        state_v_first=bool(state_v_first),
        qk_l2norm=bool(qk_l2norm),
        gate=gate,
        gate_lower_bound=lower_bound,
        beta_mode=beta_mode_of(beta_sigmoid, allow_neg_eigval),
        gate_width=gate_width,
    )


def chunk_path(kwargs, pooled, cp_context):
    """The chunked path a call's ``precision`` keyword picks (kda's addition to fla's signatures):
    "exact" (the default) or "bf16", the chunked forward's matrix products on bf16 operands summed in
    fp32 (the CPU's AMX or AVX512-BF16 units; docs/math.md, "bf16 products"), its backward exact."""
    precision = kwargs.get("precision", "exact")
    if precision not in ("exact", "bf16"):
        raise ValueError(f"kda: precision must be 'exact' or 'bf16', got {precision!r}")
    if precision == "bf16" and (pooled or cp_context is not None):
        raise NotImplementedError("kda: precision='bf16' is not available with a state pool or cp_context")
    return "chunk" if precision == "exact" else "chunk_bf16"


def run(
    path,
    q,
    k,
    v,
    g,
    beta,
    problem,
    *,
    A_log,
    dt_bias,
    initial_state,
    output_final_state,
    out_dtype,
    want_chunk_states=False,
    cp=None,
):
    """One engine call through the custom ops (``problem``: the problem options by name, see
    ``_ops.problem_options``), inside fla's checks of the problem's gate width
    (``_arguments.fla_errors``): returns (o, final_state, chunk_states), o in ``out_dtype``, the states
    in the engine's dtype; final_state / chunk_states are None when not asked for. The engine refuses
    a g of the other gate width's rank. ``cp``: a context-parallel call (``kda.cp.Call``), which runs
    it."""
    check = TENSOR_CHECKS[problem["gate_width"]]
    with fla_errors(check, q, k, v, g, beta, initial_state, problem["cu_seqlens"], A_log, dt_bias):
        options = _ops.problem_options(q, **problem)
        (q, k, v, g, beta), state_dtype = prepare_activations(q, k, v, g, beta)
        if state_dtype == torch.float64:
            path = "reference"
        if options.gate == "lower_bound" and A_log is None:
            # fla's gate without A_log is lower_bound * sigmoid(g + dt_bias): exp(A_log) = 1.
            A_log = torch.zeros(v.shape[2], dtype=state_dtype)
        if A_log is not None:
            A_log = side(A_log, state_dtype, "A_log")
        if dt_bias is not None:
            dt_bias = side(dt_bias, state_dtype, "dt_bias")
            if dt_bias.dim() != 1:
                dt_bias = dt_bias.reshape(-1)
        if initial_state is not None:
            initial_state = side(initial_state, state_dtype, "initial_state")
        grad, plain = _ops.inspect_inputs(
            (q, k, v, g, beta, A_log, dt_bias, initial_state, options.cu_seqlens)
        )
        if cp is not None:
            o = cp.forward(path, q, k, v, g, beta, A_log, dt_bias, options, grad)
            final = chunks = None
        else:
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
                *options,
                bool(output_final_state),
                grad or want_chunk_states,
            )
    return (o if o.dtype == out_dtype else o.to(out_dtype)), final, chunks if want_chunk_states else None
