"""The soak's stand-in model: upstream's DSA backend and cache writers fed rows that check themselves.

:class:`StandInWorker` is the prefill scheduler's model worker (used by :mod:`.prefill`). For each extend batch it
does what upstream's eager runner does with a DSA model, in its order (``EagerRunner._execute_extend``; a test in
``test/registered/soak`` holds the order to the source), with the model replaced by :mod:`.kv_function`: every layer
hands upstream's indexer store and attention layer the batch's rows as the all-gathered chunk, and the index-K read
and every attention kernel call (captured) are checked row by row against the rows of each query's own prefix
(:class:`Checks`: request, position, layer, rank). Design: ``docs/design/cp-shared-kv-soak.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_cpkv.soak import kv_function
from sglang_cpkv.soak.server import HEADS, LAYERS, ServerConfig, SoakWorker, standin_runner
from sglang_cpkv.testing import dsa_kit
from sglang_cpkv.testing.dsa_kit import NOPE, ROPE
from sglang_cpkv.testing.host_reads import HostReadCounter

MAX_EXAMPLES = 20


@dataclass
class Checks:
    """What the rank's reads checked and what they found."""

    rank: int
    batches: int = 0
    tokens: int = 0
    reads_checked: int = 0
    kernel_outputs_checked: int = 0  # query rows whose real attention kernel's output was checked (a GPU run)
    index_k_rows_checked: int = 0
    pool_rows_checked: int = 0
    dense_slots_max: int = 0  # the most dense slots a batch's plan took
    dense_slots_reserved: int = 0  # what start-up reserved
    mode_host_syncs_max: int = 0  # the most host reads of device data the mode made in one batch (the design: 1)
    mode_host_syncs_where: dict = field(default_factory=dict)  # that batch's reads, by module:function
    upstream_host_reads: int = 0  # tensor reads in upstream's frames (on a CPU most read host tensors)
    host_hit_tokens: int = 0  # HiCache: tokens loaded back from host
    mismatches: int = 0
    examples: list[dict] = field(default_factory=list)

    def mismatch(self, **where: Any) -> None:
        self.mismatches += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(dict(where, rank=self.rank))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Hashes:
    """Each live request's prefix hashes (:func:`kv_function.prefix_hashes` of its prompt), made once per request."""

    def __init__(self) -> None:
        self._by_rid: dict[str, torch.Tensor] = {}

    def of(self, req: Any) -> torch.Tensor:
        hashes = self._by_rid.get(req.rid)
        if hashes is None:
            hashes = torch.tensor(kv_function.prefix_hashes(req.origin_input_ids), dtype=torch.int64)
            self._by_rid[req.rid] = hashes
        return hashes

    def forget(self, rids) -> None:
        for rid in rids:
            self._by_rid.pop(rid, None)


def make_runner(config: ServerConfig, pools: Any, server_model_config: Any, device: str) -> tuple[Any, Any, list[Any]]:
    """``(runner, backend, attention modules)``: upstream's DSA backend built from the kit's model runner (the stand-in
    model's shape) over the rank's pools, and the runner ``ForwardBatch.init_new`` and the scheduler read (the
    server's model config)."""
    up = dsa_kit._upstream()
    kit, dense_kit = up["kit"], up["dense_kit"]
    model_config = kit.TinyDSAModelConfig(
        num_heads=HEADS,
        num_kv_heads=1,
        head_dim=NOPE + ROPE,
        hidden_size=dense_kit.DEFAULT_HIDDEN_SIZE,
        context_len=pools.req_to_token_pool.max_context_len,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        kv_lora_rank=NOPE,
        index_topk=config.topk,
    )
    case = kit.DSAAttentionCase(
        name="soak",
        backend="dsa",
        forward_mode=up["extend"],
        num_heads=HEADS,
        num_kv_heads=1,
        page_size=pools.token_to_kv_pool.page_size,
        prefix_lens=(0,),
        extend_lens=(1,),
    )
    kit_runner = kit.DSAMockModelRunner(
        case=case,
        model_config=model_config,
        dtype=torch.bfloat16,
        device=device,
        max_context_len=pools.req_to_token_pool.max_context_len,
        head_dim=NOPE + ROPE,
        dsa_prefill_backend=config.prefill_backend,
        dsa_decode_backend="flashmla_kv",
        fp8_kv_cache=config.fp8,
    )
    kit_runner._server_args_override.restore()  # the server's published args, not the kit's
    kit_runner.req_to_token_pool = pools.req_to_token_pool
    kit_runner.token_to_kv_pool = pools.token_to_kv_pool
    kit_runner.token_to_kv_pool_allocator = pools.allocator
    backend = up["backends"]["dsa"](kit_runner)
    backend.use_fused_topk = config.fused_topk
    modules = []
    for layer in range(LAYERS):
        module = kit.ProjectedDSASparseAttention(
            hidden_size=dense_kit.DEFAULT_HIDDEN_SIZE,
            num_heads=HEADS,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            dtype=torch.bfloat16,
            device=device,
        )
        module.attn.layer_id = layer
        modules.append(module)
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    runner = standin_runner(
        pools,
        server_model_config,
        device,
        kv_index_translator=KVIndexTranslator(
            req_to_token=pools.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=pools.allocator,
            token_to_kv_pool=pools.token_to_kv_pool,
            page_size=pools.token_to_kv_pool.page_size,
            device=device,
        ),
        prefill_attention_backend_str="dsa",
        attn_backend=backend,
        kv_cache_dtype_str=config.kv_cache_dtype,
    )
    return runner, backend, modules


