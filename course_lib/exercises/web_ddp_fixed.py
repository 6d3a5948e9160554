"""A typical DDP script from the web, fixed: the reference solution of notebook 05's capstone
(``course_lib.exercises.ex05``).

What changed, line by line against the script from the web: the device comes from LOCAL_RANK (not the global
rank), it is picked before init_process_group, the learning rate follows the global batch (linear scaling), and the
process group is destroyed at the end, also when training fails.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.exercises import ex05

local_rank = int(os.environ["LOCAL_RANK"])               # set by torchrun: this worker's index on its node
device = ex05.node_gpus()[local_rank]
ex05.set_device(device)                                  # before init_process_group
dist.init_process_group(backend="gloo", init_method="env://")
try:
    model = DDP(ex05.YourModel().to(device))
    criterion = nn.CrossEntropyLoss()
    lr = ex05.BASE_LR * dist.get_world_size()            # the global batch is world_size x 32
    optimizer = optim.SGD(model.parameters(), lr=lr)

    train_dataset = ex05.YourDataset()
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(dataset=train_dataset, sampler=train_sampler,
                                               batch_size=ex05.PER_RANK_BATCH)
    for epoch in range(3):
        train_sampler.set_epoch(epoch)
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
    ex05.report(model, optimizer)
finally:
    dist.destroy_process_group()
