"""Runs a depth study (schemes x depths on real data) and writes its report; see study/run.py.

python scripts/depth_study.py --study ds_configs/study_multi30k.json [--report]
"""

from fathom.study.run import main

if __name__ == "__main__":
    main()
