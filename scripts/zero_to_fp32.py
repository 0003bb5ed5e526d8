"""A run's checkpoint as one consolidated state dict, as DeepSpeed's zero_to_fp32.py promises: see
pipeline/checkpoint/consolidated.py or --help."""

from fathom.pipeline.checkpoint.consolidated import main

if __name__ == "__main__":
    main()
