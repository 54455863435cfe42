"""The operator families kda computes, one row each: what tells them apart is their gate.

Every family is the delta rule with a decay of the state before each token's update; the families
differ in how many decay values a token has per value head, i.e. in the gate tensor's last
dimension (the engine's problem option ``gate_width``):

- ``KDA`` (Kimi Delta Attention): ``g [B, T, HV, K]``, one decay per key channel;
- ``GDN`` (the gated delta rule, Gated DeltaNet): ``g [B, T, HV]``, one decay per head;
- ``GV``: ``gv [B, T, HV, V]``, one decay per value channel (fla's third gate of
  ``fused_recurrent_gated_delta_rule``).

A row holds everything the Python layer branches on: the gate's name, shape and width, fla's
exception types for the family's argument errors, the function names in messages, which gate rules
apply (the sigmoid-bounded gate is KDA's) and the chunk sizes fla accepts. Code that needs to know
the family reads a row; it never compares gate-width strings.
"""

from typing import NamedTuple

__all__ = ["FAMILIES", "GDN", "GV", "KDA", "Family", "family_of_width"]


class Family(NamedTuple):
    name: str  # "KDA", "GDN", "GV"
    gate_width: str  # the engine's problem option
    gate_name: str  # the gate's argument name in fla's functions
    gate_channels: str  # the gate's last dimension: "K", "V", or "" (none: one value per head)
    gate_subject: str  # how messages name the gate
    gate_description: str
    other_gates: str  # where a gate of another family goes, for a gate of the wrong rank
    # fla's exception for a shape it refuses: its KDA functions assert, its GDN functions raise ValueError.
    shape_error: type
    # fla's KDA functions refuse K > 256 with their own assertion message; elsewhere kda's limit.
    head_dim_error: type
    lower_bound_gate: bool  # the gate lower_bound * sigmoid(...) (use_gate_in_kernel + lower_bound)
    chunk_sizes: tuple  # the chunk sizes fla's chunked function accepts (kda always chunks by 64)
    chunk_function: str
    recurrent_function: str
    decode_function: str
    kernels: bool  # whether kda's kernels compute it (else only the float64 oracle)

    @property
    def gate_rank(self) -> int:
        return 4 if self.gate_channels else 3

    @property
    def gate_dims(self) -> str:
        """The gate's shape as messages spell it."""
        return f"[B, T, HV, {self.gate_channels}]" if self.gate_channels else "[B, T, HV]"

    def gate_shape(self, B, T, HV, K, V) -> tuple:
        if not self.gate_channels:
            return (B, T, HV)
        return (B, T, HV, K if self.gate_channels == "K" else V)

    def dt_bias_size(self, HV, K, V) -> int:
        return HV * (self.gate_shape(1, 1, 1, K, V)[-1] if self.gate_channels else 1)

    def gate_rank_message(self, g) -> str:
        """The error for a gate of the wrong rank (a ValueError in every family)."""
        tensor = "a 4-D tensor " if self.gate_rank == 4 else ""
        return (
            f"kda: {self.gate_subject} must be {tensor}{self.gate_dims} ({self.gate_description}), got "
            f"shape {list(g.shape)}; {self.other_gates}"
        )

    def __repr__(self):
        return f"Family.{self.name}"


KDA = Family(
    name="KDA",
    gate_width="per_key",
    gate_name="g",
    gate_channels="K",
    gate_subject="'g'",
    gate_description="one log decay per key channel",
    other_gates="a decay per head [B, T, HV] is the gated delta rule's (chunk_gated_delta_rule)",
    shape_error=AssertionError,
    head_dim_error=AssertionError,
    lower_bound_gate=True,
    chunk_sizes=(32, 64),
    chunk_function="chunk_kda",
    recurrent_function="fused_recurrent_kda",
    decode_function="fused_recurrent_kda_fwd",
    kernels=True,
)
GDN = Family(
    name="GDN",
    gate_width="per_head",
    gate_name="g",
    gate_channels="",
    gate_subject="'g' of the gated delta rule",
    gate_description="one log decay per head and token",
    other_gates="a decay per key channel is KDA's (gk of fused_recurrent_gated_delta_rule, or chunk_kda)",
    shape_error=ValueError,
    head_dim_error=NotImplementedError,
    lower_bound_gate=False,
    chunk_sizes=(16, 32, 64),
    chunk_function="chunk_gated_delta_rule",
    recurrent_function="fused_recurrent_gated_delta_rule",
    decode_function="fused_recurrent_gdn_fwd",
    kernels=True,
)
GV = Family(
    name="GV",
    gate_width="per_value",
    gate_name="gv",
    gate_channels="V",
    gate_subject="'gv'",
    gate_description="one log decay per value channel",
    other_gates="a decay per head [B, T, HV] is passed as 'g', one per key channel [B, T, HV, K] as 'gk'",
    shape_error=ValueError,
    head_dim_error=NotImplementedError,
    lower_bound_gate=False,
    chunk_sizes=(16, 32, 64),
    chunk_function="chunk_gated_delta_rule",
    recurrent_function="fused_recurrent_gated_delta_rule",
    decode_function="",
    kernels=False,
)
FAMILIES = (KDA, GDN, GV)
_BY_WIDTH = {f.gate_width: f for f in FAMILIES}


def family_of_width(gate_width: str) -> Family:
    return _BY_WIDTH[gate_width]
