"""The glue between SGLang's scheduler objects and :mod:`sglang_kda.policy`.

``policy/`` decides from plain values and imports nothing from SGLang; the modules here read
SGLang's requests, batches and scheduler, call the policy, apply its answers to SGLang's objects
and record counters and metrics. ``patches/`` binds these into SGLang's methods.

* :mod:`sglang_kda.wiring.adder`: one admission pass (``PrefillAdder``);
* :mod:`sglang_kda.wiring.budget`: the serial budget in one scheduler process.
"""
