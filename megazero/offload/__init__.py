"""Where state lives off the device: exactly sized (page-locked) host memory and NVMe swap files.

``host_memory`` (``HostArena``: one allocation cut into parts, registered with CUDA), ``swap``
(``SwapFile``: one rank's checked swap file, ``IoCounter``, ``check_everywhere``),
``param_swap`` (``ParamSwapper``: ZeRO-3's parameter shards in a swap file, read into a bounded
set of host slots) and ``swap_dirs`` (the swap folders: made with their owner recorded, swept
once that process is gone, ``--offload-nvme-path`` checked before launch; standard library
only). Storage only: the ZeRO strategies (``data_parallel``) and the offloading optimizers
(``optim.offload``, ``optim.nvme``) both build on it, and it imports neither.
"""
