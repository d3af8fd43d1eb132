"""The offline API: generate for a list of prompts through a full pipeline."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from frontend.async_client import AsyncClient
from frontend.config import EngineConfig
from frontend.launcher import Pipeline
from frontend.outputs import OutputCollector
from protocol import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model).generate(prompts, params)`, with the same processes as a served pipeline."""

    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1,
                 device: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size,
                                   device=device, **engine_kwargs)
        self.pipeline = Pipeline(self.config)
        self.pipeline.start()
        # Stops the processes when this LLM is garbage collected or the interpreter exits,
        # so a script that never calls close() still exits promptly and cleanly.
        self._finalizer = weakref.finalize(self, self.pipeline.stop)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process of the engine (also done at exit if never called)."""
        self._finalizer()

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Results in input order: [{"text", "token_ids", "finish_reason"}, ...], with
        "logprobs" (and "top_logprobs": per token [(id, logprob)] best first) when asked for."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("sampling_params must be one or one per prompt")
        return asyncio.run(self._generate(prompts, params, use_tqdm))

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams],
                        use_tqdm: bool) -> list[dict[str, Any]]:
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True,
                   disable=not use_tqdm)
        meter = _Throughput()
        async with AsyncClient(self.pipeline.address) as client:

            async def one(prompt: Prompt, sp: SamplingParams) -> dict[str, Any]:
                kwargs = ({"prompt": prompt} if isinstance(prompt, str)
                          else {"prompt_token_ids": list(prompt)})
                collector = OutputCollector("")
                first = True
                async for delta in client.stream(params=sp, **kwargs):
                    collector.add(delta)
                    if first and delta.token_ids:
                        meter.prefill_tokens += delta.prompt_tokens
                        first = False
                    meter.decode_tokens += len(delta.token_ids)
                bar.update(1)
                bar.set_postfix_str(meter.postfix(), refresh=False)
                out = collector.output()
                result = {"text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason}
                if sp.logprobs:
                    result["logprobs"] = out.logprobs
                if sp.top_logprobs:
                    result["top_logprobs"] = out.top_logprobs
                return result

            try:
                return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, params))))
            finally:
                bar.close()


class _Throughput:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.prefill_tokens = 0
        self.decode_tokens = 0

    def postfix(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (f"Prefill: {self.prefill_tokens / elapsed:.0f}tok/s, "
                f"Decode: {self.decode_tokens / elapsed:.0f}tok/s")
