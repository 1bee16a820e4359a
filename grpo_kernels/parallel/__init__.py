"""Vocabulary-parallel output heads: the fused GRPO loss and selective log-probs of a head whose
[V, D] weight is split along the vocabulary across the ranks of a process group (tensor
parallelism), without any rank holding [N, V] logits.

    shard.py       the shard (where this rank's rows lie), its two forms (a DTensor with
                   Shard(0), or a local shard with vocab_group=), and the agreement collective
    agreement.py   a call's checks in the order that keeps every rank in step
    combine.py     the whole vocabulary's statistics from every shard's (one all-gather)
    logprobs.py    differentiable selective log-probs: the four-pass route
    three_pass.py  the three-pass route, the statistics combined per chunk

`functional.fused_linear_grpo_loss` and `functional.selective_logprobs` come here when their
weight is a DTensor or `vocab_group=` is given; the GRPO math runs on the combined log-probs as
for a whole head, the same on every rank. docs/integrations.md, "Tensor parallelism", has the
user's view.
"""

from .agreement import CallInputs, agreed
from .logprobs import linear_logprobs
from .shard import (
    VocabParallelError,
    VocabShard,
    check_vocab_group,
    is_vocab_parallel,
    local_head,
)
from .three_pass import linear_grpo_loss

__all__ = ["CallInputs", "VocabParallelError", "VocabShard", "agreed", "check_vocab_group",
           "is_vocab_parallel",
           "linear_grpo_loss", "linear_logprobs", "local_head"]
