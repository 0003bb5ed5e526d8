"""The experiment config: one JSON file of DeepSpeed's keys and fathom's (`model`, `data`, `train`), read,
checked the way the pinned DeepSpeed reads it, and recorded stretch by stretch in the run directory."""