class StandInWorker(SoakWorker):
    """The prefill scheduler's model worker."""

    def __init__(self, config: ServerConfig, runner: Any, backend: Any, modules: list[Any], rank: int, seed: int):
        super().__init__(runner)
        self.config, self.backend, self.modules = config, backend, modules
        self.rank, self.seed = rank, seed
        self.expected = kv_function.ExpectedRows(config.fp8)
        self.hashes = _Hashes()
        self.checks = Checks(rank)
        self._loaded_back: set[str] = set()

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        forward_batch = ForwardBatch.init_new(batch, self._runner, return_hidden_states_before_norm=False)
        # EagerRunner._execute_extend's order: the CP split, the backend's metadata, then the layers.
        cp_active = is_cp_active(forward_batch)
        if cp_active:
            prepare_cp_forward(forward_batch)
        capture = dsa_kit._Capture(self.backend, run_kernels=self.device != "cpu")
        try:
            with torch.no_grad(), HostReadCounter(every_frame=True) as reads:
                self.backend.init_forward_metadata(forward_batch)
                self._reserved(forward_batch)
                if not cp_active:
                    forward_batch.attn_cp_metadata = None
                with forward_context(ForwardContext(attn_backend=self.backend), forward_batch=forward_batch):
                    self._layers(batch, forward_batch, capture)
        finally:
            capture.restore()
        checks = self.checks
        checks.batches += 1
        syncs = reads.syncs()
        if sum(syncs.values()) > checks.mode_host_syncs_max:
            checks.mode_host_syncs_max, checks.mode_host_syncs_where = sum(syncs.values()), dict(syncs)
        checks.upstream_host_reads += sum(reads.others.values())
        for req in batch.reqs:  # a load-back is spliced in at the request's admission: counted once per request
            if req.rid not in self._loaded_back and req.host_loaded_length:
                self._loaded_back.add(req.rid)
                checks.host_hit_tokens += req.host_loaded_length
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=torch.full((batch.batch_size(),), 7, dtype=torch.int64, device=self.device),
            can_run_cuda_graph=False,
        )

    def _reserved(self, forward_batch: Any) -> None:
        """The dense slots the mode's plan took for this batch, against what start-up reserved."""
        from sglang_cpkv.hooks import dsa_batch, state

        batch = dsa_batch.extend_batch(self.backend, forward_batch)
        if batch is None:
            return
        reserved = state.config().reservation.dense_slots
        used = batch.plan.num_slots
        self.checks.dense_slots_max = max(self.checks.dense_slots_max, used)
        self.checks.dense_slots_reserved = reserved
        if used > reserved:
            self.checks.mismatch(kind="dense slots past the reservation", slots=used, reserved=reserved)

    def _layers(self, batch: Any, forward_batch: Any, capture: Any) -> None:
        reqs = batch.reqs
        prefix = [int(x) for x in forward_batch.extend_prefix_lens_cpu]
        extend = [int(x) for x in forward_batch.extend_seq_lens_cpu]
        token_req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(extend))
        token_pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
        hashes = [self.hashes.of(req) for req in reqs]
        token_hash = torch.cat([h[p : p + e] for h, p, e in zip(hashes, prefix, extend)])
        local, rows = self._local_rows(forward_batch, token_req.numel())
        self.checks.tokens += token_req.numel()
        for layer, module in enumerate(self.modules):
            keys = kv_function.index_keys(token_hash, layer).to(self.device)
            self._index_k(forward_batch, layer, keys, reqs, hashes, prefix, extend)
            k_nope, k_rope = kv_function.latent_rows(token_hash, layer)
            q = torch.zeros(rows, HEADS, NOPE, dtype=torch.bfloat16, device=self.device)
            q_rope = torch.zeros(rows, HEADS, ROPE, dtype=torch.bfloat16, device=self.device)
            positions = self._topk_positions(token_pos[local], rows, layer)
            topk = self._topk_indices(forward_batch, positions, token_req[local], rows)
            module.attn(
                q,
                k_nope.to(self.device).unsqueeze(1),
                k_nope.to(self.device).unsqueeze(1),
                forward_batch,
                k_rope=k_rope.to(self.device).unsqueeze(1),
                q_rope=q_rope,
                topk_indices=topk,
            )
            call = capture.calls.pop()
            self._check_reads(call, layer, positions, token_req[local], token_pos[local], hashes, reqs)

    def _local_rows(self, forward_batch: Any, num_tokens: int) -> tuple[torch.Tensor, int]:
        """This rank's real local tokens (upstream's split) and its padded row count."""
        metadata = forward_batch.attn_cp_metadata
        if metadata is None:
            return torch.arange(num_tokens), num_tokens
        from sglang_cpkv.runtime.cp_split import upstream_interleave_split

        split = upstream_interleave_split(
            num_tokens, metadata.per_rank_logical_token, metadata.per_rank_actual_token, self.rank
        )
        return split.local_token_index, split.physical_rows

    def _topk_positions(self, query_pos: torch.Tensor, rows: int, layer: int) -> torch.Tensor:
        """``[rows, topk]`` request-local positions each query row reads: its first and last valid position and
        pseudo-random others among them (``-1`` past its count and on padded rows)."""
        k = self.config.topk
        out = torch.full((rows, k), -1, dtype=torch.int64)
        n = query_pos.numel()
        if not n:
            return out
        gen = torch.Generator().manual_seed(hash((self.seed, self.checks.batches, layer)) & 0x7FFFFFFF)
        visible = query_pos + 1
        picks = (torch.rand(n, k, generator=gen) * visible[:, None]).to(torch.int64)
        picks[:, 0] = 0
        picks[:, 1] = query_pos
        count = visible.clamp(max=k)
        picks = torch.where(torch.arange(k)[None, :] < count[:, None], picks, -1)
        out[:n] = picks
        return out

    def _topk_indices(self, forward_batch: Any, positions: torch.Tensor, row_req: torch.Tensor, rows: int):
        return dsa_kit.topk_indices_of_positions(
            self.backend,
            self.backend.forward_metadata,
            positions,
            row_req,
            self.config.fused_topk,
            forward_batch.forward_mode,
        ).to(self.device)

    def _check_reads(self, call, layer, positions, row_req, row_pos, hashes, reqs) -> None:
        n = row_req.numel()
        valid = positions[:n] >= 0
        got_valid = call.valid[:n]
        lost = valid & ~got_valid
        for i, k in lost.nonzero().tolist()[: MAX_EXAMPLES - len(self.checks.examples)]:
            self._mismatch_at(reqs, row_req, row_pos, positions, i, k, layer, "lost read")
        self.checks.mismatches += max(0, int(lost.sum()) - min(int(lost.sum()), MAX_EXAMPLES))
        read_hash = torch.zeros_like(positions[:n])
        for r in row_req.unique().tolist():
            mine = row_req == r
            read_hash[mine] = hashes[r][positions[:n][mine].clamp(min=0)]
        sel = valid & got_valid
        # Queries of a batch read the same positions many times: each distinct row is computed once.
        distinct, which = torch.unique(read_hash[sel], return_inverse=True)
        want = self.expected.kernel_rows(distinct, layer, call.rows.shape[-1])
        got = call.rows[:n][sel]
        bad = (got != want[which]).any(dim=1)
        self.checks.reads_checked += int(sel.sum())
        if bool(bad.any()):
            where = sel.nonzero()[bad]
            for i, k in where.tolist():
                self._mismatch_at(reqs, row_req, row_pos, positions, i, k, layer, "wrong row")
        if call.output is not None:
            self._check_output(call.output[:n], sel, distinct, which, layer, reqs, row_req, row_pos)

    def _check_output(self, output, sel, distinct, which, layer, reqs, row_req, row_pos) -> None:
        """The real kernel's output (a GPU run). The stand-in's queries are zero, so every read of a query row weighs
        the same: its output is the mean of the latent rows it reads, the function's values (exact in bf16 and FP8,
        so the tolerance is the bf16 rounding of the output). ``output``: ``[rows, heads, dim]``, or ``flashmla_kv``'s
        ``[rows, 1, heads, dim]`` (one query per decode batch row)."""
        n = output.shape[0]
        output = output.reshape(n, -1, NOPE)
        latent = kv_function.latent_rows(distinct, layer)[0].float()[which]
        query = sel.nonzero()[:, 0]
        sums = torch.zeros(n, NOPE).index_add_(0, query, latent)
        counts = torch.zeros(n).index_add_(0, query, torch.ones(query.numel()))
        read = counts > 0
        want = sums[read] / counts[read, None]
        got = output.float().cpu()[read]
        wrong = ~torch.isclose(got, want[:, None, :], atol=0.03, rtol=0.01).flatten(1).all(dim=1)
        self.checks.kernel_outputs_checked += int(read.sum())
        error = (got - want[:, None, :]).abs().flatten(1).max(dim=1).values
        rows = read.nonzero()[:, 0]
        for j in wrong.nonzero()[:, 0].tolist()[:3]:
            i = int(rows[j])
            self.checks.mismatch(
                kind="kernel output",
                request=reqs[int(row_req[i])].rid,
                position=int(row_pos[i]),
                layer=layer,
                max_abs_error=round(float(error[j]), 4),
                reads=int(counts[i]),
            )
        self.checks.mismatches += max(0, int(wrong.sum()) - 3)

    def _mismatch_at(self, reqs, row_req, row_pos, positions, i, k, layer, kind) -> None:
        self.checks.mismatch(
            kind=kind,
            request=reqs[int(row_req[i])].rid,
            position=int(row_pos[i]),
            reads_position=int(positions[i, k]),
            layer=layer,
        )

    def _index_k(self, forward_batch, layer, keys, reqs, hashes, prefix, extend) -> None:
        """Upstream's index-K store of the chunk's keys (patched), then the indexer's read of every selected request's
        keys (the patched read), checked against the function."""
        from types import SimpleNamespace

        from sglang_cpkv.hooks import dsa_index_k

        up = dsa_kit._upstream()
        indexer = SimpleNamespace(block_size=128, scale_fmt=None)
        up["indexer_cls"]._store_index_k_cache(indexer, forward_batch, layer, keys, act_quant=dsa_kit._act_quant())
        metadata = self.backend.get_indexer_metadata(layer, forward_batch)
        seq_lens = metadata.get_indexer_seq_len_cpu()
        k, s = dsa_index_k.index_k_and_scale(
            self.backend.token_to_kv_pool,
            forward_batch,
            layer,
            metadata.get_indexer_seq_len(),
            metadata.get_logical_page_table(),
            int(seq_lens.sum()),
            int(seq_lens.max()),
        )
        selected = self._selected_requests(forward_batch, len(reqs))
        lens = seq_lens.tolist()
        if len(lens) != len(selected):
            self.checks.mismatch(kind="index-K rows", layer=layer, seq_lens=lens, selected=selected)
            return
        k, s = kv_function.as_index_k(k, s, int(seq_lens.sum()))
        start = 0
        for r, length in zip(selected, lens):
            want_k, want_s = self.expected.index_k(hashes[r][:length], layer)
            got_k, got_s = k[start : start + length], s[start : start + length]
            bad = (got_k != want_k).any(dim=1) | (got_s != want_s)
            self.checks.index_k_rows_checked += length
            for p in bad.nonzero().flatten().tolist()[:3]:
                self.checks.mismatch(kind="index K", request=reqs[r].rid, position=p, layer=layer)
            start += length

    def _selected_requests(self, forward_batch: Any, num_reqs: int) -> list[int]:
        """The batch's requests the indexer's tables hold on this rank: under CP those with local query rows
        (upstream's ``interleave_rows_per_request``, the host form of the backend's ``shard_per_request``)."""
        if forward_batch.attn_cp_metadata is None:
            return list(range(num_reqs))
        from sglang.srt.layers.cp.interleave import interleave_rows_per_request

        rows = interleave_rows_per_request(list(forward_batch.extend_seq_lens_cpu), self.rank, self.config.cp)
        return [r for r, n in enumerate(rows) if n > 0]
