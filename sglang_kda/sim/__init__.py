"""Discrete-event simulator of the sglang_kda scheduler (see docs/simulator.md).

- :mod:`sglang_kda.sim.trace`: the JSONL trace format and workload generators;
- :mod:`sglang_kda.sim.costs`: cost models (CPU calibrated; Kimi-Linear-48B-A3B on H200);
- :mod:`sglang_kda.sim.config`: the simulated scheduler's settings (``SimConfig``);
- :mod:`sglang_kda.sim.rank`: one scheduler (a DP rank) and its round, the simulated request;
- :mod:`sglang_kda.sim.router`: routers between DP ranks;
- :mod:`sglang_kda.sim.engine`: the event loop, ``simulate()``;
- :mod:`sglang_kda.sim.pd`: prefill/decode disaggregation on the same loop;
- :mod:`sglang_kda.sim.tree`: the plain radix tree (the model of the server's cache);
- :mod:`sglang_kda.sim.metrics`: summaries;
- :mod:`sglang_kda.sim.calibrate`: the CPU cost model fitted on the server's step trace;
- :mod:`sglang_kda.sim.validate`: the validation workloads, the evaluation against the server.
"""

from sglang_kda.sim.config import SimConfig  # noqa: F401
from sglang_kda.sim.engine import simulate  # noqa: F401
