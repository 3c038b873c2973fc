"""Launching runs on clusters: the learner layout planner (plan.py) and the Slurm job renderer
(slurm.py) behind slurm/launch.sh. Pure Python: nothing here imports torch or megatron, so a
login node without either can check a layout and submit a job."""
