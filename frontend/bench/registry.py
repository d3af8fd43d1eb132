"""Every workload of `nanopipe bench` and every view of `nanopipe profile`: name -> module.

Adding one is one module with `add_arguments(ap)` and `run(args) -> list[Figure]` (see
docs/bench-tool.md) and one line here. Modules are imported only when named, so `--help`
and `report` start without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    module: str
    summary: str
    headline: str = ""
    """The figure `nanopipe bench report` puts in its table (default: the record's first)."""


BENCHMARKS: dict[str, Entry] = {
    "throughput": Entry(
        "frontend.bench.workloads.throughput",
        "W1 offline throughput through the pipeline (or the runtime alone)", "output_tok_s"),
    "serving": Entry(
        "frontend.bench.workloads.serving",
        "W2 online serving: Poisson arrivals, TTFT and ITL per rate", "output_tok_s@0.5"),
    "prefix": Entry(
        "frontend.bench.workloads.prefix",
        "W3 shared prefix: prefill saved and throughput, cache on vs off", "prefill_saved_pct"),
    "latency": Entry(
        "frontend.bench.workloads.latency",
        "W4 latency floor: TPOT and TTFT of one request at a time", "tpot_ms"),
    "cpu": Entry(
        "frontend.bench.workloads.cpu",
        "W5 the real SmolLM2 on the CPU against transformers' generate", "output_tok_s@1"),
    "speculative": Entry(
        "frontend.bench.workloads.speculative",
        "W6 copy-heavy requests, speculation on vs off", "speedup@1"),
    "returning": Entry(
        "frontend.bench.workloads.returning",
        "W8 returning conversations: contexts pushed out of the device pool, host tier on vs off",
        "host_served_pct"),
    "dp": Entry(
        "frontend.bench.workloads.dp",
        "W7 shared-prefix traffic over replicas: affinity vs round robin", "prefill_saved_pct"),
    "fairness": Entry(
        "frontend.bench.workloads.fairness",
        "a victim's TTFT alone and while another client floods the engine", "victim_ttft_ms[hog]"),
    "disagg": Entry(
        "frontend.bench.workloads.disagg",
        "W2 mixed traffic: colocated vs --dp 2 vs prefill/decode replicas, short requests' ITL",
        "short_itl_ms_p99[disagg]"),
    "kv-transfer": Entry(
        "frontend.bench.workloads.kv_transfer",
        "prefill/decode KV hand-offs alone: frames vs shared pools, GiB/s and ms per request",
        "shared_speedup"),
    "tp": Entry(
        "frontend.bench.workloads.tp",
        "tensor parallelism: greedy parity across sizes and W1 per size", "output_tok_s@tp1"),
    "steploop": Entry(
        "frontend.bench.workloads.steploop",
        "the scheduler process against a modelled worker (no model)", "us_per_step@1"),
    "kernels": Entry(
        "frontend.bench.workloads.kernels",
        "the Triton kernels against torch and flash-attn (CUDA)", "sampler_us"),
    "constrained": Entry(
        "frontend.bench.workloads.constrained",
        "structured outputs: W1 with a JSON schema per request vs without, mask time per step",
        "constrained_ratio"),
    "kv-accuracy": Entry(
        "frontend.bench.workloads.kv_accuracy",
        "fp8 KV cache vs the model's dtype: greedy token agreement and logprob drift",
        "agree_until_first_diff"),
    "startup": Entry(
        "frontend.bench.workloads.startup",
        "nanopipe serve to /health 200, cold and warm caches, by phase of its ready line",
        "ready_s[warm]"),
    "report": Entry(
        "frontend.bench.report",
        "regenerate docs/benchmarks.md's latest table and plots from the records"),
}

PROFILES: dict[str, Entry] = {
    "step": Entry("frontend.bench.profiles.step",
                  "W1 decode steps in this process: device time by kernel category"),
    "host": Entry("frontend.bench.profiles.host",
                  "the host's share of a decode step, by phase and function"),
    "fairness": Entry(
        "frontend.bench.workloads.fairness",
        "a victim's TTFT alone and while another client floods the engine", "victim_ttft_ms[hog]"),
    "tp": Entry("frontend.bench.profiles.tp",
                "every TP rank's profiling window in a pipeline, and the scaling"),
    "startup": Entry("frontend.bench.profiles.startup",
                     "one worker's start-up in a fresh process under cProfile, by function"),
    "cpu": Entry("frontend.bench.profiles.cpu",
                 "where a CPU decode step goes, nanopipe against transformers"),
    "timeline": Entry("frontend.bench.profiles.timeline",
                      "line up a pipeline's host timeline files (NANOPIPE_HOST_TIMELINE)"),
}
