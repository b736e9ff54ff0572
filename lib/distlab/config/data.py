"""RunConfig's data section: what the ranks read (distlab.data), made on the machine."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, declare


@dataclass
class Data:
    """The data: a Markov chain made on the machine (distlab.data.dataset), endless or a
    finite set read by a distributed sampler; bnnet's Gaussian clusters; or yours."""

    data: str = declare("", "with a model of your own: your data, 'package.module:function' "
                        "(distlab.models.factory)")
    seq_len: int = declare(64, "tokens per row", at_least=1, at_most=1 << 20)
    successors: int = declare(3, "next-token choices per token; sets how low the loss can go",
                              at_least=1)
    dataset_size: int = declare(
        0, "0: fresh rows every step; > 0: a finite set read by a distributed sampler",
        at_most=1 << 31,
        feature=Feature("finite_data", "dataset_size > 0 (a finite dataset read by a "
                        "distributed sampler)"))
    drop_last: bool = declare(True, "sampler: drop the tail that does not divide among ranks")
    epochs: int = declare(1, "finite dataset: passes over it (each reshuffled by the sampler)",
                          at_least=1, at_most=100_000)
    join: bool = declare(False, "uneven inputs: ranks out of data shadow the others' "
                         "collectives",
                         feature=Feature("join", "join=True (uneven inputs: ranks out of data "
                                         "shadow the others' collectives)"))
    # bnnet's data (distlab.data.dataset.ClusterData)
    bn_classes: int = declare(4, "bnnet's data: Gaussian clusters, one per class", at_least=1,
                              was="classes")
    bn_features: int = declare(16, "bnnet's data: the clusters' dimensions", at_least=1,
                               was="features")
    bn_cluster_std: float = declare(1.0, "bnnet's data: each cluster's spread around its centre",
                                    at_least=0, was="cluster_std")
    bn_separation: float = declare(0.7, "bnnet's data: the class centres' std", at_least=0,
                                   was="separation")

    def check(self) -> None:
        if self.dataset_size < 0:
            raise ValueError(f"dataset_size={self.dataset_size} must be >= 0 (0 = endless)")
        if self.join and self.sync_bn:
            raise ValueError("join=True with sync_bn=True: a rank out of data cannot shadow "
                             "SyncBatchNorm's all-reduces in the forward (nor can torch's Join); "
                             "use drop_last=True or equal batches instead")
        if self.successors > self.vocab_size:
            raise ValueError(f"successors={self.successors} exceeds vocab_size={self.vocab_size}")
