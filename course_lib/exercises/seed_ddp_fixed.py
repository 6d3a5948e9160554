"""The seed's DDP program, fixed: the reference solution of notebook 04's capstone (``course_lib.exercises.ex04``).

What changed, line by line against the seed: the device comes from LOCAL_RANK (not the global rank), it is picked
before init_process_group, the learning rate follows the global batch (linear scaling), and the process group is
destroyed at the end, also when training fails.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.exercises import ex04

local_rank = int(os.environ["LOCAL_RANK"])               # set by torchrun: this worker's index on its node
device = ex04.node_gpus()[local_rank]
ex04.set_device(device)                                  # before init_process_group
dist.init_process_group(backend="gloo", init_method="env://")
try:
    model = DDP(ex04.YourModel().to(device))
    criterion = nn.CrossEntropyLoss()
    lr = ex04.BASE_LR * dist.get_world_size()            # the global batch is world_size x 32
    optimizer = optim.SGD(model.parameters(), lr=lr)

    train_dataset = ex04.YourDataset()
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(dataset=train_dataset, sampler=train_sampler,
                                               batch_size=ex04.PER_RANK_BATCH)
    for epoch in range(3):
        train_sampler.set_epoch(epoch)
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
    ex04.report(model, optimizer)
finally:
    dist.destroy_process_group()
