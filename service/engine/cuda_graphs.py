"""Decode steps over static input buffers, replayed from CUDA graphs captured per batch size.

A step whose every chunk is one token that samples (a pure decode step) runs the model over
static buffers sized for the largest captured batch: token ids, positions, slot mapping, context
lengths and block tables. A batch of n sequences is padded up to the next captured size; each
padding row is token 0 at position 0, writes its K/V into the runner's scratch block (a block
the block manager never hands out) and attends to that one slot, so it touches no sequence's
blocks. Prefill and mixed steps take the runner's eager path unchanged.

`DecodeGraphs` owns the ladder of sizes, the buffers, the padding and the routing; how the
padded forward runs is its subclasses' part:
- `CudaDecodeGraphs` captures one graph per size at start-up, largest first, all in one memory
  pool, and replays it. The attention launch (tiles, split count: `choose_launch`) is planned
  once per size at capture, for the longest context the engine allows, since a replay cannot
  re-plan; shorter contexts leave some splits empty, which the kernel handles.
- `EagerDecodeGraphs` runs the same forward eagerly over the same buffers every step, planning
  attention for the step's real lengths: what lets CPU tests pin the buffer filling, the
  padding, the ladder and the output slicing, where no graph can be captured.

The graph covers the layers (where the launches are); the LM head runs after it, eagerly, over
the real rows only, so no graph holds a [size, vocab] output of its own.

Where the sliding-window layers keep pools of their own (service/engine/window_blocks.py), the
buffers hold a second slot mapping and block tables for them; their padding rows use the window
pools' scratch block.
"""

from __future__ import annotations

import abc
import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kernels.metadata import AttentionMetadata
from service.engine.config import EngineConfig
from service.engine.runner import ModelRunner, StepInputs, table_slots
from service.engine.scheduler import StepBatch

log = logging.getLogger(__name__)

LADDER_STEP = 8  # captured sizes past 8 are its multiples, as in vLLM


