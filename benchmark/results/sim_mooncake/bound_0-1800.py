import sys, dataclasses, time
sys.path.insert(0, "benchmark")
import sim_mooncake as smc
from sglang_kda.sim import mooncake as mc
from sglang_kda.sim.costs import KimiLinearH200
from sglang_kda.sim.engine import simulate, SimConfig
from sglang_kda.sim.metrics import summarize, percentile
model = KimiLinearH200(8); plan = model.memory_plan()
end = float(sys.argv[1])
reqs = mc.load(str(mc.TRACE_PATH), start_s=0, end_s=end)
ideal, total = mc.ideal_prefill(reqs)
trace = mc.to_trace(reqs, vocab=(10, 1 << 16))
print(f"0-{end:.0f} s: {len(reqs)} requests, ideal {ideal/total:.3f} of prompt", flush=True)
for label, pol, over in (("stock", "stock", {}), ("kda", "kda", {}), ("kda, no state cap", "kda", {"max_checkpoints": None}),
                          ("kda, no caps", "kda", {"max_checkpoints": None, "max_tokens": None}),
                          ("stock, no caps", "stock", {"max_checkpoints": None, "max_tokens": None})):
    cfg = smc.config(pol, plan)
    for k, v in over.items(): setattr(cfg, k, v)
    t0 = time.process_time()
    res = simulate(trace, cfg, model)
    s = summarize(res)
    tt = [r.ttft for r in res.requests if r.token_times]
    print(f"{label}: {s['prefill_tokens']/s['prompt_tokens']:.3f} of prompt, {s['prefill_tokens']/ideal:.3f}x ideal, TTFT p99 {percentile(tt,99):.2f} s, cpu {time.process_time()-t0:.0f} s", flush=True)
