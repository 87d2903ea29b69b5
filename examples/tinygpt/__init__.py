"""tinygpt: the pieces of ``examples/train.py`` (config, model, data, parallelism,
checkpoints, the training loop and its reports), one concept per module."""
