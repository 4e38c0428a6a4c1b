#!/bin/bash
# On the device host (16 CPUs): each mutation in its own copy of the checkout, all at once,
# the default run's rank tests with one xdist worker each, stopping at the first failure (-x);
# "control" (no mutation) runs beside them under the same load. Results under $OUT/mut.
# From the checkout's root: LIMIT=470 bash benchmarks/mutate_ranks.sh control busy gone ...
R=$PWD; O=${OUT:-/tmp/out}/mut; mkdir -p $O
TESTS="tests/test_rank_classes.py tests/test_rank_safety.py tests/test_agreement.py tests/test_fuzz_ranks.py tests/test_job_life.py tests/test_rank_order.py tests/test_tag.py tests/test_property_ranks.py tests/test_split.py tests/test_dynamic.py tests/test_ranks.py"
one() {
  m=$1; d=/tmp/mut_$m; rm -rf $d; mkdir -p $d
  (cd $R && tar --exclude=.git --exclude=.venv* --exclude=benchmarks/results -cf - .) | tar -xf - -C $d
  python3 $R/benchmarks/mutate_ranks.py $m $d > /dev/null || { echo "$m: not applied" > $O/$m.sum; return; }
  t0=$(date +%s)
  (cd $d && PYTHONPATH=$d timeout ${LIMIT:-480} python3 -m pytest -q -x -n 1 -p no:cacheprovider $TESTS > $O/$m.log 2>&1)
  rc=$?
  first=$(grep -E "^FAILED|^ERROR" $O/$m.log | cut -c1-160 | tr "\n" ";")
  echo "$m: rc $rc, $(( $(date +%s) - t0 )) s, $(tail -1 $O/$m.log | cut -c1-120) | $first" > $O/$m.sum
}
for m in "$@"; do one $m & sleep 1; done
wait
cat $O/*.sum