class StepRunner(Protocol):
    """What the engine steps through: the runner itself, or decode graphs around it. What
    `prepare` returns is opaque to the caller: only `execute` reads it."""

    def prepare(self, batch: StepBatch) -> Any: ...

    def execute(self, inputs: Any) -> torch.Tensor: ...  # logits [S, V] float32


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 below `max_num_seqs`, and `max_num_seqs` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(LADDER_STEP, max_num_seqs, LADDER_STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None past the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def decode_rows(batch: StepBatch) -> int | None:
    """How many rows a pure decode step has (each chunk one token that samples); else None."""
    chunks = batch.chunks
    if not chunks or any(c.num_tokens != 1 or not c.samples for c in chunks):
        return None
    return len(chunks)


@dataclass(slots=True)
class DecodeRows:
    """Host copies of one decode step's per-sequence inputs, in batch order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # cache slot of each new token
    seq_lens: list[int]  # context length after the step
    tables: list[list[int]]  # each sequence's block slots
    # The window layers' slots and tables, where they have pools of their own.
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: StepBatch, block_size: int, window_scratch: int | None) -> DecodeRows:
        """`window_scratch`: the window pools' scratch block, where they exist."""
        rows = cls([], [], [], [], [])
        for chunk in batch.chunks:
            seq = chunk.seq
            pos = seq.num_computed_tokens  # the one token this step computes
            table = table_slots(seq.block_table, 0)
            rows.input_ids.append(seq.token_ids[pos])
            rows.positions.append(pos)
            rows.slots.append(table[pos // block_size] * block_size + pos % block_size)
            rows.seq_lens.append(pos + 1)
            rows.tables.append(table)
            if window_scratch is not None:
                window = table_slots(seq.window_block_table, window_scratch)
                rows.window_slots.append(window[pos // block_size] * block_size + pos % block_size)
                rows.window_tables.append(window)
        return rows


class DecodeBuffers:
    """The static inputs of the decode forward, `max_batch` rows each; a step fills the first
    `size` rows, its sequences then padding. A captured graph reads these very tensors."""

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        *,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        window_scratch_block: int | None = None,
    ) -> None:
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.window_scratch_block = window_scratch_block
        window_scratch = scratch_block if window_scratch_block is None else window_scratch_block
        self.window_scratch_slot = window_scratch * block_size
        # Ids, positions, slots (both groups') and context lengths travel in one
        # host-to-device copy.
        self.vectors = torch.zeros(5, max_batch, dtype=torch.int64, device=device)  # [5, B]
        self.input_ids = self.vectors[0]  # [B]
        self.positions = self.vectors[1]  # [B]
        self.slot_mapping = self.vectors[2]  # [B]
        self.window_slot_mapping = self.vectors[4]  # [B]: unused with one group
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)  # [B]
        self.query_start_loc = torch.arange(  # one query token per row: fixed
            max_batch + 1, dtype=torch.int32, device=device
        )  # [B + 1]
        self.block_tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )  # [B, W]
        self.vectors[2].fill_(self.scratch_slot)
        self.vectors[4].fill_(self.window_scratch_slot)
        self.window_block_tables = None
        if window_scratch_block is not None:
            self.window_block_tables = torch.full_like(self.block_tables, window_scratch_block)
        self.sample_rows = torch.arange(max_batch, dtype=torch.int64, device=device)  # [B]

    @property
    def max_batch(self) -> int:
        return int(self.seq_lens.shape[0])

    def fill(self, rows: DecodeRows, size: int) -> list[int]:
        """Write `rows` and `size - len(rows)` padding rows; return the context lengths of all
        `size` rows. Block-table columns past the widest row keep older values: no row's
        context reaches them."""
        pad = size - len(rows.input_ids)
        if pad < 0 or size > self.max_batch:
            raise ValueError(f"{len(rows.input_ids)} rows do not fit a batch of {size}")
        seq_lens = rows.seq_lens + [1] * pad
        window_slots = rows.window_slots or rows.slots
        host = torch.tensor(
            [
                rows.input_ids + [0] * pad,
                rows.positions + [0] * pad,
                rows.slots + [self.scratch_slot] * pad,
                seq_lens,
                window_slots + [self.window_scratch_slot] * pad,
            ],
            dtype=torch.int64,
        )  # [5, size]
        self.vectors[:, :size].copy_(host)
        self.seq_lens[:size].copy_(self.vectors[3, :size])
        width = max(len(t) for t in rows.tables) if rows.tables else 1
        _fill_tables(self.block_tables, rows.tables, size, width, self.scratch_block)
        if self.window_block_tables is not None:
            assert self.window_scratch_block is not None
            _fill_tables(
                self.window_block_tables, rows.window_tables, size, width, self.window_scratch_block
            )
        return seq_lens


def _fill_tables(
    out: torch.Tensor, tables: list[list[int]], size: int, width: int, scratch: int
) -> None:
    """Rows [0, size) of `out` [B, W]: `tables` padded with `scratch`, then padding rows."""
    padded = [t + [scratch] * (width - len(t)) for t in tables]
    padded += [[scratch] * width] * (size - len(tables))
    out[:size, :width].copy_(torch.tensor(padded, dtype=torch.int32))


@dataclass(slots=True)
class DecodeStep:
    """A decode step whose inputs `DecodeGraphs.prepare` wrote into the static buffers."""

    num_seqs: int
    size: int  # the captured batch size it is padded to
    seq_lens_host: list[int]  # [size], the padding rows' included


class DecodeGraphs(abc.ABC):
    """Routes pure decode steps through the static buffers; everything else to the runner.
    How a size is captured and replayed is the subclass's: CUDA graphs, or eager."""

    def __init__(self, runner: ModelRunner, *, sizes: Sequence[int], max_model_len: int) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"captured sizes must be positive, got {list(sizes)}")
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        self.max_model_len = max_model_len
        block_size = runner.block_size
        self.window_scratch = runner.pools[1].scratch_block if len(runner.pools) > 1 else None
        self.buffers = DecodeBuffers(
            self.sizes[-1],
            -(-max_model_len // block_size),
            scratch_block=runner.scratch_block,
            block_size=block_size,
            device=runner.device,
            window_scratch_block=self.window_scratch,
        )
        self.replays = 0  # decode steps that ran through the buffers
        self.padding_rows = 0  # rows those steps padded, in all

    def capture(self) -> None:
        """Prepare every size, largest first (smaller CUDA graphs reuse the largest's pool),
        over buffers holding padding rows only."""
        for size in reversed(self.sizes):
            seq_lens = self.buffers.fill(DecodeRows([], [], [], [], []), size)
            self._capture(DecodeStep(num_seqs=0, size=size, seq_lens_host=seq_lens))

    def capture_inputs(self, size: int) -> StepInputs:
        """The buffers' first `size` rows as a step, planned for the longest allowed context:
        the launch a captured graph keeps for every step of this size."""
        return self._inputs(size, [self.max_model_len] * size)

    def prepare(self, batch: StepBatch) -> StepInputs | DecodeStep:
        num_seqs = decode_rows(batch)
        size = None if num_seqs is None else padded_batch_size(num_seqs, self.sizes)
        if num_seqs is None or size is None:
            return self.runner.prepare(batch)
        self.runner.apply_block_ops(batch.block_ops, batch.loaded)
        rows = DecodeRows.of(batch, self.runner.block_size, self.window_scratch)
        seq_lens = self.buffers.fill(rows, size)
        return DecodeStep(num_seqs=num_seqs, size=size, seq_lens_host=seq_lens)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs | DecodeStep) -> torch.Tensor:
        """Logits [S, V] float32, as `ModelRunner.execute` gives them."""
        if isinstance(inputs, StepInputs):
            return self.runner.execute(inputs)
        self.replays += 1
        self.padding_rows += inputs.size - inputs.num_seqs
        hidden = self._replay(inputs)  # [size, H]
        return self.runner.model.compute_logits(hidden[: inputs.num_seqs])  # [n, V]

    def _inputs(self, size: int, seq_lens_host: list[int]) -> StepInputs:
        b = self.buffers

        def meta(slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=slot_mapping[:size],
                query_start_loc=b.query_start_loc[: size + 1],
                seq_lens=b.seq_lens[:size],
                block_tables=block_tables[:size],
                block_size=self.runner.block_size,
                query_lens_host=[1] * size,
                seq_lens_host=seq_lens_host,
            )

        full = meta(b.slot_mapping, b.block_tables)
        window = None
        if b.window_block_tables is not None:
            window = meta(b.window_slot_mapping, b.window_block_tables)
        backend = self.runner.backend
        return StepInputs(
            input_ids=b.input_ids[:size],
            positions=b.positions[:size],
            meta=full,
            plan=backend.plan(full),
            sample_rows=b.sample_rows[:size],
            window_meta=window,
            window_plan=None if window is None else backend.plan(window),
        )

    @abc.abstractmethod
    def _capture(self, padding: DecodeStep) -> None: ...

    @abc.abstractmethod
    def _replay(self, step: DecodeStep) -> torch.Tensor: ...  # hidden [size, H]


class EagerDecodeGraphs(DecodeGraphs):
    """The buffers and padding of `CudaDecodeGraphs`, the forward run eagerly each step with
    attention planned for the step's real lengths. "Capture" runs each size's forward once
    (the warm-up a CUDA capture starts with); its writes land in the scratch block only."""

    def _capture(self, padding: DecodeStep) -> None:
        self._replay(padding)

    def _replay(self, step: DecodeStep) -> torch.Tensor:
        return self.runner.forward(self._inputs(step.size, step.seq_lens_host))


@dataclass(slots=True)
class _CapturedGraph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, H]: each replay overwrites it
    inputs: StepInputs  # keeps alive the plan (launch, split-KV scratch) the graph reads


