"""fla's argument conventions, shared by the drop-ins (``kda.functional``, ``kda.gated_delta_rule`` and
what they share, ``kda._compute``) and the serving entries (``kda.serving``): fla's checks with its
exception types (for either gate width), the gate and beta modes fla's flags select, and the casts
that give the engine tensors it reads as they are."""

import math
import re
import warnings

import torch

from . import _engine
from ._family import KDA

RECURRENT_KWARGS = frozenset({"transpose_state_layout"})
NAMES = ("q", "k", "v", "g", "beta")
DEVICE_CHECKED = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")
_NATIVE = (torch.float32, torch.bfloat16)  # what the engine reads as it is


def reject_unknown(function, kwargs, allowed):
    for name in kwargs:
        if name not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument '{name}'")


def state_v_first_of(state_v_first, kwargs):
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


def check_floating(names, tensors):
    """Every tensor given (None: skipped) of a floating-point dtype: a TypeError naming it, where a
    cast would drop an integer's fractions or a complex number's imaginary part."""
    for name, t in zip(names, tensors, strict=True):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"kda: '{name}' must be a floating-point tensor, got {t.dtype}")


def check_cpu(names, tensors):
    for name, t in zip(names, tensors, strict=True):
        if t is not None and not t.is_cpu:
            raise NotImplementedError(
                f"kda computes on the CPU (it has no GPU backend yet): '{name}' is on {t.device}; "
                "move the inputs with .cpu()"
            )


