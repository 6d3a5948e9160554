"""Training scripts that run unchanged under ``torchrun``:
``python -m torch.distributed.run ... -m course_lib.recipes.NAME``."""
