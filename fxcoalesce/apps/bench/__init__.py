"""The benchmark tools: ``bench`` (run, variants, timing, report), ``calibrate`` and the
generated-code overlap reader."""
