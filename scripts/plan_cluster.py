"""A plan for a cluster before launching: python scripts/plan_cluster.py --config RECIPE --gpus N --gpu-memory 80GB."""

from fathom.planner.cluster_plan import main

if __name__ == "__main__":
    main()