def check_shapes(q, k, v, g, beta, family=KDA):
    """fla's shape checks (the same exception types: the family's), plus what the engine supports.
    ``family``: the operator family (kda._family), whose row gives the gate's shape."""
    for name, t, rank in zip(NAMES[:4], (q, k, v, g), (4, 4, 4, family.gate_rank), strict=True):
        if t.dim() != rank:
            if name == "g":
                raise ValueError(family.gate_rank_message(g))
            raise ValueError(f"kda: '{name}' must be a 4-D tensor, got shape {list(t.shape)}")
    B, T, H, K = q.shape
    _, _, HV, V = v.shape
    if beta.dim() == 4:
        raise NotImplementedError(
            "kda: a headwise beta [B, T, HV, V] is not supported; pass one beta per token and head [B, T, HV]"
        )
    if H < 1 or HV < 1:
        raise ValueError(f"kda: q and v need at least one head, got H={H}, HV={HV}")
    shape_error = family.shape_error
    if q.shape != k.shape:
        raise shape_error(f"q and k must have the same shape, got q={q.shape} vs k={k.shape}")
    if K > _engine.MAX_HEAD_DIM:
        if family.head_dim_error is AssertionError:  # fla's KDA functions' own assertion
            raise AssertionError(f"Currently we only support key headdim <=256 for KDA, got {K}.")
        raise family.head_dim_error(f"kda supports key head dims up to {_engine.MAX_HEAD_DIM}, got K={K}")
    if V > _engine.MAX_HEAD_DIM:
        raise NotImplementedError(f"kda supports value head dims up to {_engine.MAX_HEAD_DIM}, got V={V}")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"kda: v must have shape [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    if HV % H != 0:
        raise shape_error(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
            f"but got HV % H = {HV % H}"
        )
    gate_shape = family.gate_shape(B, T, HV, K, V)
    if g.shape != gate_shape:
        raise shape_error(
            f"{family.gate_name} must have shape {family.gate_dims}={list(gate_shape)}, got {list(g.shape)}"
        )
    if beta.shape != (B, T, HV):
        raise shape_error(f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")


# fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...): a call written as
# chunk_gated_delta_rule's (q, k, v, g, beta) puts beta in gk's place.
POSITIONAL_BETA_HINT = (
    "; 'gk' got a [B, T, HV] tensor: fla's fifth positional parameter here is gk, not beta (pass "
    "beta=... by name)"
)


def positional_beta_hint(gk):
    """The hint for a gk that looks like beta [B, T, HV], else ''."""
    return POSITIONAL_BETA_HINT if isinstance(gk, torch.Tensor) and gk.dim() == 3 else ""


def check_key_gate(gk, q, k, v):
    """fused_recurrent_gated_delta_rule's ``gk``, KDA's gate ``[B, T, HV, K]`` (B, T, HV of v, K of k),
    checked (device, rank, dtype, shape) with q, k and v before the call goes on to fused_recurrent_kda,
    whose messages name its gate 'g' and whose shape errors are fla's KDA assertions: here they take
    the gated delta rule's exception types (``ValueError``; ``NotImplementedError`` past the engine's
    head dims), as the same call with ``g`` does."""
    check_cpu(("gk",), (gk,))
    if gk.dim() != 4:
        raise ValueError(
            f"kda: 'gk' must be a 4-D tensor [B, T, HV, K] (one log decay per key channel), got shape "
            f"{list(gk.shape)}; a decay per head [B, T, HV] is passed as 'g'{positional_beta_hint(gk)}"
        )
    check_floating(("gk",), (gk,))
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return  # fused_recurrent_kda names the tensor of the wrong rank
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q={q.shape} vs k={k.shape}")
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    if K > _engine.MAX_HEAD_DIM:
        raise NotImplementedError(f"kda supports key head dims up to {_engine.MAX_HEAD_DIM}, got K={K}")
    if H >= 1 and HV % H != 0:
        raise ValueError(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
            f"but got HV % H = {HV % H}"
        )
    shape = (*v.shape[:3], K)
    if gk.shape != shape:
        raise ValueError(f"gk must have shape [B, T, HV, K]={list(shape)}, got {list(gk.shape)}")


def check_varlen(q, initial_state, cu_seqlens):
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


def check_types(names, tensors, required):
    """Every argument a tensor (the first `required` of them) or None (the rest): a TypeError naming it,
    where fla fails on an attribute of None or of a list."""
    for i, (name, t) in enumerate(zip(names, tensors, strict=True)):
        if isinstance(t, torch.Tensor) or (t is None and i >= required):
            continue
        wanted = "a tensor" if i < required else "a tensor or None"
        raise TypeError(f"kda: '{name}' must be {wanted}, got {type(t).__name__}")


def check_tensors(family, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
    """fla's tensor checks (device, shapes, varlen) of a call of the family: the engine makes the same
    checks, with its own messages and exception types."""
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    check_types(DEVICE_CHECKED, tensors, len(NAMES))
    check_cpu(DEVICE_CHECKED, tensors)
    check_varlen(q, initial_state, cu_seqlens)
    check_shapes(q, k, v, g, beta, family)


def gate_mode(use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, function, stacklevel=3):
    """The engine's gate mode for fla's gate arguments. Its UserWarnings (a gate argument that is not
    applied) name the line that called the public function: ``stacklevel`` 3 when that function calls
    gate_mode itself, one more per frame in between."""
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            warnings.warn(
                f"{function}: A_log and dt_bias are only used with use_gate_in_kernel=True; g is taken as "
                "the log decay and they are not applied",
                UserWarning,
                stacklevel=stacklevel,
            )
        if lower_bound is not None and not safe_gate:
            warnings.warn(
                f"{function}: lower_bound is only used with use_gate_in_kernel=True (or to describe bounded "
                "gates with safe_gate=True); it is not applied",
                UserWarning,
                stacklevel=stacklevel,
            )
        return "log_decay"
    if A_log is None and lower_bound is None:
        raise ValueError(
            "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set."
        )
    if lower_bound is None:
        return "softplus"
    check_lower_bound(lower_bound)
    return "lower_bound"


def check_lower_bound(lower_bound):
    """The bounded gate's ``lower_bound``: a finite number < 0 (a TypeError when it is no number)."""
    try:
        finite = math.isfinite(lower_bound)
    except (TypeError, ValueError):
        raise TypeError(f"kda: lower_bound must be a number, got {type(lower_bound).__name__}") from None
    if not (finite and lower_bound < 0):
        raise ValueError(f"kda: lower_bound must be a finite number < 0, got {lower_bound}")


def beta_mode_of(use_beta_sigmoid_in_kernel, allow_neg_eigval):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if not use_beta_sigmoid_in_kernel:
        return "given"
    return "sigmoid_x2" if allow_neg_eigval else "sigmoid"


def _engine_ready(t):
    """The engine reads any B / T / head strides but needs a contiguous last dimension (beta, 3-D, has
    none: its heads are its last dimension and may be strided)."""
    return t if t.stride(-1) == 1 or t.dim() < 4 or t.shape[-1] <= 1 else t.contiguous()


def prepare_activations(q, k, v, g, beta):
    """Casts the activations to what the engine computes in; returns them and the states' dtype."""
    # (dtypes are singletons, and stride()[-1] costs less than stride(-1): this is on every call)
    qd = q.dtype
    if (
        qd in _NATIVE
        and k.dtype is qd
        and v.dtype in _NATIVE
        and g.dtype in _NATIVE
        and beta.dtype in _NATIVE
        and q.stride()[-1] == 1
        and k.stride()[-1] == 1
        and v.stride()[-1] == 1
        and g.stride()[-1] == 1
    ):
        return (q, k, v, g, beta), torch.float32  # the common case: read as they are
    acts = (q, k, v, g, beta)
    check_floating(NAMES, acts)
    if any(t.dtype == torch.float64 for t in acts):
        return tuple(_engine_ready(t.double()) for t in acts), torch.float64
    # float16 and other narrow floats are computed in float32; q and k are read in one dtype.
    acts = [t if t.dtype in _NATIVE else t.float() for t in acts]
    if acts[0].dtype != acts[1].dtype:
        acts[0], acts[1] = acts[0].float(), acts[1].float()
    return tuple(_engine_ready(t) for t in acts), torch.float32


def side(t, dtype, name):
    """A_log, dt_bias, initial_state (``name``): packed, in the path's state dtype (a differentiable
    cast from another floating-point dtype; an integer or complex tensor is a TypeError naming it,
    where a cast would drop its fractions or its imaginary part)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    check_floating((name,), (t,))
    return t.to(dtype).contiguous()


def side_f32(t, name):
    return None if t is None else side(t, torch.float32, name)


# The engine's names for the serving functions' arguments (kda::Plan's and the binding's): its errors
# name the argument as the Python function does, so that a message says what to change in the call.
SERVING_NAMES = {
    "pool": "initial_state",
    "state_indices": "ssm_state_indices",
    "pooled_states.indices": "ssm_state_indices",
}


def in_python_names(error, names=SERVING_NAMES):
    """``error``, an engine error ``"kda: argument 'X': ..."``, with X and the same names in its text
    renamed by ``names`` (the same exception type; ``error`` itself when nothing is renamed). Only
    identifiers are renamed in the text: "the pool" there is prose."""
    message = str(error)
    head = "kda: argument '"
    argument, quote, rest = message[len(head) :].partition("'")
    if not message.startswith(head) or not quote:
        return error
    text = rest
    for name, python_name in names.items():
        if "_" in name or "." in name:
            text = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w.])", python_name, text)
    if argument not in names and text == rest:
        return error
    renamed = type(error)(f"{head}{names.get(argument, argument)}'{text}")
    renamed.__suppress_context__ = True  # the engine's error, renamed: one message, not two
    return renamed


class fla_errors:
    """A with-block that turns the engine's refusal of a call into fla's error for it: the block runs
    the engine, which validates every argument before it writes anything; ``check(*args)`` raises
    fla's error for a call fla refuses (every such call is one the engine refuses too). On the eager
    path the checks run only after the engine refused (they would cost as much as a one-token decode
    step's whole Python overhead); when torch.compile traces, they run first and cost nothing at run
    time. A context manager, not a wrapper, so that no frame stands between the caller and the engine."""

    __slots__ = ("check", "args", "names")

    def __init__(self, check, *args, names=None):
        self.check, self.args, self.names = check, args, names

    def __enter__(self):
        if torch.compiler.is_compiling():
            self.check(*self.args)

    def __exit__(self, kind, error, traceback):
        if isinstance(error, Exception):
            try:
                self.check(*self.args)
            except Exception as fla_error:
                fla_error.__suppress_context__ = True  # fla's error alone, as fla raises it
                raise
            if self.names is not None:
                renamed = in_python_names(error, self.names)
                if renamed is not error:
                    raise renamed
        return False  # the engine's own error when fla would accept the call
