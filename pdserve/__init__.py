"""pdserve's tools on top of every package: the `pdserve` command line, the demo, the
benchmarks and the process launcher that tests, scripts, the demo and the benchmarks use."""
