"""One record per public call: what fla's arguments resolved to, built at the public function's edge.

Every public function of the torch layer (``kda.functional``, ``kda.gated_delta_rule``,
``kda.serving``) reads fla's arguments, applies fla's rules to its flags, and builds one ``Call``;
everything after that edge takes the record (``_compute.run``, ``serving.pooled_prefill``,
``serving.decode``, ``kda.cp``): no argument list is repeated past the edge.
"""

from ._arguments import beta_mode_of
from ._ops import Options, default_lower_bound, default_scale

__all__ = ["Call", "problem_of"]


def problem_of(
    family, q, cu_seqlens, scale, state_v_first, qk_l2norm, gate, lower_bound, beta_sigmoid, neg_eigval
):
    """The problem options (an ``_ops.Options``) of fla's flags, for a call of ``family`` (positional:
    this is on every decode step)."""
    try:
        scale = default_scale(q, scale)
    except (AttributeError, IndexError, TypeError):
        pass  # q is no tensor of a head dimension: fla's checks name it when the engine refuses it
    return Options(
        cu_seqlens,
        scale,
        bool(state_v_first),
        bool(qk_l2norm),
        gate,
        default_lower_bound(lower_bound),
        beta_mode_of(beta_sigmoid, neg_eigval),
        family.gate_width,
    )


class Call:
    """A public call, resolved: the family, the function's name (for messages), the tensors, the
    problem options (an ``_ops.Options``, ``problem_of``), and what the call asks for. ``path``: "chunk",
    "chunk_bf16" or "recurrent". Serving calls also carry their pool's parts: ``indices`` (the pool
    slots; ``ssm_state_indices``), ``has_initial_state`` (pooled prefill), ``num_accepted_tokens``,
    ``inplace_final_state`` and ``out`` (decode); ``cp`` is a context-parallel call (kda.cp.Call)."""

    __slots__ = (
        "family",
        "function",
        "path",
        "q",
        "k",
        "v",
        "g",
        "beta",
        "A_log",
        "dt_bias",
        "initial_state",
        "problem",
        "output_final_state",
        "out_dtype",
        "want_chunk_states",
        "cp",
        "indices",
        "has_initial_state",
        "num_accepted_tokens",
        "inplace_final_state",
        "out",
    )

    def __init__(
        self,
        family,
        function,
        path,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
        problem,
        output_final_state,
        out_dtype,
        want_chunk_states=False,
        cp=None,
        indices=None,
        has_initial_state=None,
        num_accepted_tokens=None,
        inplace_final_state=False,
        out=None,
    ):
        self.family, self.function, self.path = family, function, path
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.A_log, self.dt_bias, self.initial_state = A_log, dt_bias, initial_state
        self.problem, self.output_final_state, self.out_dtype = problem, output_final_state, out_dtype
        self.want_chunk_states, self.cp = want_chunk_states, cp
        self.indices, self.has_initial_state = indices, has_initial_state
        self.num_accepted_tokens, self.inplace_final_state, self.out = (
            num_accepted_tokens,
            inplace_final_state,
            out,
        )

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
