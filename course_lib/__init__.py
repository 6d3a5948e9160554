"""course_lib: the tested code behind the notebooks of the distributed-training course.

The layers, each using only itself and those above it (``tests/test_house.py`` checks it):

============================  ==================================================================================
``hardware``                  what this machine has; the backend policy; each rank's device (by local rank)
``launch/``                   ranks from a notebook cell (``launch.run``), the rank's side (``launch.worker``),
                              errors, and ``torchrun`` jobs from a cell (``launch.commands``)
``parallelism``               how many cores two ranks really get here (measured), and the speed-up to expect
``data``, ``models/``         generated data sets; the course's models, built from a seed
``checkpoint``                atomic saves by one rank, safe loads on every rank
``comm/``                     collectives' meaning, all-reduce from scratch, the α-β cost model, the collectives
                              that run, recorded (``comm.record``), the all-to-all (``comm.alltoall``)
``data_parallel/``            gradient averaging, MiniDDP, the training loop and its one-process reference
``model_parallel/``           layers split across devices in one process
``pipeline_parallel/``        GPipe and 1F1B: schedules, simulation, stages as processes; torch's own pipelining
``zero/``                     sharded data parallelism: ZeRO-1/2/3 from scratch, FSDP2 and DCP workers
``tensor_parallel/``          each layer's matrices split across ranks: f and g, column/row-parallel layers, split
                              blocks, sequence parallelism, DTensor plans, the 2-D mesh
``context_parallel/``         attention over a sequence split across ranks (ring, zig-zag, all-gather, Ulysses)
``expert_parallel/``          mixture-of-experts layers whose experts live on different ranks (all-to-all)
``composed/``                 data × tensor × pipeline parallelism on one mesh, equal to one process
``memory/``                   the bytes training needs, predicted and measured: activations, recomputation,
                              accumulation, the layout calculator
``precision/``                number formats, mixed precision, loss scaling, precision on the wire
``layout/``                   a cluster's layouts ranked by predicted step time, memory and MFU
``faults``                    things broken on purpose, each ending as a clear error
``viz/``                      pictures, explorers (widgets) and source listings
``exercises/``                the checks of the notebooks' exercises
``recipes/``                  scripts that run unchanged under torchrun (and SLURM)
``course_map``, ``doctor``, ``hub/``  the notebooks and what runs here (``python -m course_lib map|doctor``); one VM
                              for a class: JupyterHub with a seat per learner (``make hub``)
============================  ==================================================================================

Notebook → the modules it shows and uses:

* 00 welcome: ``course_map``, ``doctor``, ``hardware``, ``launch``
* 01 ranks and collectives: ``launch``, ``comm.collectives``, ``viz.collectives``, ``viz.widgets``, ``exercises.ex01``
* 02 all-reduce from scratch: ``comm.allreduce``, ``comm.costmodel``, ``comm.sweep``, ``viz``, ``viz.costs``,
  ``exercises.ex02``
* 03 data parallelism from scratch: ``data_parallel`` (``mini_ddp``, ``training``, ``measure``), ``viz.training``,
  ``exercises.ex03``
* 04 DDP in practice: ``data_parallel`` (``ddp_features``, ``training``), ``parallelism``, ``exercises.ex04``
* 05 DDP with NCCL and torchrun: ``recipes.train_ddp``, ``launch.commands``, ``data_parallel.measure``,
  ``comm.costmodel``, ``exercises.ex05``
* 06 model parallelism: ``memory``, ``model_parallel``, ``viz.widgets`` (``MemoryCalculator``), ``exercises.ex06``
* 07 pipeline schedules: ``pipeline_parallel`` (``schedules``, ``stages``, ``torch_pipelining``), ``parallelism``,
  ``viz.pipeline``, ``viz.widgets`` (``ScheduleExplorer``), ``exercises.ex07``
* 08 faults and debugging: ``faults``, ``checkpoint``, ``recipes.train_ddp``, ``launch.commands``, ``exercises.ex08``
* 09 ZeRO from scratch: ``zero`` (``flat``, ``optimizer``, ``stage3``, ``api``, ``training``, ``measure``, ``clip``,
  ``meta_init``), ``models.tiny_lm``, ``memory``, ``viz.sharding``, ``viz.widgets`` (``MemoryCalculator``),
  ``exercises.ex09``, ``exercises.ex09_zero3``
* 10 FSDP2 and distributed checkpoints: ``zero`` (``measure``, ``flat``, ``fsdp2``, ``training``), ``memory``,
  ``comm.costmodel``
* 11 tensor parallelism: ``tensor_parallel`` (``operators``, ``layers``, ``blocks``, ``comm``, ``cost``, ``check``),
  ``models.transformer``, ``comm.record``, ``viz.tensor_parallel``, ``viz.megatron``, ``exercises.ex11``
* 12 sequence parallelism, DTensor and 2-D meshes: ``tensor_parallel`` (``sequence``, ``random``, ``dtensor``,
  ``training``), ``memory.saved``, ``memory.activations`` (``split_block_worker``), ``comm.record``
* 13 activation memory: ``memory`` (``activations``, ``saved``, ``fused``, ``timeline``, ``recompute``),
  ``exercises.ex13``
* 14 mixed precision: ``precision`` (``formats``, ``mixed``, ``scaling``, ``speed``, ``wire``), ``memory``
  (``accumulation``)
* 15 context parallelism: ``context_parallel`` (``blocks``, ``ring``, ``allgather``, ``ulysses``, ``traffic``),
  ``viz.context``, ``exercises.ex15``
* 16 expert parallelism: ``expert_parallel``, ``viz.experts``, ``exercises.ex16``
* 17 putting it together: ``composed`` (``mesh``, ``stages``, ``count``, ``training``), ``layout`` (``shapes``,
  ``space``, ``memory``, ``timing``, ``ranking``, ``mfu``, ``reference``, ``fake``, ``published``), ``viz.mesh``,
  ``viz.widgets`` (``LayoutPlanner``), ``exercises.ex17``
"""
__version__ = "0.2.0"
