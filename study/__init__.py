"""The depth study: norm schemes x depths (and further grids) trained on real data, each cell classified
and reported (scripts/depth_study.py)."""
