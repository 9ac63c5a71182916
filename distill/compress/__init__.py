"""Model -> model transforms that make a trained network cheaper to run: structural pruning (``prune``),
truncated-SVD factorisation of linear and convolution weights (``lowrank``) and kernel fusion (``fusion``:
Conv+BN(+ReLU) folding, fused QKV projections, channels-last memory, ``torch.compile``). Each transform
returns the model it changed and a record of what it did, and exports stay diffusers models that
``from_pretrained`` loads back.
"""
