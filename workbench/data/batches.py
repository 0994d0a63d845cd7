"""Batches: the collator (no attention mask: padding continues the row's last sample, and targets never cross
a sample boundary), and the samplers that deal each process its micro-batches of every step, the same on a
resume."""

from __future__ import annotations

import json
import math
import random
import torch
from workbench.data.tokens import IGNORE

class Collator:
    """Right-pads a list of examples into tensors and shifts labels into next-token targets.

    `labels[t]` is the target for position t (the token at t+1), or -100 where t+1 starts a new
    sample or is padding, so no loss ever crosses a sample boundary.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict:
        longest = max(len(e["input_ids"]) for e in examples)
        width = -(-longest // self.multiple) * self.multiple
        batch = {name: torch.full((len(examples), width), fill, dtype=torch.long)
                 for name, fill in (("input_ids", self.pad_token_id), ("labels", IGNORE), ("position_ids", 0))}
        batch["num_samples"] = 0
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            batch["input_ids"][row, :n] = torch.tensor(example["input_ids"])
            positions = torch.tensor(example["position_ids"])
            batch["position_ids"][row, :n] = positions
            # padding continues the row's last sample: it attends only backwards and carries no target, so the real
            # tokens are untouched, and a row of one sample stays one sample (no mask needed on a GPU)
            batch["position_ids"][row, n:] = torch.arange(width - n) + (positions[-1] + 1 if n else 0)
            labels = torch.tensor(example["labels"])
            starts = sample_starts(positions)
            batch["labels"][row, : n - 1] = torch.where(starts[1:], IGNORE, labels[1:])
            batch["num_samples"] += int(starts.sum())
        if "desirable" in examples[0]:  # unpaired rows: one label per example of two samples, in batch order
            batch["desirable"] = torch.tensor([d for e in examples for d in e["desirable"]], dtype=torch.bool)
        if "row" in examples[0]:  # prompt rows (GRPO): each prompt's length and its row, for generation and rewards
            batch["prompt_lengths"] = torch.tensor([len(e["input_ids"]) for e in examples])
            batch["rows"] = [json.loads(e["row"]) for e in examples]
        # counts for throughput and FLOPs, as Python ints: the loop reads them without waiting for the device
        batch["num_tokens"] = sum(len(e["input_ids"]) for e in examples)
        # causal attention work: a real token at position p attends to p + 1 positions
        batch["num_attended"] = sum(p + 1 for e in examples for p in e["position_ids"])
        if any(e.get(STAND_IN) for e in examples):  # trains nothing and counts nothing (StepBatches)
            batch[STAND_IN], batch["num_tokens"], batch["num_attended"] = True, 0, 0
        return batch


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a sample starts: at the first position of a row and wherever positions do not continue (a new
    sample at 0, or an answer continuing its pair's shared prompt)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


class EpochSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch, so a resumed run sees exactly the same order."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.size))
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return iter(order)


STAND_IN = "stand_in"


class StepBatches(torch.utils.data.Sampler):
    """This process's micro-batches of each epoch (a batch sampler): every optimizer step holds the same samples
    whatever the process count and the micro-batch x accumulation split of the same samples per step.

    The epoch's order (EpochSampler) is cut into chunks of `micro_batch` samples, dealt to the processes in turn:
    process r takes chunks r, r + W, r + 2W, ... Each step of `grad_accum` micro-batches on every process then holds
    the next micro x accumulation x W samples of the order. An epoch they do not divide ends on a short step holding
    the rest, in which a process may have a short chunk or none: for a missing chunk it runs a stand-in (a sample
    marked STAND_IN, weighted by zero), so that every process runs the same passes, whose collectives (DDP, FSDP,
    DeepSpeed) wait for each other. No sample is repeated and none left out (accelerate's sharding of a loader
    fills such a step up with samples from the start of the epoch)."""

    def __init__(self, size: int, micro_batch: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True):
        self.order = EpochSampler(size, seed, shuffle)
        self.micro_batch, self.world_size, self.rank, self.skip = micro_batch, world_size, rank, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch to deal next, from this process's micro-batch `skip` on (a resumed run)."""
        self.order.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        """This process's micro-batches in a whole epoch (the same on every process)."""
        return math.ceil(math.ceil(self.order.size / self.micro_batch) / self.world_size)

    def __iter__(self):
        order = list(self.order)
        for k in range(self.skip, len(self)):
            start = (k * self.world_size + self.rank) * self.micro_batch
            yield order[start:start + self.micro_batch] or [-1 - order[-1]]  # TrainRows: index -1 - i stands in


class FirstEpochBatches:
    """The first epoch's micro-batches as one process of `world_size` (rank `rank`) is dealt them, each with the mask
    of its real positions (not padding, not a stand-in): what a data-driven adapter init (EVA) reads. Collated as
    they are read (a reader that cycles them, as peft's EVA does, keeps those it has read)."""

    def __init__(self, rows, collate, micro_batch: int, world_size: int, rank: int, seed: int):
        self.rows, self.collate = TrainRows(rows), collate
        self.dealt = StepBatches(len(rows), micro_batch, world_size, rank, seed)

    def __len__(self) -> int:
        return len(self.dealt)

    def __iter__(self):
        self.dealt.set_epoch(0)
        for indices in self.dealt:
            examples = self.rows.__getitems__(indices)
            batch = self.collate(examples)
            lengths = torch.tensor([0 if e.get(STAND_IN) else len(e["input_ids"]) for e in examples])
            mask = torch.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]
            yield {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": mask}


def first_rows(rows, seed: int, count: int) -> list[dict]:
    """The first `count` training rows of the first epoch, the same on every process (CorDA's calibration)."""
    order = EpochSampler(len(rows), seed)
    return [rows[i] for i in list(order)[:count]]


class TrainRows(torch.utils.data.Dataset):
    """The training rows by index, for StepBatches: row i, or at index -1 - i row i as a stand-in."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index] if index >= 0 else {**self.rows[-1 - index], STAND_IN: True}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """A micro-batch's rows in one read where the rows allow it (a data set's own __getitems__)."""
        read = getattr(self.rows, "__getitems__", None)
        return read(indices) if read is not None and min(indices) >= 0 else [self[i] for i in indices]
