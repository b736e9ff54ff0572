"""The data, made on the machine (nothing is downloaded): the Markov-chain tokens and the
Gaussian clusters (dataset.py), and the sampler that gives each rank its rows (sampler.py).

May import: the foundation only.
"""
