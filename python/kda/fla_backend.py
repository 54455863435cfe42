"""kda as a backend of flash-linear-attention's own functions, for CPU tensors (opt-in).

fla-core 0.6.0 computes with Triton kernels, which cannot run on the CPU ("0 active drivers"). fla
dispatches some of its entry points through a backend registry (``fla.backends``): before its own
kernel runs, every registered backend is asked, in priority order, whether it takes the call. ::

    import kda.fla_backend
    kda.fla_backend.register()      # once; idempotent

    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)   # CPU tensors: kda

After ``register()``, these fla functions run through kda when every tensor argument is on the CPU
(the verifier refuses any other call, which goes on to fla's next backend or its Triton kernel as
before): ``fla.ops.kda.chunk_kda``; ``fla.ops.kda.fused_recurrent_kda`` (through
``fused_recurrent_kda_fwd``, which it calls; fla's serving calls of that function too);
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``. Each is answered by kda's function of the same
name (docs/python.md), so gradients flow where kda's do, ``fused_recurrent_kda`` included.

Not served: fla 0.6.0's ``fused_recurrent_gated_delta_rule`` calls its Triton kernel without asking
the registry, so on CPU tensors it fails after ``register()`` as it did before. transformers' gated
delta rule models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) call that function for their
one-token decode steps whenever fla is installed: ``register()`` serves their prefill and training
(``chunk_gated_delta_rule``) but not their generation. Map both of their functions to kda's hub layers
instead (``kda.layers``, docs/python.md), or call ``kda.fused_recurrent_gated_delta_rule``. (Kimi
Linear's decode, fla's ``fused_recurrent_kda``, is served.)

``unregister()`` removes kda from the registry again. fla (and Triton, which fla imports) must be
installed; ``register()`` raises ``ImportError`` otherwise. With ``FLA_DISABLE_BACKEND_DISPATCH=1``
fla dispatches nothing: ``register()`` then only warns (``UserWarning``), ``registered()`` is False.
"""

import inspect
import warnings

import torch

from . import functional, gated_delta_rule, serving

__all__ = ["BACKEND_TYPE", "register", "registered", "unregister"]

BACKEND_TYPE = "kda_cpu"
# fla's operation registries kda joins (besides chunk_kda's function registry).
_OPERATIONS = ("kda", "gated_delta_rule")
_SERVING_SIGNATURE = inspect.signature(serving.fused_recurrent_kda_fwd)
_RECURRENT_PARAMETERS = frozenset(inspect.signature(functional.fused_recurrent_kda).parameters)


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value


def cpu_only(*args, **kwargs):
    """fla's verifier protocol: (accepted, reason). kda takes a call whose tensors are all on the CPU."""
    seen = False
    for t in _tensors(args, kwargs):
        if not t.is_cpu:
            return False, f"kda computes on the CPU; a tensor argument is on {t.device}"
        seen = True
    return (True, None) if seen else (False, "kda: no tensor argument")


def _backend_class():
    from fla.backends import BaseBackend

    class KdaCpuBackend(BaseBackend):
        """kda's engine for fla's dispatched entry points on CPU tensors."""

        backend_type = BACKEND_TYPE
        package_name = None  # kda is imported already
        env_var = None
        priority = 0  # before fla's GPU backends: the verifier takes CPU calls only

        def chunk_kda(self, *args, **kwargs):
            return functional.chunk_kda(*args, **kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return gated_delta_rule.chunk_gated_delta_rule(*args, **kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            fresh = _fresh_state_call(args, kwargs)
            if fresh is not None:
                # What fla's fused_recurrent_kda asks for: a fresh final state. kda's differentiable
                # function answers it (the serving entry records no gradient).
                return functional.fused_recurrent_kda(**fresh)
            return serving.fused_recurrent_kda_fwd(*args, **kwargs)

    return KdaCpuBackend


def _fresh_state_call(args, kwargs):
    """The arguments by name of ``kda.fused_recurrent_kda`` for a ``fused_recurrent_kda_fwd`` call that
    asks for no pool, no in-place update and no ``out`` (fla's ``fused_recurrent_kda`` makes such
    calls), else None. The call is bound to ``kda.serving.fused_recurrent_kda_fwd``'s own signature
    (which has fla's), so its parameters are spelled once; a call that does not bind is left to that
    function, which raises Python's error for it."""
    try:
        bound = _SERVING_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    if (
        a["ssm_state_indices"] is not None
        or a["num_accepted_tokens"] is not None
        or a["inplace_final_state"]
        or a["out"] is not None
    ):
        return None
    # (fused_recurrent_kda takes every other parameter: the four above are the serving entry's own)
    named = {n: value for n, value in a.items() if n in _RECURRENT_PARAMETERS and n != "kwargs"}
    return {**named, **a["kwargs"]}


def _registries():
    """fla's registries kda joins: the one of fla.ops.kda.chunk_kda (a function registry; None when
    fla's dispatch is disabled, which keeps no function registry) and those of the operations 'kda'
    and 'gated_delta_rule'."""
    import fla.backends as backends
    import fla.ops.gated_delta_rule  # noqa: F401  (defines the dispatched functions)
    import fla.ops.kda as fla_kda

    registries = [backends._function_registries.get(inspect.unwrap(fla_kda.chunk_kda))]
    registries += [backends._get_operation_registry(name) for name in _OPERATIONS]
    return registries


def register():
    """Registers kda with fla's backend registry (idempotent): fla's ``chunk_kda``,
    ``fused_recurrent_kda`` (``fused_recurrent_kda_fwd``) and ``chunk_gated_delta_rule`` then run
    through kda when all their tensors are on the CPU. With fla's dispatch disabled
    (``FLA_DISABLE_BACKEND_DISPATCH=1``) nothing can be served: a ``UserWarning``, nothing registered."""
    import fla.backends as backends
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda as fla_kda

    if _registries()[0] is None:
        warnings.warn(
            "kda.fla_backend.register(): fla's backend dispatch is disabled "
            "(FLA_DISABLE_BACKEND_DISPATCH=1), so fla's functions cannot run through kda; call kda's "
            "functions of the same names",
            UserWarning,
            stacklevel=2,
        )
        return
    backend = _backend_class()
    backends.register(fla_kda.chunk_kda, verifier=cpu_only)(backend)
    for name in _OPERATIONS:
        backends.register(name, verifier=cpu_only)(backend)


def unregister():
    """Removes kda from fla's registries (nothing happens if it was not registered)."""
    for registry in _registries():
        if registry is not None:
            registry._backends.pop(BACKEND_TYPE, None)


def registered() -> bool:
    """Whether kda is registered with fla's backend registry (for every entry point it answers)."""
    return all(registry is not None and BACKEND_TYPE in registry._backends for registry in _registries())
