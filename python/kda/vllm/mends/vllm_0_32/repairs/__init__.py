"""Repairs of vLLM 0.32's CPU build: defects that stop a Kimi Linear checkpoint from running on the CPU
(or make it drift) whatever serves its KDA layers. One module per repair; see the package's REPAIRS."""
