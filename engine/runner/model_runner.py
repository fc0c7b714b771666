"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps a cached copy of every scheduled request's tokens and block table, updated by
the deltas of each SchedulerOutput; it appends the tokens it samples itself, so the
scheduler never resends them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from engine.connector_seam import WorkerConnector
from engine.models import load_arch, load_model
from engine.models.parallel import Collectives
from engine.protocol import SamplingParams
from engine.runner.attention import AttentionMetadata, PagedAttention, SeqSpan
from engine.runner.huge_pages import alloc_kv_cache, weights_on_huge_pages
from engine.runner.prompt_logprobs import PromptLogprobRows, PromptLogprobs
from engine.runner.sampler import Sampler, SamplerOutput, build_sampling_metadata
from engine.runner.sampling_metadata import SamplingMetadata, uses_penalties
from engine.runner_output import ModelRunnerOutput
from engine.sched.output import NewRequestData, SchedulerOutput
from engine.structured.grammars import GrammarTable
from engine.threads import core_share

logger = logging.getLogger(__name__)

_DEFAULT_KV_GIB = 1.0


@dataclass
class CachedRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None = field(default=None, repr=False)

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequest:
        gen = None
        if new.sampling_params.seed is not None:
            gen = torch.Generator().manual_seed(new.sampling_params.seed)
            # one draw per sampled token: a request that already holds output tokens (seeded
            # with another engine's first token, or resumed) continues the same sequence
            for _ in range(len(new.token_ids) - new.num_prompt_tokens):
                torch.rand((), generator=gen)
        return cls(new.req_id, list(new.token_ids), new.num_prompt_tokens,
                   new.sampling_params, list(new.block_ids), new.num_computed_tokens,
                   new.eos_token_id, gen)


