"""draftsmith.kernels: Triton kernels for the decoder (verify.py: fused chain verification; tree.py: tree masks
from parent pointers; kv.py: KV compaction), each with a PyTorch reference used off-GPU or without Triton."""
