"""What the drop-ins of every family share (``kda.functional``'s KDA functions and
``kda.gated_delta_rule``'s): the chunked path a call's ``precision`` picks, and one engine call of a
``_call.Call`` through the custom ops with fla's checks around it."""

import torch

from . import _ops
from ._arguments import check_tensors, fla_errors, prepare_activations, side


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


def run(call):
    """One engine call of ``call`` (a ``_call.Call``) through the custom ops, inside fla's checks of
    its family (``_arguments.fla_errors``): returns (o, final_state, chunk_states), o in the call's
    ``out_dtype``, the states in the engine's dtype; final_state / chunk_states are None when not
    asked for. A context-parallel call (``call.cp``, a ``kda.cp.Call``) runs on its ranks."""
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    A_log, dt_bias, initial_state, path = call.A_log, call.dt_bias, call.initial_state, call.path
    with fla_errors(check_tensors, *call.checked()):
        options = call.problem
        (q, k, v, g, beta), state_dtype = prepare_activations(q, k, v, g, beta)
        if state_dtype == torch.float64:
            path = "reference"
        elif not call.family.kernels:
            raise NotImplementedError(
                f"kda: the {call.family.gate_description} ({call.family.gate_subject} "
                f"{call.family.gate_dims}) is not supported yet by kda's kernels; float64 inputs run on "
                "the float64 oracle"
            )
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
        if call.cp is not None:
            o = call.cp.forward(path, q, k, v, g, beta, A_log, dt_bias, options, grad)
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
                bool(call.output_final_state),
                grad or call.want_chunk_states,
            )
    out_dtype = call.out_dtype
    return (o if o.dtype == out_dtype else o.to(out_dtype)), final, chunks if call.want_chunk_states else None
