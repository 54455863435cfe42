"""The CPU SDPA MLA prefill backend stops claiming ``out=`` support it does not have.

vLLM 0.32.0's ``CPUSDPAMLAPrefillBackend`` reports ``supports_out()`` = True, but its
``run_prefill_context_chunk`` asserts that no ``out`` is given ("CPU MLA context prefill does not
support in-place output"); Kimi's MLA layer trusts ``supports_out()`` and passes ``out`` when a context
spans several chunks, and the step fails on that assertion. Mend: report what the backend does (no
``out``); the layer then copies.
"""

from ..._patching import code_shows, original, replace

PHASE = "model"
#: what it changes in vLLM (module:attribute), for the tests
PATCHES = ("vllm.v1.attention.backends.mla.prefill.cpu_sdpa:CPUSDPAMLAPrefillBackend.supports_out",)


def _backend():
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    return CPUSDPAMLAPrefillBackend


def needed():
    """The backend says it supports ``out`` and its context prefill asserts that none is given."""
    backend = _backend()
    if not original(backend.supports_out)(None):
        return False
    return code_shows(backend.run_prefill_context_chunk, "assert out is None")


def supports_out(self):
    return False


def apply():
    replace(_backend(), "supports_out", __name__, supports_out)
