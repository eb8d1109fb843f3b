"""Post-training: on-policy distillation from domain teachers (``wanka distill``) and GRPO with
verifiable rewards (``wanka rl``).

``losses`` holds the per-token objectives, ``rewards`` the reward functions, ``prompts`` the
domain-tagged prompt sets; the training loops build on them.
"""
