"""What kda's layer (kda.vllm.layer) needs from vLLM 0.32 that vLLM's own Kimi layer does not: not defects
of vLLM, the layer kda adds. One module per mend; see the package's FOR_KDA."""
