"""The glue between SGLang's scheduler objects and :mod:`sglang_kda.policy`.

``policy/`` decides from plain values and imports nothing from SGLang; the modules here read
SGLang's requests, batches and scheduler, call the policy, apply its answers to SGLang's objects
and record counters and metrics. ``patches/`` binds these into SGLang's methods.

* :mod:`sglang_kda.wiring.adder`: one admission pass (``PrefillAdder``);
* :mod:`sglang_kda.wiring.budget`: the serial budget's runtime in one scheduler process, with
  its step clock (:mod:`sglang_kda.wiring.step_clock`) and its view of the queue
  (:mod:`sglang_kda.wiring.round_queue`);
* :mod:`sglang_kda.wiring.scheduler_budget`: that runtime on SGLang's ``Scheduler``;
* :mod:`sglang_kda.wiring.round_log`: the round log the simulator replays;
* :mod:`sglang_kda.wiring.pd`: the PD disaggregation checks on SGLang's KV managers.
"""
