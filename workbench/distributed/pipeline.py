"""Pipeline parallel (distributed.strategy: pp): each process is one stage of the model (workbench/model/
pipeline_stages.py) and torch.distributed.pipelining runs the step's micro-batches through the stages
(Schedule1F1B or ScheduleGPipe). The workbench writes no engine of its own: it builds this process's stage, hands
the schedule the step's micro-batches, and reads back the step's loss.

- The pipeline's micro-batches are the step's: training.grad_accum of them, micro_batch_size samples each, the
  same samples as one process's step. Every stage reads the same batch stream (the first stage feeds the input
  ids, the last the targets; every stage reads the position ids, from which it builds the mask and the rotary
  embeddings).
- The loss is normalised over the step's target tokens, known before the step (the loop's `totals`): the schedule
  runs with scale_grads=False and each micro-batch's loss is its token-loss sum over the step's targets, so the
  gradients are one process's.
- A schedule sizes its receive buffers from the first micro-batch it runs: the step's micro-batches are padded to
  one shape (pipeline_stages.padded), and a step of another shape gets a schedule of its own (built again, which
  runs one forward and an input-gradient pass to learn the shapes, under a forked random state: no parameter's
  gradient and no draw of the run's random stream is touched).
- The last stage holds the loss: the step's loss and sums are broadcast from it, so every process logs the same.
"""

from __future__ import annotations

import torch

from workbench.base.errors import RecipeError
from workbench.data.tokens import IGNORE
from workbench.model import pipeline_stages
from workbench.model.lm_loss import causal_lm_of

class Pipeline:
    """This process's stage and the schedule that runs a step's micro-batches through every stage."""

    def __init__(self, model, accelerator, recipe, pad_token_id: int):
        stages, stage = accelerator.num_processes, accelerator.process_index
        causal_lm = causal_lm_of(model)
        settings = recipe.distributed.pipeline
        pipeline_stages.check_stages(recipe.model.path, len(causal_lm.model.layers), stages,
                                     recipe.training.grad_accum, settings.schedule)
        if accelerator.mixed_precision == "fp16":
            raise RecipeError("training.mixed_precision: fp16 under strategy pp: the schedule runs backward itself, "
                              "where accelerate's loss scaler does not reach; use bf16 or no")
        self.accelerator, self.causal_lm, self.stage_index, self.stages = accelerator, causal_lm, stage, stages
        self.module = pipeline_stages.keep_stage(model, stage, stages, recipe.model.path)
        self.first, self.last = self.module.first, self.module.last
        self.schedule_name, self.micro_batches = settings.schedule, recipe.training.grad_accum
        self.rows, self.pad_token_id = recipe.training.micro_batch_size, pad_token_id
        self.chunked_head = recipe.training.fast_paths
        self.schedule, self.shape = None, None
        self.total_targets = torch.ones(())
        self.loss_sums: list[torch.Tensor] = []

    @property
    def layers(self) -> range:
        return self.module.layer_indices

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for one micro-batch: its token-loss sum over the step's target tokens."""
        loss_sum = pipeline_stages.head_loss_sum(self.causal_lm, hidden, labels, self.chunked_head)
        self.loss_sums.append(loss_sum.detach().float())
        return loss_sum / self.total_targets

    def _schedule_for(self, shape: tuple[int, int]):
        """The schedule for micro-batches of `shape` (rows, tokens): the last one's, or a new one."""
        if shape != self.shape:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(self.module, self.stage_index, self.stages, self.accelerator.device)
            kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[self.schedule_name]
            self.schedule, self.shape = kind(stage, self.micro_batches, loss_fn=self._loss, scale_grads=False), shape
        return self.schedule

    def step(self, micro_batches: list[dict], total_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one step's micro-batches through every stage: (the step's loss, its [loss sum,
        targets]), the same on every process. `total_targets`: the step's target tokens over every micro-batch."""
        width = max(batch["input_ids"].shape[1] for batch in micro_batches)
        batches = [pipeline_stages.padded(batch, self.rows, width, self.pad_token_id) for batch in micro_batches]
        while len(batches) < self.micro_batches:  # an epoch's short last step: micro-batches with no target
            batches.append(pipeline_stages.padded({key: value[:0, :0] for key, value in batches[0].items()},
                                                  self.rows, width, self.pad_token_id))
        whole = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
        schedule = self._schedule_for((self.rows, width))
        self.total_targets = total_targets.clamp(min=1)
        losses: list[torch.Tensor] = []
        inputs = (whole["input_ids"],) if self.first else ()
        target = {"target": whole["labels"], "losses": losses} if self.last else {}
        with self.accelerator.autocast():
            schedule.step(*inputs, position_ids=whole["position_ids"], **target)
        device = self.accelerator.device
        if self.last:  # (a new schedule's shape inference ran the loss once more, first)
            loss_sum = torch.stack(self.loss_sums[-self.micro_batches:]).sum()
            figures = torch.stack([torch.stack(losses).sum().detach().float(), loss_sum,
                                   (whole["labels"] != IGNORE).sum().float()]).to(device)
        else:
            figures = torch.zeros(3, device=device)
        self.loss_sums.clear()
        torch.distributed.broadcast(figures, src=self.stages - 1)
        return figures[0], figures[1:]


def gather_on_main(accelerator, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors (on the host, keyed by their global names) in one dict on the main process; None on
    the others. A collective: every process calls it."""
    own = {name: value.detach().cpu() for name, value in tensors.items()}
    gathered = [None] * accelerator.num_processes if accelerator.is_main_process else None
    torch.distributed.gather_object(own, gathered, dst=0)
    if not accelerator.is_main_process:
        return None
    whole: dict[str, torch.Tensor] = {}
    for part in gathered:
        whole.update(part)
    return whole
