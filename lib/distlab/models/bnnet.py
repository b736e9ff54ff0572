"""A small classifier with BatchNorm: the model of the SyncBatchNorm lesson.

    x (features) → Linear → BatchNorm1d → ReLU → Linear → BatchNorm1d → ReLU → Linear → logits

It classifies the Gaussian clusters of distlab.data.dataset.ClusterData. Like the GPT, forward(x,
targets) returns the mean loss over this rank's rows. BatchNorm is the one layer whose output
for a row depends on the other rows of the batch, which is why data parallelism changes what it
computes unless its statistics are synchronised (distlab.parallel.data_parallel.syncbn).

The Linear layers in front of BatchNorm have no bias: BatchNorm subtracts the mean, so a bias
there would be cancelled (BatchNorm's own β takes its place).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from distlab.data.dataset import cluster_data


class BNNet(nn.Module):
    def __init__(self, features: int = 16, classes: int = 4, hidden: int = 64,
                 hidden_layers: int = 2):
        super().__init__()
        layers, width = [], features
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x, targets=None):
        logits = self.head(self.body(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)  # mean over this rank's rows


def build_bnnet(cfg) -> nn.Module:
    """The BatchNorm net for a RunConfig: inputs and classes from its ClusterData (cfg.extra
    "features", "classes"), hidden width cfg.n_embd, cfg.hidden_layers hidden
    layers. (cfg.sync_bn is applied to it, as to any model, where the rank builds it.)"""
    data = cluster_data(cfg)
    return BNNet(data.features, data.classes, cfg.n_embd, cfg.hidden_layers)
