"""Where things are inside the pods the builders make: the trainer's config, the checkpoint
volume and what lives on it, the claims `pvc://` URIs name, and the namespace's cache.
One place, because a mount and the config that points into it must agree."""

from __future__ import annotations

CONFIG_DIR = "/etc/kubetune"
CONFIG_KEY = "config.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CHECKPOINT_DIR = "/checkpoints"
OUTPUT_DIR = f"{CHECKPOINT_DIR}/output"
TRAIN_LOG = f"{CHECKPOINT_DIR}/train-log.jsonl"
"""The trainer's JSON-lines record of every step, checkpoint and restart, on the volume so
that it survives pods and attempts (docs/trainer.md describes the records)."""
HF_HOME = f"{CHECKPOINT_DIR}/.hf-cache"
PVC_ROOT = "/mnt/pvc"
CACHE_DIR = "/cache"
