"""Context parallelism: the sequence of each micro-batch split over the ``cp`` ranks.

``zigzag`` is the pure rank arithmetic of the causal load balancing (which tokens a cp rank
holds, which attention blocks it computes); ``blockwise`` is the attention math of one block
(forward, log-sum-exp merge, FlashAttention-2 backward) as einsums, ``fused_blocks`` the same
block through PyTorch's fused kernels (the ring's default where one exists); ``attention`` holds the three entry
points and their communication: ``ring_attention`` (``--cp-comm-type p2p``),
``all_to_all_attention`` (``--cp-comm-type a2a``) and ``local_attention`` (cp = 1).
"""