class ModelRunner:
    def __init__(self, config: EngineConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 comm: Collectives | None = None) -> None:
        """With tp_size > 1 this is rank tp_rank's runner in a worker process: it holds that
        rank's model shard and KV heads, and `comm` talks across the ranks."""
        self.config = config
        self.device = torch.device(config.device)
        self.arch = load_arch(config.model)
        self.model = load_model(config.model, config.dtype, config.device, tp_rank=tp_rank,
                                tp_size=tp_size, comm=comm)
        weights_on_huge_pages(self.model)  # fewer TLB misses streaming them (huge_pages.py)
        self.max_model_len = config.resolved_max_model_len(self.arch.max_position_embeddings)
        self.block_size = config.block_size
        self.kv_cache_spec = self._kv_cache_spec()
        self.num_kv_blocks = self.kv_cache_spec.num_blocks
        a = self.arch
        self.kv_cache = alloc_kv_cache(
            (self.num_kv_blocks, a.num_layers, 2, self.block_size, self.model.num_kv_heads,
             a.head_dim),
            self.model.dtype, self.device,
        )
        self.scale = a.head_dim ** -0.5
        # Built (or found in the cache) now, so the first step does not wait for a compiler.
        self.attn_kernel = kernels.paged_attention() if self.device.type == "cpu" else None
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobs()
        self.grammars = GrammarTable(config.model, self.arch.vocab_size)
        self.requests: dict[str, CachedRequest] = {}
        self.connector: WorkerConnector | None = None
        # Fewer intra-op threads while other engines run on our cores (engine/threads.py).
        self.cores = core_share(torch.get_num_threads()) if self.device.type == "cpu" else None

    def _kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        kv_heads = self.model.num_kv_heads  # this rank's
        per_block = a.num_layers * 2 * self.block_size * kv_heads * a.head_dim * itemsize
        num_blocks = self.config.num_kv_blocks
        if num_blocks is None:
            gib = self.config.kv_cache_memory_gib or _DEFAULT_KV_GIB
            num_blocks = int(gib * (1 << 30)) // per_block
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
        return KVCacheSpec(
            num_blocks=num_blocks, block_size=self.block_size, num_layers=a.num_layers,
            num_kv_heads=kv_heads, head_dim=a.head_dim,
            dtype=str(self.model.dtype).removeprefix("torch."), bytes_per_block=per_block,
            model_name=f"{a.architecture}:{a.hidden_size}:{a.vocab_size}",
            vocab_size=a.vocab_size,
        )

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
            self.prompt_logprobs.drop(rid)
            self.grammars.drop(rid)  # a preempted request's matcher is rebuilt from its tokens
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequest.from_new(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.cores is not None:
            self.cores.tick()  # here: torch's thread count belongs to the model's thread
        self._update_states(so)
        if self.connector is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if not so.is_empty:
            out = self._run(so)
        if self.connector is not None:
            out.kv_connector_output = self.connector.get_finished()
        return out

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids = [n.req_id for n in so.scheduled_new_reqs]
        ids += [c.req_id for c in so.scheduled_cached_reqs]
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sampling: list[CachedRequest] = []
        prompt_rows: list[PromptLogprobRows] = []
        prompt_done: set[str] = set()  # requests whose prompt this pass completes
        for rid in ids:
            state = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            rows = PromptLogprobs.rows(rid, state.params.prompt_logprobs, state.token_ids,
                                       state.num_prompt_tokens, start, n, len(tokens))
            if rows is not None:
                prompt_rows.append(rows)
            if start < state.num_prompt_tokens <= start + n:
                prompt_done.add(rid)
            spans.append(SeqSpan(len(tokens), n, start + n, state.block_ids))
            tokens.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            state.num_computed_tokens = start + n
            if state.num_computed_tokens == len(state.token_ids):
                sample_rows.append(len(tokens) - 1)
                sampling.append(state)
        # the grammar masks of this step's sampled rows, computed while the model runs
        masks = self.grammars.bitmask_async(
            [(s.req_id, s.params.structured,
              s.token_ids[s.num_prompt_tokens:] if s.params.structured else [])
             for s in sampling])
        meta = AttentionMetadata(spans, self.block_size, self.arch.num_layers, self.device,
                                 kernel=self.attn_kernel is not None)
        attn = PagedAttention(self.kv_cache, meta, self.scale, self.attn_kernel)
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            attn,
        )
        if prompt_rows:  # this pass's prompt rows, before sampling reuses `hidden`
            self.prompt_logprobs.compute(hidden, prompt_rows, self.model.compute_logits)
        sampled_by_id: dict[str, tuple[int, object]] = {}
        if sampling:
            smeta = self._sampling_metadata(sampling)
            smeta.grammar_bitmask = None if masks is None else masks.result()
            if smeta.plain_greedy:  # the argmax alone (under TP without gathering logits)
                result = SamplerOutput(self.model.greedy_tokens(hidden[sample_rows]),
                                       [None] * len(sampling))
            else:
                result = self.sampler(self.model.compute_logits(hidden[sample_rows]), smeta)
            token_list = result.sampled_token_ids.tolist()
            for i, state in enumerate(sampling):
                state.token_ids.append(token_list[i])
                lp = result.logprobs[i] if result.logprobs else None
                sampled_by_id[state.req_id] = (token_list[i], lp)
        out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[], logprobs=[])
        for state in sampling:  # the prompt is done: its prompt logprobs go out once
            if state.params.prompt_logprobs is not None and state.req_id in prompt_done:
                out.prompt_logprobs[state.req_id] = self.prompt_logprobs.take(state.req_id)
        for rid in ids:
            tok, lp = sampled_by_id.get(rid, (None, None))
            out.sampled_token_ids.append([] if tok is None else [tok])
            out.logprobs.append(lp)
        return out

    @staticmethod
    def _sampling_metadata(sampling: list[CachedRequest]) -> SamplingMetadata:
        """The sampled rows' metadata. Their token histories are copied only when a penalty
        reads them; otherwise `range`s of their lengths stand in (min_tokens counts outputs),
        since a copy of every sequence's history each step grows with the context."""
        params = [s.params for s in sampling]
        if uses_penalties(params):
            prompts = [s.token_ids[:s.num_prompt_tokens] for s in sampling]
            outputs = [s.token_ids[s.num_prompt_tokens:] for s in sampling]
        else:
            prompts = [range(s.num_prompt_tokens) for s in sampling]
            outputs = [range(len(s.token_ids) - s.num_prompt_tokens) for s in sampling]
        return build_sampling_metadata(params, prompts, outputs,
                                       [s.generator for s in sampling],
                                       [s.eos_token_id for s in sampling])
