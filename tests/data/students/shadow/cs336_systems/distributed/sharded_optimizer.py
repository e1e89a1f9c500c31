"""The sharded optimizer at the same module path as the grading suite's, with a planted bug: each rank
steps its shard but never broadcasts it, so the ranks' weights drift apart."""

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.kwargs, self.inner = optimizer_cls, kwargs, None
        super().__init__(params, kwargs)

    def add_param_group(self, group):
        super().add_param_group(group)
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {
            **group,
            "params": [p for i, p in enumerate(self.param_groups[-1]["params"]) if i % world == rank],
        }
        if self.inner is None:
            self.inner = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.inner.add_param_group(mine)

    def step(self, closure=None):
        self.inner.step(closure)  # planted bug: no broadcast of each rank's updated shard
