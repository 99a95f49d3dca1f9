"""The bench harness: the registry of operators, verification against the float64 oracle, the timing core,
the roofline, the runner behind check/bench/run, result files, reports and decision verdicts."""
