#!/bin/bash
# old and new engines side by side, one core each: the depth suite at 256 and 1024 tokens
. /work/main/.venv/bin/activate
export OPENBLAS_NUM_THREADS=1
cd /tmp
RUN='import sys; from dflash_mlx.cli import main; sys.argv=["dflash-mlx"]+sys.argv[1:]; sys.exit(main())'
PYTHONPATH=/tmp/old_wt python -c "$RUN" bench --suite depth --draft smollm2-135m --depth-repeats 3 --depths 256,1024 --depth-widths 4 --out /tmp/exp/ab_old > /tmp/exp/ab_old.log 2>&1 &
PYTHONPATH=/work/main python -c "$RUN" bench --suite depth --draft smollm2-135m --depth-repeats 3 --depths 256,1024 --depth-widths 4 --out /tmp/exp/ab_new > /tmp/exp/ab_new.log 2>&1 &
wait
