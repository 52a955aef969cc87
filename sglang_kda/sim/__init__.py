"""Discrete-event simulator of the sglang_kda scheduler (see docs/simulator.md).

- :mod:`sglang_kda.sim.trace`: the JSONL trace format and workload generators;
- :mod:`sglang_kda.sim.costs`: cost models (CPU calibrated; Kimi-Linear-48B-A3B on H200);
- :mod:`sglang_kda.sim.engine`: the round loop of one scheduler, DP ranks, routers;
- :mod:`sglang_kda.sim.tree`: the plain radix tree (the model of the server's cache);
- :mod:`sglang_kda.sim.metrics`: summaries;
- :mod:`sglang_kda.sim.calibrate`: the CPU cost model fitted on the server's step trace;
- :mod:`sglang_kda.sim.validate`: the validation workloads, the evaluation against the server.
"""

from sglang_kda.sim.engine import SimConfig, simulate  # noqa: F401
