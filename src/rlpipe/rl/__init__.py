"""The RL math of rlpipe: pure library code, no Temporal, no database.

advantages.py  rewards -> per-trajectory advantages (GRPO, Dr. GRPO, RLOO, batch-whitened)
batch.py       Sample (one trajectory) and its collation into padded tensors (TrainBatch)
batching.py    global statistics, then the split over data-parallel ranks and micro-batches
losses.py      per-token PPO-clip loss, off-policy corrections, KL, entropy; the denominator protocol
step.py        one optimisation step on a causal LM (gradient accumulation, clip, optimiser step)
distributed.py the same step over torch.distributed ranks
"""
