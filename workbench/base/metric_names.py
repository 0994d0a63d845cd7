"""Names of the figures in metrics.jsonl that code reads back (charts, the UI, the summary), where a bare word would
read as something else."""

# A GRPO run's weighted reward (TRL's name for it). Also the name of an objective (a reward model): code that reads
# the figure names it by this constant, never by the word objectives are compared by.
REWARD_METRIC = "reward"