class CudaDecodeGraphs(DecodeGraphs):
    """One CUDA graph per captured size; a decode step is a buffer fill and one replay."""

    def __init__(self, runner: ModelRunner, *, sizes: Sequence[int], max_model_len: int) -> None:
        super().__init__(runner, sizes=sizes, max_model_len=max_model_len)
        self._graphs: dict[int, _CapturedGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def _capture(self, padding: DecodeStep) -> None:
        size = padding.size
        inputs = self.capture_inputs(size)
        self._check_plan_reads_buffers(inputs)
        # Warm-up outside the graph, on a side stream as torch's capture recipe has it: Triton
        # compiles, cuBLAS picks its kernels, and the plan allocates its split-KV scratch,
        # none of which may happen during a capture.
        side = torch.cuda.Stream(self.runner.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self.runner.forward(inputs)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.runner.forward(inputs)  # [size, H]
        self._graphs[size] = _CapturedGraph(graph, hidden, inputs)

    def _replay(self, step: DecodeStep) -> torch.Tensor:
        captured = self._graphs[step.size]
        captured.graph.replay()
        return captured.hidden

    def _check_plan_reads_buffers(self, inputs: StepInputs) -> None:
        """A plan that converted an index tensor holds a copy frozen at capture: replays
        would read stale lengths and tables. The Triton plan keeps int32 contiguous inputs
        as they are; check that it did."""
        pairs = [(inputs.meta, inputs.plan)]
        if inputs.window_meta is not None:
            pairs.append((inputs.window_meta, inputs.window_plan))
        for meta, plan in pairs:
            for name in ("query_start_loc", "seq_lens", "block_tables"):
                planned = getattr(plan, name, None)
                if not isinstance(planned, torch.Tensor):
                    raise TypeError(f"{type(plan).__name__} has no {name} tensor to capture")
                if planned.data_ptr() != getattr(meta, name).data_ptr():
                    raise RuntimeError(f"the attention plan copied {name}: a graph would freeze it")


def make_step_runner(
    runner: ModelRunner, config: EngineConfig, max_model_len: int
) -> ModelRunner | DecodeGraphs:
    """CUDA graphs where they can run (CUDA, the Triton backend, `config.cuda_graphs`), captured
    now; otherwise the runner itself."""
    if not config.cuda_graphs or runner.device.type != "cuda":
        return runner
    if runner.backend.name != "triton":
        # The torch backend plans attention on the host each step: nothing a graph could keep.
        log.info("decode steps run eagerly: CUDA graphs need the triton attention backend")
        return runner
    sizes = graph_batch_sizes(config.max_num_seqs)
    graphs = CudaDecodeGraphs(runner, sizes=sizes, max_model_len=max_model_len)
    start = time.perf_counter()
    graphs.capture()
    log.info(
        "captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
        len(sizes),
        sizes[0],
        sizes[-1],
        time.perf_counter() - start,
    )
    return graphs
