"""The scenarios of `textgen-bench`, a module each (bench.cli names them); serving_report and serving_hf
are the serving scenario's own parts."""
