#!/bin/bash
# each mutation in turn on /tmp/mut: the rank tests of the default run, stop at the first failure
cd /tmp/mut
TESTS="tests/test_rank_classes.py tests/test_rank_safety.py tests/test_agreement.py tests/test_fuzz_ranks.py tests/test_job_life.py tests/test_rank_order.py tests/test_tag.py tests/test_property_ranks.py tests/test_split.py tests/test_dynamic.py tests/test_ranks.py"
for m in "$@"; do
  git checkout -q -- .
  python3 /tmp/mutate.py $m > /dev/null || { echo "$m: not applied" >> /tmp/mutres/summary.txt; continue; }
  t0=$(date +%s)
  PYTHONPATH=/tmp/mut timeout 420 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider $TESTS > /tmp/mutres/$m.log 2>&1
  rc=$?
  first=$(grep -E "^FAILED|^ERROR" /tmp/mutres/$m.log | cut -c1-160 | tr "\n" ";")
  echo "$m: rc $rc, $(( $(date +%s) - t0 )) s, $(tail -1 /tmp/mutres/$m.log | cut -c1-120) | $first" >> /tmp/mutres/summary.txt
done
git checkout -q -- .
