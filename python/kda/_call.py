"""One record per public call: what fla's arguments resolved to, built at the public function's edge.

Every public function of the torch layer (``kda.functional``, ``kda.gated_delta_rule``,
``kda.serving``) reads fla's arguments, applies fla's rules to its flags, and builds one ``Call``;
everything after that edge takes the record (``_compute.run``, ``serving.pooled_prefill``,
``serving.decode``, ``kda.cp``): no argument list is repeated past the edge.
"""

from ._arguments import beta_mode_of
from ._ops import Options, default_lower_bound, default_scale

__all__ = ["Call", "problem_of"]


def problem_of(family, q, cu_seqlens, gate, lower_bound, flags):
    """The problem options (an ``_ops.Options``) of a call of ``family``: its offsets, its gate mode
    and bound (``_arguments.gate_mode``) and fla's other flags, ``flags`` = (scale, state_v_first,
    use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval). Positional: this is on
    every decode step."""
    scale, state_v_first, qk_l2norm, beta_sigmoid, neg_eigval = flags
    try:
        scale = default_scale(q, scale)
    except (AttributeError, IndexError, TypeError, ValueError):
        if scale is not None:  # (then only float(scale) could fail)
            raise TypeError(f"kda: scale must be a number, got {type(scale).__name__}") from None
        # q is no tensor of a head dimension: fla's checks name it when the engine refuses it
    beta_mode = beta_mode_of(beta_sigmoid, neg_eigval)
    try:
        lower_bound = default_lower_bound(lower_bound)
    except (TypeError, ValueError):
        raise TypeError(f"kda: lower_bound must be a number, got {type(lower_bound).__name__}") from None
    return Options(
        cu_seqlens,
        scale,
        bool(state_v_first),
        bool(qk_l2norm),
        gate,
        lower_bound,
        beta_mode,
        family.gate_width,
    )


class Call:
    """A public call, resolved: the family, the function's name (for messages), the path ("chunk",
    "chunk_bf16" or "recurrent"), the tensors (q, k, v, g, beta, A_log, dt_bias, initial_state: the
    ``tensors`` tuple), the problem options (an ``_ops.Options``, ``problem_of``), and what the call
    asks for. ``cp`` is a context-parallel call (kda.cp.Call). Serving calls carry their pool's parts:
    ``indices`` (the pool slots, ``ssm_state_indices``) and ``has_initial_state`` (pooled prefill,
    set by the caller), or ``serving`` = (indices, num_accepted_tokens, inplace_final_state, out)
    (decode)."""

    __slots__ = tuple(
        "family function path q k v g beta A_log dt_bias initial_state problem output_final_state out_like "
        "want_chunk_states cp indices has_initial_state num_accepted_tokens inplace_final_state out".split()
    )

    def __init__(
        self,
        family,
        function,
        path,
        tensors,
        problem,
        output_final_state,
        out_like,
        want_chunk_states=False,
        cp=None,
        serving=(None, None, False, None),
    ):
        self.family, self.function, self.path, self.problem = family, function, path, problem
        self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias, self.initial_state = tensors
        self.output_final_state, self.out_like = output_final_state, out_like
        self.want_chunk_states, self.cp, self.has_initial_state = want_chunk_states, cp, None
        self.indices, self.num_accepted_tokens, self.inplace_final_state, self.out = serving

    @property
    def out_dtype(self):
        """The dtype of ``o``: that of the tensor ``out_like`` names ("q" for the chunked functions,
        "v" for the recurrent ones, as in fla). A name, not the dtype, so that nothing reads an
        argument before the checks have made sure it is a tensor."""
        return getattr(self, self.out_like).dtype

    def checked(self):
        """What fla's tensor checks read: (family, q, k, v, g, beta, initial_state, cu_seqlens, A_log,
        dt_bias), _arguments.check_tensors' arguments."""
        return (
            self.family,
            self.q,
            self.k,
            self.v,
            self.g,
            self.beta,
            self.initial_state,
            self.problem.cu_seqlens,
            self.A_log,
            self.dt_bias,
        )
